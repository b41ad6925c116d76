"""Typed run configuration: frozen msgspec structs decoded from TOML (the schema).

Keys follow the ABCD trainer's names (`training.fade.overlap`, `optimization.kl`, ...) so its users
feel at home; a stage is one `[[stages]]` record. A config is read (TOML, then the flat per-stage
lists translated to stages, then its types walked, then its rules checked, every problem at once) by
`rewind.states.config_reading`; its identity (`config_hash`) is `rewind.states.config_identity`.
This module holds the schema only, and `dumps_config` (its TOML text).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from rewind.states.config_error import ConfigError as ConfigError  # (re-exported: the config's own error)
from rewind.states.stages import (  # (re-exported: a stage and its settings are the config's records)
    AnyStage as AnyStage,
)
from rewind.states.stages import (
    DistillSettings as DistillSettings,
)
from rewind.states.stages import (
    DpoSettings as DpoSettings,
)
from rewind.states.stages import (
    GrpoSettings as GrpoSettings,
)
from rewind.states.stages import (
    RewardSpec as RewardSpec,
)
from rewind.states.stages import (
    Sampling as Sampling,
)
from rewind.states.stages import (
    SftSettings as SftSettings,
)
from rewind.states.stages import (
    Stage as Stage,
)
from rewind.states.structs import Struct
from rewind.states.tomlwrite import dumps

CurveName = Literal["linear", "cosine", "sigmoid"]
LrScheduleName = Literal["wsds", "wsd", "cosine", "sgdr", "constant", "cosine_rewarm"]
KlKind = Literal["token_kl", "nll_difference"]
NormName = Literal["rmsnorm", "layernorm"]
NonFiniteAction = Literal["stop", "skip"]
DataKind = Literal["tokens", "jsonl", "text", "parquet"]
MlpName = Literal["gelu", "swiglu"]
RopeScalingName = Literal["none", "linear", "llama3"]
SplitMode = Literal["", "random", "tail"]
EpochEndPolicy = Literal["reshuffle", "repeat"]
StackPosition = Literal["append", "prepend"]
InitMode = Literal["random", "copy", "identity"]
TrunkChoice = Literal["full", "frozen", "lora", "qlora"]
Precision = Literal["fp32", "bf16", "nf4"]
RankPattern = Literal["fixed", "increasing", "decreasing", "linear", "table"]
CacheChoice = Literal["auto", "on", "off"]
ObjectiveKind = Literal["clm", "mlm", "diffusion"]
DeviceName = Literal["auto", "cpu", "cuda"]
ComputePrecision = Literal["fp32", "bf16-autocast", "bf16-mixed"]
LossKernel = Literal["logits", "chunked", "triton"]

# Embedded synthetic datasets the engine generates in code (no download). Their names live here so
# that a config can be checked without importing torch; the engine's registry asserts it matches.
BUILTIN_DATASETS: tuple[str, ...] = ("grammar", "reverse", "sort", "add")


class RunSection(Struct):
    seed: int = 0  # every random choice derives from it: the initial weights, the data order, every sample
    name: str = "run"  # the run's name in plots' titles and `rewind state` / `rewind timeline --json`


class RopeScalingSection(Struct):
    # RoPE's inverse frequencies as transformers computes them: none (1 / base^(2i / head_dim)), linear (each
    # divided by factor), llama3 (Llama 3.1: wavelengths above original_max_position_embeddings / low_freq_factor
    # divided by factor, below original_max_position_embeddings / high_freq_factor kept, smoothed between).
    type: RopeScalingName = "none"
    factor: float = 8.0  # linear, llama3: how much longer a context the frequencies stretch to
    low_freq_factor: float = 1.0  # llama3: wavelengths above original_max_position_embeddings / it are slowed
    high_freq_factor: float = 4.0  # llama3: wavelengths below original_max_position_embeddings / it are kept
    original_max_position_embeddings: int = 8192  # llama3: the context the model was first trained on


class ArchitectureSection(Struct):
    block_size: int = 64  # the context: tokens per row (a step trains training.batch_size rows of it)
    vocab_size: int = 256  # the embedding's and the head's rows: token ids are below it (256: UTF-8 bytes)
    num_layers: int = 2  # transformer blocks
    num_heads: int = 4  # attention heads (they divide d_model)
    d_model: int = 64  # the width of the residual stream
    d_ff: int = 0  # the MLP's hidden width; 0 = 4 * d_model
    norm: NormName = "rmsnorm"  # the blocks' norms and the final one
    # gelu: fc -> GELU -> proj. swiglu: fc computes gate and up (2 * d_ff rows, gate first), proj(silu(gate) * up):
    # with rmsnorm, the Llama block, which `rewind export --hf` writes as LlamaForCausalLM.
    mlp: MlpName = "gelu"
    dropout: float = 0.0  # the dropout probability in training (evaluation and sampling never drop)
    rope_base: float = 10000.0  # the rotary position embedding's base (theta)
    activation_checkpointing: bool = False  # recompute each block's activations in the backward: less memory
    # key/value heads, grouped-query attention as in Llama 3 and Qwen (they divide num_heads); 0 = num_heads
    num_kv_heads: int = 0
    head_dim: int = 0  # each head's width (even, for RoPE); 0 = d_model / num_heads
    norm_eps: float = 1e-5  # the epsilon of every norm (the blocks', the final one's, qk_norm's)
    qkv_bias: bool = False  # q, k and v projections with a bias (Qwen2)
    qk_norm: bool = False  # an RMSNorm of each head's q and k after their projection, before RoPE (Qwen3)
    tie_embeddings: bool = False  # the output head is the embedding matrix (one parameter, embed.weight)
    # RoPE's frequencies stretched for a longer context than the model was trained on (Llama 3.1's llama3)
    rope_scaling: RopeScalingSection = RopeScalingSection()


class FadeSection(Struct):
    # Every boundary's fade, in [0, 1]: a ramp of overlap x the shorter stage's tokens, centred on the
    # boundary, across which the next stage's share of the rows rises (0: a hard switch); a stage's wins.
    overlap: float = 0.0
    curve: CurveName = "linear"  # how the next stage's weight rises across the ramp
    steepness: float = 10.0  # sigmoid: its slope at the ramp's middle


class TrainingSection(Struct):
    batch_size: int = 8  # rows per step, all processes (sft: examples, dpo: pairs, grpo: completions)
    # Rows per forward (a micro-batch: gradients accumulate over batch_size / it) per process; -1: all.
    per_device_batch_size: int = -1
    validation_steps: int = 2  # batches of validation rows each dataset's validation round reads
    # The datasets the boundary evaluations score, and once more before training (the end tables' "(start)"
    # row) only when set; empty: every dataset the stages train on, at the stage boundaries alone.
    evaluations: list[str] = []
    eval_samples: int = 64  # validation rows (post-training: held-out prompts and pairs) an evaluation scores
    # A NaN or infinite loss: "stop" ends the run at its last good checkpoint (fork it with a changed config
    # to go on); "skip" records the step (a NonFiniteLoss) without its update.
    on_nonfinite: NonFiniteAction = "stop"
    fade: FadeSection = FadeSection()  # the fades from each stage into the next


class KlSection(Struct):
    # The KL term a stage's `beta` weighs: token_kl, the exact per-token KL(policy || reference) over the
    # vocabulary; nll_difference, the ABCD trainer's policy NLL - stop_grad(reference NLL) (to compare with).
    kind: KlKind = "token_kl"


class OptimizationSection(Struct):
    lr: float = 3e-4  # the peak learning rate
    schedule: LrScheduleName = "wsd"  # the LR's curve over the run's steps (docs/schedule.md)
    warmup_pct: float = 0.01  # the warmup's share of the steps (cosine_rewarm: of each stage's; not constant)
    constant_pct: float = 0.0  # wsds: the share held at decay_lr_mult x lr after the decay
    decay_pct: float = 0.1  # wsd, wsds: the linear decay's share of the steps
    warmup_lr_mult: float = 0.01  # the warmup starts at this x lr (wsd, wsds, cosine, sgdr)
    decay_lr_mult: float = 0.1  # wsd, wsds: the decay ends at this x lr
    min_lr_ratio: float = 0.1  # cosine, sgdr, cosine_rewarm: the curve's floor, this x its peak
    sgdr_period: int = 100  # sgdr: the first period's steps (each next one is twice as long)
    rewarm_lr: float = 1e-4  # cosine_rewarm: the peak of every stage after the first (stage 0 peaks at lr)
    # Whether the LR schedule restarts from its own step 0 at a stage that resets the optimizer
    # (`[[stages]].reset_optimizer`), as the ABCD trainer's tx.init does.
    reset_restarts_lr: bool = False
    weight_decay: float = 0.0  # AdamW's decoupled decay, of matrices only (not biases or norm gains)
    grad_clip: float = 1.0  # the largest global L2 norm of the gradients (0 = no clipping)
    beta1: float = 0.9  # AdamW's first-moment decay
    beta2: float = 0.95  # AdamW's second-moment decay (torch's default is 0.999)
    eps: float = 1e-8  # AdamW's epsilon
    kl: KlSection = KlSection()  # how the token-level KL to the reference is computed


class LoggingSection(Struct):
    report_interval: int = 10  # steps between the log's commits (what a crash can lose; a resume redoes them)
    validation_interval: int = 0  # steps between validation rounds; 0 = never (boundary evaluations run)
    checkpoint_interval: int = 0  # steps between checkpoints; 0 = only at stage boundaries and the end
    keep_last_checkpoints: int = 3  # the newest kept; boundary, final and resume-needed ones are kept as well


class DataSource(Struct):
    """A user dataset (see docs/data.md). tokens: a flat uint16/uint32 token file (memory-mapped; fsspec for
    remote URLs) or a directory written by `rewind data prepare`. text / jsonl / parquet: documents, tokenised
    at the run's start (by the run's tokenizer, else as UTF-8 bytes) into the run directory."""

    kind: DataKind  # tokens: token ids; text / jsonl / parquet: documents or examples, tokenised at the start
    # tokens: a file or a prepared directory; documents: a file or a glob (several files, read in sorted order)
    path: str
    dtype: Literal["uint16", "uint32"] = "uint16"  # tokens: a flat file's ids (a prepared directory: its own)
    text_field: str = "text"  # jsonl / parquet: the field or column holding a document
    # jsonl / parquet: examples instead of documents, one a row, left-truncated and padded: the field or
    # column of a row's prompt, with response_field, chosen_field + rejected_field, or answer_field.
    prompt_field: str = ""
    response_field: str = ""  # prompt/response pairs (sft): the response's field, the loss on it alone
    # prompt/chosen/rejected examples for a dpo stage (with rejected_field): the preferred response's
    # field. Read as prompt/response pairs elsewhere (validation, evaluation), the chosen one.
    chosen_field: str = ""
    rejected_field: str = ""  # dpo: the other response's field (with chosen_field)
    # jsonl / parquet: a grpo stage's prompts (prompt_field) and the answer its exact_match reward compares with.
    answer_field: str = ""
    validation_fraction: float = 0.05  # the share of `path`'s rows held out as the validation split
    validation_path: str = ""  # the validation split from its own file(s); validation_fraction is then unused
    # How validation rows are carved out of `path`: random (a fixed pseudo-random choice of windows) or tail
    # (the last ones). "" = random; runs started before rewind 0.3 (without the "data_identity" feature): tail.
    split: SplitMode = ""
    on_epoch_end: EpochEndPolicy = "reshuffle"  # past the last train row: a new order, or the same again


class TokenizerSection(Struct):
    """The run's tokenizer: a Hugging Face `tokenizers` file, one trained at the run's start, or bytes."""

    path: str = ""  # tokenizer.json; "" = token id = UTF-8 byte value (unless train_vocab_size is set)
    train_vocab_size: int = 0  # > 0: train a byte-level BPE tokenizer of this size at the run's start
    train_on: list[str] = []  # the text datasets it is trained on (empty = every text / jsonl / parquet one)


class PretrainedSection(Struct):
    """Weights a new run starts from instead of random ones: a transformers Llama directory (config.json +
    model.safetensors) or a rewind export (.safetensors with its architecture in the metadata)."""

    path: str = ""  # "" = random weights (architecture must describe the pretrained model exactly)


class GrowthStep(Struct):
    """One growth of the model (`[[growth]]`): a stack of `num_blocks` new blocks joins at the entry of
    stage `at_stage` or at the first step that starts at or after `at_tokens` (exactly one of the two).
    `trunk` is what every stack already there becomes; `precision` the new stack's weights ("nf4": its
    base is quantised and it trains through its own LoRA adapters). See docs/growth.md."""

    at_stage: int = -1  # the stage at whose entry it joins (its index, or its name); -1 = not given
    at_tokens: int = -1  # it joins at the first step starting at or after this token; -1 = not given
    num_blocks: int = 1  # blocks in the new stack
    position: StackPosition = "append"  # append: the output side; prepend: the input side
    init: InitMode = "random"  # copy: duplicate the neighbouring blocks; identity: outputs unchanged
    trunk: TrunkChoice = "frozen"  # full: trained; frozen; lora: + LoRA adapters; qlora: nf4 + LoRA adapters
    precision: Precision = "fp32"  # the new stack's weights
    # prepend only: keep the downstream stacks' final norm and head fixed too (an anchor for the new input side)
    anchor: bool = False
    # Read the frozen trunk's outputs from an activation cache instead of recomputing them (auto: when
    # the whole trunk is frozen under an appended stack; on: the same, and an error where it cannot be).
    cache: CacheChoice = "auto"


class LoraSection(Struct):
    """LoRA adapters (peft): a stack's own (precision = "nf4") and the trunk's (trunk = lora / qlora)."""

    rank: int = 16  # the rank of the adapters a new nf4 stack trains through
    trunk_rank: int = 8  # the trunk's adapters: smaller than a new stack's, shaped by `pattern`
    # How a trunk stack's rank follows its stack id i: fixed (trunk_rank), increasing (trunk_rank * 2^i),
    # decreasing (trunk_rank / 2^i, at least 1), linear (trunk_rank * (i + 1)), table (ranks[i]).
    pattern: RankPattern = "fixed"
    ranks: list[int] = []  # pattern = "table": one rank per stack (the initial one, then each grown one)
    alpha_per_rank: float = 2.0  # alpha = alpha_per_rank * rank: the same scale at every rank
    # The layers of a block that get adapters
    targets: list[str] = msgspec.field(default_factory=lambda: ["attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"])


class ObjectiveSection(Struct):
    """What the model is trained to predict. clm: the next token. mlm: masked tokens (replaced by a mask
    token, loss on them only, attention bidirectional). diffusion: masked-diffusion, the mask rate a
    level drawn per row and embedded (time = "input") or set by the stack being trained (time = "depth")."""

    kind: ObjectiveKind = "clm"  # clm, mlm or diffusion (above)
    mask_rate: float = 0.15  # mlm: the share of tokens masked
    time: Literal["input", "depth"] = "input"  # diffusion: what sets a row's mask rate (above)
    num_levels: int = 16  # diffusion: mask-rate levels, from min_mask_rate to max_mask_rate
    min_mask_rate: float = 0.05  # diffusion: the lowest level's mask rate
    max_mask_rate: float = 1.0  # diffusion: the highest level's
    depth_map: Literal["linear", "exponential"] = "linear"  # time = "depth": stack index -> level


class ComputeSection(Struct):
    """Where and how the run computes. Every field changes the bits a step produces, so all of them are
    part of the config (a resume computes as the run did; a fork may change them, on record)."""

    # "auto": CUDA when this machine has it, else the CPU; the device chosen is recorded when the run
    # starts (RunStarted.device) and a resume under "auto" keeps it.
    device: DeviceName = "auto"
    # fp32; bf16-autocast: fp32 weights and optimizer, matmuls in bf16 under torch.autocast;
    # bf16-mixed: FSDP2's mixed precision (bf16 parameters for compute, fp32 master weights, fp32
    # gradient reduction; a single process runs as a one-rank FSDP2 group).
    precision: ComputePrecision = "fp32"
    compile: bool = False  # torch.compile the model (deterministic run to run, not bitwise equal to eager)
    # CUDA only: torch.use_deterministic_algorithms and CUBLAS_WORKSPACE_CONFIG, so the same device and
    # world size repeat a run bit for bit (at some speed). The CPU is deterministic anyway.
    deterministic: bool = True
    # How the loss meets the head: "logits" (the model's logits, then the chunked loss), "chunked" (the
    # loss owns the head matmul and never holds every position's logits: torch, any device), "triton"
    # (the same with the fused Triton kernel; CUDA, or Triton's interpreter on the CPU).
    loss_kernel: LossKernel = "logits"


class Config(Struct):
    run: RunSection = RunSection()  # the seed and the run's name
    architecture: ArchitectureSection = ArchitectureSection()  # the model's shape
    training: TrainingSection = TrainingSection()  # the batch, validation, evaluations, the fades
    optimization: OptimizationSection = OptimizationSection()  # the LR schedule, AdamW, clipping, the KL kind
    logging: LoggingSection = LoggingSection()  # how often the run commits, validates and checkpoints
    stages: list[AnyStage] = []  # the curriculum: one [[stages]] record per stage, in order (at least one)
    data: dict[str, DataSource] = {}  # your datasets, each [data.NAME] (docs/data.md)
    growth: list[GrowthStep] = []  # stacks joining the model, one [[growth]] each, in order (docs/growth.md)
    lora: LoraSection = LoraSection()  # LoRA adapters' ranks and targets (docs/growth.md)
    objective: ObjectiveSection = ObjectiveSection()  # what the model learns to predict
    # How text becomes token ids: a tokenizer.json, one trained at the start, or UTF-8 bytes (docs/data.md)
    tokenizer: TokenizerSection = TokenizerSection()
    # Weights a new run starts from instead of random ones: a transformers Llama directory or a rewind export
    # (docs/data.md, docs/export.md)
    pretrained: PretrainedSection = PretrainedSection()
    compute: ComputeSection = ComputeSection()  # the device and precision (docs/distributed.md)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def fade_overlap(self, boundary: int) -> float:
        """The fade's overlap from stage `boundary` into the next."""
        given = self.stages[boundary].overlap
        return self.training.fade.overlap if given is None else given

    @property
    def tokens_per_step(self) -> int:
        return self.training.batch_size * self.architecture.block_size

    def dataset_names(self) -> set[str]:
        return set(BUILTIN_DATASETS) | set(self.data)


def dumps_config(config: Config) -> str:
    """TOML text for a config (round-trips through `loads_config`)."""
    return dumps(msgspec.to_builtins(config))  # a stage's beta or overlap left out (None) is not written
