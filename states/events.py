"""The event vocabulary: every transition of a run, as a frozen, tagged msgspec struct.

Conventions shared by every event:
- `step` is the number of optimizer steps completed when the event happens, `tokens` the number of
  training tokens consumed by then (= step * tokens_per_step). So `StepCommitted(step=1)` closes the
  first optimizer step (schedule index k = 0), and `StageEntered(step=k)` fires before the step with
  index k runs.
- The tag (`type` on the wire) is written out on each class, never derived from the class name, so a
  class can be renamed without stranding a log. Fields with a fixed set of values are `Literal`s that
  msgspec checks on decode. New fields get defaults so old logs stay readable; anything else bumps
  SCHEMA_VERSION and registers an upcaster (`rewind.stores.upcasters`).
- No tensors: weights live in checkpoints that events name by id. No derived state either: what the
  fold can compute from the log (a resume's restored state, a config's identity) is computed, not
  stored, so it cannot disagree with the log. `config_hash` fields are labels the writer gives a config
  (for people and for matching ConfigChanged records); identity is always recomputed from the config.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from rewind.states.config import Config, InitMode, Precision, StackPosition, TrunkChoice
from rewind.states.data_identity import DataIdentity
from rewind.states.features import RUN_FEATURES, Features  # noqa: F401 (RUN_FEATURES: what RunStarted.features may hold)
from rewind.states.shapes import CheckpointReason, ModelLayout, OptimizerResetRef, Reference

# Bumped whenever an event changes incompatibly; the log frames carry it and the codec upcasts.
# 1: rewind 0.1 (RunResumed carried the whole restored State). 2: RunResumed carries no state; a fork's
# first RunResumed carries a ForkSeed. 3: OptimizerReset, NonFiniteLoss.quantity, RunStarted.features and
# .cpu_capability (only
# additions: a record of 2 upcasts unchanged; the bump tells a reader that predates them what it holds).
# 4: StackAppended's growth decisions and ActivationsCached (additions again: model growth).
# 5: the data on record (RunStarted/ConfigChanged .data, .tokenizer, RunStarted.pretrained) and EpochStarted.
# 6: where a run computes (RunStarted/RunResumed .device and .world_size; additions).
# 7: RunResumed.num_threads (an addition: a resume may compute with another thread count than the run's).
# 8: a config's stages are records (Config.stages); the flat per-stage lists older configs held are upcast.
# 9: post-training (additions). 10: a stage's record is its kind's (rewind.states.stages): the settings
# tables of the other kinds, which every stage held as null, are gone; RolloutsRecorded.teacher (distill).
SCHEMA_VERSION = 10


class Event(msgspec.Struct, frozen=True, tag_field="type", kw_only=True):
    step: int
    tokens: int


class ForkOrigin(msgspec.Struct, frozen=True, kw_only=True):
    """Where a forked run came from: the parent's run directory, step and checkpoint."""

    run: str
    step: int
    checkpoint: str
    config_hash: str


class RunStarted(Event, frozen=True, kw_only=True, tag="RunStarted"):
    config: Config
    config_hash: str
    rewind_version: str = "0"
    parent: ForkOrigin | None = None
    # CPU threads the run computes with (0 = not recorded). A CPU sum is split across threads, so its
    # bits depend on the count: resume, fork and replay use this one (or a later RunResumed's), wherever
    # they run.
    num_threads: int = 0
    # The CPU kernels torch dispatched to ("AVX2", "AVX512", ...; "" = not recorded): kernels of another
    # capability sum in another order, so resume, fork and replay ask torch for this one where the CPU has it.
    cpu_capability: str = ""
    # The behaviours (rewind.states.features) the run was started with. A run keeps them for life, so a release
    # that changes what a run computes gates the change on a new name here and old runs (whose logs
    # lack it) resume and replay as they were. The engine stamps new runs (`rewind.engine.run.loop.record`).
    features: list[str] = []
    # What the run's data and weights are (see rewind.states.data_identity): every user dataset's identity,
    # the sha256 of the tokenizer file ("" = bytes) and of the pretrained weights it started from ("" = none).
    data: dict[str, DataIdentity] = {}
    tokenizer: str = ""
    pretrained: str = ""
    # Where the run computes: "cpu", or "cuda:<device name>" ("" = not recorded: the CPU), and in how many
    # processes (0 = not recorded: one). A resume under compute.device = "auto" keeps the device.
    device: str = ""
    world_size: int = 0

    @property
    def behaviours(self) -> Features:
        """`features`, typed: one bool per behaviour."""
        return Features.of(self.features)


class EpochStarted(Event, frozen=True, kw_only=True, tag="EpochStarted"):
    """The step about to be committed read past the last train row of `dataset`: epoch `epoch` (0-based)
    of it begins, in a new order (on_epoch_end = "reshuffle") or the same one ("repeat")."""

    dataset: str
    epoch: int


class OptimizerReset(Event, frozen=True, kw_only=True, tag="OptimizerReset"):
    """The optimizer's state (Adam moments and step counts) was cleared at the entry of `stage`
    (a stage's reset_optimizer). `lr_restarted`: from here on the LR schedule runs from its
    own step 0 again, counted from this step (optimization.reset_restarts_lr); otherwise the LR curve
    goes on unbroken."""

    stage: int
    lr_restarted: bool = False


class StageEntered(Event, frozen=True, kw_only=True, tag="StageEntered"):
    stage: int


class FadeStarted(Event, frozen=True, kw_only=True, tag="FadeStarted"):
    boundary: int  # between stage `boundary` and `boundary + 1`


class FadeEnded(Event, frozen=True, kw_only=True, tag="FadeEnded"):
    boundary: int


class ReferenceRefreshed(Event, frozen=True, kw_only=True, tag="ReferenceRefreshed"):
    stage: int
    # The checkpoint whose model weights are the frozen reference from now on. Empty in a dry-run.
    checkpoint: str = ""


class StackAppended(Event, frozen=True, kw_only=True, tag="StackAppended"):
    """A stack of `num_blocks` blocks joined the model (config.growth[`growth`]), on the output side
    (append) or the input side (prepend). It carries every decision needed to rebuild the model from the
    log alone (`rewind.states.growth.grown_layout` turns it into the new ModelLayout): how the new blocks
    were initialised, what the stacks already there became (`trunk`), the new stack's precision and own
    adapters, and the rank of each adapter attached to a trunk stack now (by stack id)."""

    stack: int  # the new stack's identity: the number of stacks before it
    num_blocks: int
    position: StackPosition = "append"
    growth: int = 0
    init: InitMode = "random"
    trunk: TrunkChoice = "frozen"
    precision: Precision = "fp32"
    rank: int = 0  # the new stack's own LoRA rank (precision = "nf4"), 0 = none
    trunk_ranks: dict[str, int] = {}  # adapters attached now: stack id -> rank
    alpha_per_rank: float = 2.0
    anchor: bool = False  # prepend: the final norm and head stay fixed


class ActivationsCached(Event, frozen=True, kw_only=True, tag="ActivationsCached"):
    """The frozen trunk of layout `version` has its outputs stored for the steps [step, step + num_steps)
    (one chunk per step, in reading order) at `path` under the run directory, every chunk complete:
    training reads them instead of running the trunk. Any event that changes the trunk drops it."""

    version: int
    num_steps: int
    num_rows: int
    path: str = ""  # "" in a dry-run
    num_bytes: int = 0


class RolloutsRecorded(Event, frozen=True, kw_only=True, tag="RolloutsRecorded"):
    """A rollout stage's batch (grpo, distill), sampled by the policy before step `step` and kept at `path` (RUN/
    rollouts/<sha256>.safetensors, written durably before this record: rewind.stores.rollouts): the
    steps [step, step + num_iterations) update on it. `cursors`: the prompt datasets' cursors after its
    prompts (the fold takes them)."""

    stage: int
    path: str
    sha256: str
    num_prompts: int
    group_size: int
    cursors: dict[str, int] = {}
    # The weighted reward's mean over the completions some function scored, and how many no function
    # scored (left out of the mean; every one unscored: mean 0.0, unscored the batch's size).
    mean_reward: float = 0.0
    unscored: int = 0
    # Each reward function's code as it scored this batch ("builtin", or the sha256 of its module's file
    # and its version): a resume under other code is refused (rewind.engine.posttrain.rewards).
    reward_code: dict[str, str] = {}
    # What shaped the batch (rewind.states.plan.rollout_settings: the stage's grpo settings, the batch and
    # context sizes): a config change mid-window that alters it samples the window's batch again.
    settings: str = ""
    # A distill stage's teacher as it scored this batch: the sha256 of its weights file, "" for the run's
    # KL reference (which the log names) and for a grpo stage. A resume under another teacher is refused.
    teacher: str = ""


class StepCommitted(Event, frozen=True, kw_only=True, tag="StepCommitted"):
    stage: int
    lr: float
    beta: float
    loss: float
    kl: float = 0.0
    grad_norm: float = 0.0
    rows: list[int] = []  # rows of this step drawn from each stage (the fade allocation)
    cursors: dict[str, int] = {}  # samples consumed per dataset, after this step
    skipped: bool = False  # non-finite loss with on_nonfinite = "skip": no update was applied
    # The stage's strategy's own figures (a dpo step's implicit rewards, margin, accuracy); {} for pretraining.
    metrics: dict[str, float] = {}


class Validated(Event, frozen=True, kw_only=True, tag="Validated"):
    losses: dict[str, float]  # validation loss per dataset


class Evaluated(Event, frozen=True, kw_only=True, tag="Evaluated"):
    """Task scores at a stage boundary (or the end): answer-token accuracy per task."""

    boundary: int  # -1 = before training, n - 1 = end of the run
    scores: dict[str, float]  # only datasets with answers (tasks, prompt/response pairs)
    losses: dict[str, float] = {}
    bits_per_byte: dict[str, float] = {}  # text datasets whose tokens have a known byte length
    # A post-training run's held-out figures per dataset: pass@1, pass@G, reward, win_rate, dpo_accuracy,
    # dpo_margin (rewind.engine.posttrain.posttrain_figures). Records before schema 9 and pretraining runs: {}.
    posttraining: dict[str, dict[str, float]] = {}


class CheckpointCommitted(Event, frozen=True, kw_only=True, tag="CheckpointCommitted"):
    checkpoint: str  # "<step:08d>-<short hash>", a directory under RUN/checkpoints/
    manifest_sha256: str
    files: dict[str, str] = {}  # file name -> sha256 of its bytes
    reason: CheckpointReason = "interval"
    # What the log vouches a state snapshot by (rewind.stores.snapshots.state_digest): the sha256 of the
    # folded state and the config in force just before this record. "" in logs from before it.
    state_sha256: str = ""


class CheckpointDeleted(Event, frozen=True, kw_only=True, tag="CheckpointDeleted"):
    checkpoint: str


class NonFiniteLoss(Event, frozen=True, kw_only=True, tag="NonFiniteLoss"):
    loss: float
    action: Literal["stop", "skip"]
    # The first of the step's measurements that was not finite, in the order the step computes them
    # (the loss, then the KL term, then the gradient norm). Logs from before it was recorded say "loss".
    quantity: Literal["loss", "kl", "grad_norm"] = "loss"


class RunStopped(Event, frozen=True, kw_only=True, tag="RunStopped"):
    """The process stopped before the end on purpose (Ctrl-C, non-finite loss): resumable."""

    reason: str


class ForkSeed(msgspec.Struct, frozen=True, kw_only=True):
    """What a fork's own log cannot derive: the parent's control state at the fork checkpoint.

    A wire type of its own (not `State`), so that the state's shape can change freely; the fold checks
    it against the child's config before adopting it. Every field is the `State` field of the same name
    and type, copied by name both ways (`rewind.states.resumes`): a field a fork must carry is declared
    here and nowhere else."""

    config_hash: str = ""
    # The parent's config-derived figures (0 / [] = the child's own): a fork whose config changes them
    # is then refused by its ConfigChanged, naming what changed, as an in-place fork would be.
    tokens_per_step: int = 0
    num_stages: int = 0
    num_steps: int = 0
    reference_update_stages: list[int] = []
    stage: int
    num_stages_entered: int
    fades_started: list[int] = []
    fades_ended: list[int] = []
    pending_refreshes: list[int] = []
    reference: Reference | None = None
    layout: ModelLayout | None = None
    num_layers: int = 0
    num_growths: int = 0
    cursors: dict[str, int] = {}
    last_loss: float | None = None
    num_skipped_steps: int = 0
    live_checkpoints: list[CheckpointCommitted] = []
    last_evaluated_boundary: int = -2
    last_validated_step: int = -1
    # What the child must compute as the parent did (an unchanged fork is the parent, bit for bit). A
    # seed written before these were recorded decodes as a parent without them, which it was.
    features: list[str] = []
    pending_optimizer_resets: list[int] = []
    last_optimizer_reset: OptimizerResetRef | None = None
    # A grpo window's rollout batch (the fork copies its file): the child's next updates are the parent's.
    rollouts: RolloutsRecorded | None = None


# The seed's config-derived fields: unset (0, "", []) they are the child's own.
SEED_FALLS_BACK_TO_CHILD = (
    "config_hash",
    "tokens_per_step",
    "num_stages",
    "num_steps",
    "reference_update_stages",
    "num_layers",
)


class RunResumed(Event, frozen=True, kw_only=True, tag="RunResumed"):
    """A new process took over from `checkpoint`. Log records with seq in [first, last] are superseded:
    they stay in the log (it is append-only) but no longer count. The state it restores is the fold's
    own restore anchor (`State.anchor`), checked to name the same checkpoint and to end just before
    `first`. Only a fork's first RunResumed carries a `seed`: the parent's state, which the child's log
    cannot derive."""

    checkpoint: str
    superseded_first_seq: int
    superseded_last_seq: int  # < first when nothing was superseded
    config_hash: str = ""  # label of the config in force at the restore point
    seed: ForkSeed | None = None
    # Where this process (and its peers) go on computing, as RunStarted records it: a resume may change
    # the world size (its bits then differ from the run that never stopped, within the documented tolerance).
    device: str = ""
    world_size: int = 0
    # The CPU threads it computes with: the run's, unless the user asked for another count (--threads;
    # bits may then differ, see RunStarted.num_threads). 0 = not recorded: the count it resumed with.
    num_threads: int = 0


class ConfigChanged(Event, frozen=True, kw_only=True, tag="ConfigChanged"):
    """`rewind train --fork`: the run goes on under a new config from its restore point. Tokens per
    step must not change (step k always starts at token k * tps)."""

    config: Config
    config_hash: str
    previous_hash: str
    # The identity of every user dataset of the new config (as RunStarted.data) and its tokenizer's.
    data: dict[str, DataIdentity] = {}
    tokenizer: str = ""


class RunFinished(Event, frozen=True, kw_only=True, tag="RunFinished"):
    pass


AnyEvent = (
    RunStarted
    | StageEntered
    | FadeStarted
    | FadeEnded
    | ReferenceRefreshed
    | OptimizerReset
    | StackAppended
    | ActivationsCached
    | RolloutsRecorded
    | EpochStarted
    | StepCommitted
    | Validated
    | Evaluated
    | CheckpointCommitted
    | CheckpointDeleted
    | NonFiniteLoss
    | RunStopped
    | RunResumed
    | ConfigChanged
    | RunFinished
)

EVENT_TYPES: dict[str, type[Event]] = {
    t.__struct_config__.tag: t  # type: ignore[attr-defined]
    for t in AnyEvent.__args__  # type: ignore[attr-defined]
}


def event_tag(event: Event) -> str:
    """The event's wire tag ("StepCommitted"), which tools show and filter by."""
    return type(event).__struct_config__.tag  # type: ignore[attr-defined]


def event_to_dict(event: Event) -> dict:
    """JSON-ready dict with `type` first, then `step`, `tokens` and the fields."""
    data = msgspec.to_builtins(event)
    return {"type": event_tag(event), **{k: v for k, v in data.items() if k != "type"}}
