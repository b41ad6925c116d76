"""The live model of a `ModelLayout`: stacks in order, NF4 trunks (bitsandbytes), LoRA adapters (peft).

`build_plain` makes the model's structure with every weight a plain tensor under its *unwrapped* name
(`stacks.2.blocks.0.attn.qkv.weight`), which is the form checkpoints store; `shape` then turns it into
what trains: an nf4 stack's linear layers become `bitsandbytes.nn.Linear4bit` quantised from those
weights (quantisation is a deterministic function of them, so no quant-state is ever stored), adapters
are injected with `peft.inject_adapter_in_model` and initialised from (seed, "adapter", stack, layer),
and `requires_grad` is set from the layout. Resume, fork, replay and the live growth all come through
these two functions, so a model built from the log is the model the run had.

peft initialises `lora_A` from torch's global RNG; the draw is made inside a forked RNG and then
overwritten from the run's own stream, so neither the global state nor the order of construction can
change a run. bitsandbytes' `Linear4bit` in eval mode may repack its weight and use a bf16 kernel on
some CPUs: `eval_mode` keeps those layers in training mode (they have no other train/eval behaviour),
so evaluation and the KL reference compute exactly what training computes.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from rewind.engine.model.model import GPT, init_new_stack
from rewind.engine.model.rng import torch_generator
from rewind.engine.model.tensors import TensorFitError, cpu_copy, load_model_tensors
from rewind.states.config import Config
from rewind.states.growth import initial_layout
from rewind.states.state import ModelLayout

# bitsandbytes (imported by peft too) warns at import that its CPU bf16 inference kernel is missing;
# that kernel serves only eval-mode Linear4bit, which rewind never runs (eval_mode): silence the warning.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

LINEAR_LAYERS = ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
ADAPTER_NAME = "default"  # peft's adapter name; unwrapped names leave it out
_WRAPPED = re.compile(r"\.base_layer(?=\.)|(?<=\.lora_[AB])\.default(?=\.)")


def unwrapped(name: str) -> str:
    """The name a parameter has without peft's wrapping: `x.qkv.base_layer.weight` -> `x.qkv.weight`,
    `x.qkv.lora_A.default.weight` -> `x.qkv.lora_A.weight` (peft's own saved layout uses the latter)."""
    return _WRAPPED.sub("", name)


def parameter_names(model: nn.Module) -> dict[nn.Parameter, str]:
    """Each parameter's unwrapped name: how checkpoints key optimizer moments, so they follow a
    parameter across growths whatever peft's wrapping does to its module path."""
    return {parameter: unwrapped(name) for name, parameter in model.named_parameters()}


def stack_of(name: str) -> int | None:
    """The stack id a parameter or buffer belongs to (None: embedding, final norm, head)."""
    return int(name.split(".")[1]) if name.startswith("stacks.") else None


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def base_and_adapters(
    model: nn.Module, leave_out: set[int] | frozenset[int] = frozenset()
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The model's weights split into base weights and LoRA adapters, both under unwrapped names, as whole
    CPU copies; the base weights of the stacks in `leave_out` (frozen or NF4 trunks, whose float weights
    are held apart) are left out. The one place the split is made: checkpoints, references, growth."""
    base, adapters = {}, {}
    for name, tensor in model.state_dict().items():
        if is_adapter(name):
            adapters[unwrapped(name)] = cpu_copy(tensor)
        elif stack_of(name) not in leave_out:
            base[unwrapped(name)] = cpu_copy(tensor)
    return base, adapters


def layout_of(config: Config, layout: ModelLayout | None) -> ModelLayout:
    return layout if layout is not None else initial_layout(config.architecture.num_layers)


def build_plain(config: Config, layout: ModelLayout | None) -> GPT:
    """The model's structure for `layout` with weights from the seed (the initial stack's are the run's
    first weights; a grown stack's are placeholders that growth or a checkpoint overwrites). bf16 stacks
    are cast; nothing is quantised and no adapters exist yet."""
    from rewind.states.check_continuation import is_causal, model_vocab_size, num_time_levels

    layout = layout_of(config, layout)
    model = GPT(
        config.architecture,
        [s.num_blocks for s in layout.stacks],
        seed=config.run.seed,
        stack_ids=[s.stack for s in layout.stacks],
        vocab_size=model_vocab_size(config.objective, config.architecture.vocab_size),
        num_time_levels=num_time_levels(config.objective),
    )
    model.causal = is_causal(config.objective)
    for spec in layout.stacks:
        if spec.dtype == "bf16":
            model.stack(spec.stack).to(torch.bfloat16)
    return model


def shape(model: GPT, config: Config, layout: ModelLayout | None) -> GPT:
    """Quantise, inject adapters and set what trains, in place, as `layout` says (see module doc)."""
    layout = layout_of(config, layout)
    for spec in layout.stacks:
        if spec.base == "nf4":
            quantise_stack(model.stack(spec.stack))
    adapted = [s for s in layout.stacks if s.adapter_rank > 0]
    if adapted:
        _inject_adapters(model, config, layout)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(_trains(name, layout))
    return model


def model_from_weights(
    config: Config,
    layout: ModelLayout | None,
    weights: dict[str, torch.Tensor],
    adapters: dict[str, torch.Tensor],
    *,
    complete: bool = False,
) -> tuple[GPT, dict[int, dict[str, torch.Tensor]]]:
    """The model of `layout` for `config` holding `weights` (every unwrapped base weight) and `adapters`
    (unwrapped), and the float weights of its fixed stacks (what checkpoints store of them and NF4
    quantises from): plain weights first, then quantised and given adapters as the layout says, then the
    adapters' values. The one way a model is made from tensors: resume (a checkpoint, `complete`: every
    adapter given, each at its dtype), growth and config changes (the adapters that existed; a new one
    keeps its initialisation, and a carried one takes its parameter's dtype: peft gives a bf16 base bf16
    adapters and an NF4 base float32 ones, so a bf16 stack quantised later has its adapters widened,
    exactly)."""
    plain = build_plain(config, layout)
    load_model_tensors(plain, weights)
    fixed = {s.stack for s in layout_of(config, layout).stacks if s.base != "trainable"}
    sources = {
        stack: {name: tensor.detach().clone() for name, tensor in plain.state_dict().items() if stack_of(name) == stack}
        for stack in fixed
    }
    model = shape(plain, config, layout)
    if complete:
        values = dict(adapters)
    else:
        live = {unwrapped(n): p for n, p in model.named_parameters() if is_adapter(n)}
        values = {n: p.detach().clone() for n, p in live.items()}
        values.update({n: t.to(live[n].dtype) for n, t in adapters.items() if n in live})
    load_adapters(model, values)
    return model, sources


def build_model(config: Config, layout: ModelLayout | None) -> GPT:
    """A fresh model of `layout`, shaped (what a run at its start trains)."""
    return shape(build_plain(config, layout), config, layout)


def quantise_stack(stack: nn.Module) -> None:
    """Every linear layer of the stack becomes an NF4 `Linear4bit` holding its current weights,
    computing in float32 (its training-mode output is then F.linear(x, dequantised weight), bitwise)."""
    import bitsandbytes as bnb

    for block in stack.blocks:  # type: ignore[attr-defined]
        for path in LINEAR_LAYERS:
            owner_name, _, attribute = path.rpartition(".")
            owner = getattr(block, owner_name)
            linear = getattr(owner, attribute)
            if not isinstance(linear, nn.Linear):
                raise TypeError(f"{path} is a {type(linear).__name__}, not a plain Linear to quantise")
            with torch.random.fork_rng(devices=[]):
                quantised = bnb.nn.Linear4bit(
                    linear.in_features, linear.out_features, bias=False, compute_dtype=torch.float32, quant_type="nf4"
                )
            weight = linear.weight.detach().to(torch.float32).clone()
            quantised.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4")
            quantised = quantised.to(linear.weight.device)  # quantises (bitsandbytes does it on the move)
            setattr(owner, attribute, quantised)


def lora_config(modules: dict[str, tuple[int, float]]):
    """peft's LoraConfig adapting exactly `modules` (full module name -> (rank, alpha)): the one way
    rewind describes adapters to peft, for injecting them and for exporting them (peft matches
    rank_pattern / alpha_pattern keys as regular expressions, hence the escapes)."""
    from peft import LoraConfig

    names = sorted(modules)
    first_rank, first_alpha = modules[names[0]]
    return LoraConfig(
        r=first_rank,
        lora_alpha=first_alpha,
        target_modules=names,
        rank_pattern={re.escape(n): modules[n][0] for n in names},
        alpha_pattern={re.escape(n): modules[n][1] for n in names},
        lora_dropout=0.0,  # peft's dropout draws from the global RNG
        bias="none",
    )


def _inject_adapters(model: GPT, config: Config, layout: ModelLayout) -> None:
    from peft import inject_adapter_in_model

    modules = {
        f"stacks.{spec.stack}.blocks.{block}.{layer}": (spec.adapter_rank, spec.adapter_alpha)
        for spec in layout.stacks
        if spec.adapter_rank > 0
        for block in range(spec.num_blocks)
        for layer in config.lora.targets
    }
    # peft picks its 4-bit LoRA layer for Linear4bit bases only when the model says it is loaded in 4 bit.
    model.is_loaded_in_4bit = any(s.base == "nf4" for s in layout.stacks)
    with torch.random.fork_rng(devices=[]):
        inject_adapter_in_model(lora_config(modules), model, adapter_name=ADAPTER_NAME)
    init_adapters(model, config.run.seed)


def load_adapters(model: GPT, tensors: dict[str, torch.Tensor]) -> None:
    """Copy adapter values (unwrapped names) into the model's adapters: exactly the same set of names,
    shapes and dtypes, or a TensorFitError naming the difference."""
    live = {unwrapped(name): p for name, p in model.named_parameters() if is_adapter(name)}
    if set(live) != set(tensors):
        missing, unexpected = sorted(set(live) - set(tensors)), sorted(set(tensors) - set(live))
        raise TensorFitError(f"checkpoint adapters do not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    with torch.no_grad():
        for name, parameter in live.items():
            given = tensors[name]
            if given.shape != parameter.shape or given.dtype != parameter.dtype:
                raise TensorFitError(f"checkpoint adapter {name} is {given.dtype} {list(given.shape)}, the model's {parameter.dtype} {list(parameter.shape)}")
            parameter.copy_(given)


def init_adapters(model: GPT, seed: int) -> None:
    """lora_A from (seed, "adapter", unwrapped name): uniform in +-1/sqrt(fan_in), peft's own default
    (kaiming-uniform with a = sqrt(5)); lora_B zero, so a new adapter changes no output."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".lora_A." in name:
                bound = 1.0 / math.sqrt(parameter.shape[1])
                values = torch.empty(parameter.shape, dtype=torch.float32)
                values.uniform_(-bound, bound, generator=torch_generator(seed, "adapter", unwrapped(name)))
                parameter.copy_(values)
            elif ".lora_B." in name:
                parameter.zero_()


def _trains(name: str, layout: ModelLayout) -> bool:
    if name.startswith(("embed.", "time_embed.")):
        return layout.embed_trains
    if name.startswith(("norm.", "head.")):
        return layout.head_trains
    stack_id = int(name.split(".")[1])
    spec = next(s for s in layout.stacks if s.stack == stack_id)
    if is_adapter(name):
        return spec.adapters_train
    return spec.base == "trainable"


def eval_mode(model: nn.Module) -> nn.Module:
    """model.eval(), except for bitsandbytes' Linear4bit layers (see the module docstring)."""
    model.eval()
    for module in model.modules():
        if type(module).__name__ == "Linear4bit":
            module.train()
    return model


@contextmanager
def evaluating(model: nn.Module) -> Iterator[nn.Module]:
    """`eval_mode` for the block, then the mode the model had: training, or eval_mode's again (a plain
    `model.train(False)` would put a reference's Linear4bit layers in eval mode)."""
    was_training = model.training
    eval_mode(model)
    try:
        yield model
    finally:
        model.train() if was_training else eval_mode(model)


def new_stack_weights(
    old: dict[str, torch.Tensor], old_order: list[tuple[int, int]], stack_id: int, num_blocks: int, init: str, position: str, seed: int, config: Config
) -> dict[str, torch.Tensor]:
    """The base weights of a new stack (names relative to the stack: `blocks.0.attn.qkv.weight`):
    random or identity (zeroed residual projections) from (seed, "grow", stack id); copy = the
    `num_blocks` blocks nearest where it joins (the last ones for append, the first for prepend),
    duplicated in order: G_stack's depthwise stacking. `old`: the model's unwrapped base weights;
    `old_order`: (stack id, number of blocks) from the input side."""
    from rewind.engine.model.model import Stack

    if init == "copy":
        blocks = [(s, j) for s, n in old_order for j in range(n)]
        chosen = blocks[-num_blocks:] if position == "append" else blocks[:num_blocks]
        weights = {}
        for index, (source, j) in enumerate(chosen):
            prefix = f"stacks.{source}.blocks.{j}."
            for name, tensor in old.items():
                if name.startswith(prefix):
                    weights[f"blocks.{index}.{name.removeprefix(prefix)}"] = tensor.detach().clone()
        return weights
    with torch.random.fork_rng(devices=[]):
        stack = Stack(config.architecture, num_blocks)
    depth = sum(n for _, n in old_order) + num_blocks
    init_new_stack(stack, seed, stack_id, depth, function_preserving=init == "identity")
    return {name: tensor.detach().clone() for name, tensor in stack.state_dict().items()}
