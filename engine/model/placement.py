"""Where a run computes: the device, the precision, the processes the model is sharded over, and the
CPU settings a resume adopts from the run's record (thread count, CPU kernels: float sums depend on both;
a resume may be told another thread count, and records it).

One process (the CPU promise, bit for bit) or N processes under torchrun: every rank builds the same
live objects from the same folded state, then `place` moves the model to the device and, when the run
is sharded, applies FSDP2's `fully_shard` to each block and then to the root. Control needs no
messages (every rank folds the same events and `states/` is pure); what a step *measures* is summed
over the ranks (`sum_over_ranks`) before the event that carries it is built, so every rank folds
identical events. Only rank 0 writes (the log, checkpoints, caches); what it alone learns (a
checkpoint's hashes) reaches the others as the msgspec bytes of the event (`shared_event`), never a
pickle.

Sharded is decided per process, not per config: a world size > 1 (torchrun's WORLD_SIZE), or
precision "bf16-mixed", which is FSDP2's mixed-precision policy and runs as a one-rank group in a
single process. The process group is created once per process (`join_process_group`).
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.distributed as dist
from torch import nn

from rewind.states.admission import MAX_THREADS
from rewind.states.config import ComputeSection, Config

# The device a resume under compute.device = "auto" keeps (RunStarted.device / RunResumed.device of the
# run being resumed): set once per process by `adopt_device`, like the CPU thread count.
_adopted_device: str = ""


class PlacementError(Exception):
    """This process cannot compute as the run asks (no CUDA, a world size that cannot split the batch)."""


@dataclass(frozen=True)
class Placement:
    device: torch.device
    rank: int
    world_size: int
    sharded: bool

    def row_range(self, num_rows: int) -> range:
        """This rank's rows of a global batch of `num_rows` (checked to divide at start: `check_compute`)."""
        share = num_rows // self.world_size
        return range(self.rank * share, (self.rank + 1) * share)


def launched_world_size() -> int:
    """The number of processes torchrun started (1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def wants_sharding(compute: ComputeSection) -> bool:
    return launched_world_size() > 1 or compute.precision == "bf16-mixed"


def join_process_group(compute: ComputeSection) -> None:
    """Create this process's group once, when the run is sharded: gloo on the CPU, NCCL on CUDA. A
    one-process bf16-mixed run gets a one-rank group over an in-memory store (nothing to rendezvous)."""
    if dist.is_initialized() or not wants_sharding(compute):
        return
    device = resolve_device(compute.device)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    backend = "nccl" if device.type == "cuda" else "gloo"
    if launched_world_size() > 1 or "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def leave_process_group() -> None:
    if dist.is_initialized():
        dist.barrier()  # no rank tears the group down while another still talks
        dist.destroy_process_group()


def adopt_threads(recorded: int, requested: int = 0) -> str:
    """Compute with the CPU thread count a run recorded (resume, fork, replay, sample), or with
    `requested` (> 0: the user's --threads). Returns a note for the user, "" when there is nothing to say.

    The count is part of the bits: with another count torch splits some float sums at other places
    (measured with torch 2.13 on the CPU: LayerNorm's weight and bias gradients at every size, a plain
    sum over more than ~65k elements; the tiny example's RMSNorm model is the same either way). So the
    run's count is kept unless the user asks for another, and then the bits may differ from a run that
    never stopped."""
    before = torch.get_num_threads()
    if requested > 0:
        torch.set_num_threads(requested)
        if 0 < recorded != requested:
            return (
                f"computing with {requested} CPU thread(s) as asked (--threads), the run computed with "
                f"{recorded}: from here on its bits may differ from a run that never stopped"
            )
        return ""
    if recorded > MAX_THREADS:  # folds refuse such a log (stores.trust); never hand it to OpenMP
        return f"the run records {recorded} CPU threads, beyond any machine: computing with {before} instead"
    if recorded <= 0 or recorded == before:
        return ""
    torch.set_num_threads(recorded)
    return f"computing with {recorded} CPU thread(s) as the run did (this process had {before}): bit for bit"


def adopt_cpu_capability(recorded: str) -> None:
    """Compute with the CPU kernels the run was started with (resume, fork, replay): torch dispatches to
    AVX2 or AVX512 kernels (...) by the CPU, and their float sums differ in the last bits. It reads
    ATEN_CPU_CAPABILITY once, at its first kernel, so this must run before any tensor is computed;
    a CPU without the recorded kernels cannot run them, and the user is warned that bits will differ."""
    if not recorded:
        return
    # Asked for before torch is asked what it uses: its answer is fixed by the first question too.
    os.environ["ATEN_CPU_CAPABILITY"] = recorded.lower()
    now = torch.backends.cpu.get_cpu_capability()
    if now != recorded:
        warnings.warn(
            f"the run was started with {recorded} CPU kernels and this process computes with {now}: from "
            "here on its bits differ from an uninterrupted run's (resume it on a CPU with "
            f"{recorded}, in a process that has computed nothing before)",
            CapabilityChanged,
            stacklevel=2,
        )


class CapabilityChanged(UserWarning):
    """A run goes on with other CPU kernels than it started with: not bit for bit from here on."""


def adopt_device(recorded: str, *, or_cpu: bool = False) -> None:
    """Resume, replay and sample compute where the run did when its config says "auto". A run that
    recorded no device ("": a release before schema 6) computed on the CPU, and stays there. `or_cpu`:
    a tool that only reads the run (replay, sample) goes on on the CPU where the recorded CUDA is missing
    (a resume is refused instead: training elsewhere would change the run)."""
    global _adopted_device
    _adopted_device = recorded or "cpu"
    if or_cpu and _adopted_device.startswith("cuda") and not torch.cuda.is_available():
        _adopted_device = "cpu"


def forget_adopted_device() -> None:
    """A new run chooses its own device (not one a resume earlier in this process adopted)."""
    global _adopted_device
    _adopted_device = ""


def resolve_device(setting: str) -> torch.device:
    """compute.device to a torch device: "auto" is the adopted device of a resumed run, else CUDA when
    this machine has it, else the CPU. Asking for CUDA without it is an error, said plainly."""
    if setting == "auto":
        setting = "cuda" if (_adopted_device.startswith("cuda") or (not _adopted_device and torch.cuda.is_available())) else "cpu"
    if setting == "cuda":
        if not torch.cuda.is_available():
            raise PlacementError("compute.device is cuda (or the run computed on CUDA), and this machine has no CUDA device")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def device_record(device: torch.device) -> str:
    """What RunStarted / RunResumed record of a device: "cpu" or "cuda:<name>"."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return "cpu"


def placement_for(config: Config) -> Placement:
    device = resolve_device(config.compute.device)
    sharded = dist.is_initialized()
    return Placement(
        device=device,
        rank=dist.get_rank() if sharded else 0,
        world_size=dist.get_world_size() if sharded else 1,
        sharded=sharded,
    )


def check_compute(config: Config, placement: Placement) -> None:
    """What this process cannot compute as the config asks is refused before any event: a world size
    that cannot split the batch (or its micro-batches), a loss kernel whose library is missing."""
    batch, per_device = config.training.batch_size, config.training.per_device_batch_size
    world = placement.world_size
    if batch % world:
        raise PlacementError(f"training.batch_size {batch} cannot be split over {world} processes")
    if per_device > 0 and (batch // world) % per_device:
        raise PlacementError(
            f"training.per_device_batch_size {per_device} does not divide the {batch // world} rows each of "
            f"{world} processes computes"
        )
    if config.compute.device == "cuda" and placement.device.type != "cuda":
        raise PlacementError("compute.device is cuda, and this process computes on the CPU")
    if config.compute.loss_kernel == "triton":
        from rewind.kernels.linear_losses import KernelUnavailable, triton_available

        try:
            triton_available(placement.device.type)
        except KernelUnavailable as exc:
            raise PlacementError(f"compute.loss_kernel = \"triton\": {exc}") from None


def prepare_device(config: Config) -> None:
    """Process-wide settings a device needs before its first kernel: deterministic CUDA algorithms
    (and the cuBLAS workspace they require) when compute.deterministic."""
    device = resolve_device(config.compute.device)
    if device.type == "cuda" and config.compute.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def place(model: nn.Module, config: Config) -> nn.Module:
    """The model on its device, sharded (each block, then the root) when the run is, compiled when asked.
    In place: parameter names stay what they were (FSDP2 and `nn.Module.compile` rename nothing)."""
    placement = placement_for(config)
    model.to(placement.device)
    if placement.sharded:
        _shard(model, config)
    if config.compute.compile:
        model.compile()
    return model


def _shard(model: nn.Module, config: Config) -> None:
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if config.compute.precision == "bf16-mixed"
        else MixedPrecisionPolicy()
    )
    # NF4 weights stay out of sharding: fully_shard would replace bitsandbytes' Params4bit and lose its
    # quantisation state. They are frozen and a deterministic function of the float weights every rank
    # built them from, so each rank holds the same replica (re-quantised on load, never checkpointed).
    quantised = {p for p in model.parameters() if type(p).__name__ == "Params4bit"}
    for stack in model.stacks.values():  # type: ignore[union-attr]
        for block in stack.blocks:
            fully_shard(block, mp_policy=policy, ignored_params=quantised & set(block.parameters()) or None)
    fully_shard(model, mp_policy=policy, ignored_params=quantised or None)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # The loss is already normalised by the global batch's target tokens: gradients are summed
            # over ranks, not averaged; as a plain sum, which gloo can do (it has no pre-scaled sum).
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def is_sharded(model: nn.Module) -> bool:
    fsdp = _imported("torch.distributed.fsdp")
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


def in_sharded_run() -> bool:
    """Whether this process is one of a sharded run's (its models' parameters are whole only while a
    forward or backward of their module runs: FSDP2 frees the gathered copies afterwards)."""
    return dist.is_initialized()


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a shard (a collective: every rank calls it, in the same order), else itself."""
    dtensor = _imported("torch.distributed.tensor")
    return tensor.full_tensor() if dtensor is not None and isinstance(tensor, dtensor.DTensor) else tensor


def like_parameter(value: torch.Tensor, parameter: torch.Tensor) -> torch.Tensor:
    """A whole optimizer moment given the sharding of its parameter (each rank keeps its own slice, no
    communication); a scalar (AdamW's step) or an unsharded parameter's moment as it is."""
    dtensor = _imported("torch.distributed.tensor")
    if dtensor is None or not isinstance(parameter, dtensor.DTensor) or isinstance(value, dtensor.DTensor):
        return value
    if value.shape != parameter.shape:
        return value
    return dtensor.distribute_tensor(
        value.to(parameter.device), parameter.device_mesh, parameter.placements, src_data_rank=None
    )


def _imported(name: str) -> ModuleType | None:
    """The module `name` if this process has imported it. FSDP2's classes live in modules a one-process
    run never needs (importing torch.distributed.tensor alone costs half an `import torch`): where the
    module was never imported, nothing can be an instance of its classes."""
    return sys.modules.get(name)


def model_device(model: nn.Module) -> torch.device:
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")
