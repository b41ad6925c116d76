"""The JSON `rewind bench gpu` writes (DIR/gpu.json): one msgspec schema, used by the writer and the tests.

A report holds where it ran (device, torch, CUDA, the commit, the date) and one PartReport per part, in
PART_NAMES order. A part's figures are a Struct of its own (tagged with the part's name); every figure
defaults to None, "not measured": the part was skipped, timed out before it, or ran its CPU form, which
measures less. What a part claims (bitwise equality, a tolerance) is a Check; what it aims for (MFU,
the kernel's ratios) is a Goal, reported met or not, never a failure of the part.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

SCHEMA_VERSION = 1
PART_NAMES = ("gpu_tests", "kernels", "mfu", "exactness", "progressive", "fsdp")
TITLES = {
    "gpu_tests": "the tests marked gpu",
    "kernels": "the loss kernels against materialised logits",
    "mfu": "MFU of the ~375M model, bf16-mixed, eager and compiled",
    "exactness": "deterministic reruns, a kill and resume, a fork onto the CPU",
    "progressive": "the progressive example (NF4, LoRA, activation cache) killed and resumed",
    "fsdp": "one-process FSDP2 bf16-mixed under torchrun, killed and resumed",
}
Status = Literal["passed", "failed", "timed_out", "error", "skipped"]
Device = Literal["cuda", "cpu"]


class Check(msgspec.Struct, forbid_unknown_fields=True):
    """A claim the part verified: passed or not, and the numbers that decided it."""

    name: str
    passed: bool
    detail: str = ""


class Goal(msgspec.Struct, forbid_unknown_fields=True):
    """A figure against its target: `value <= target` (direction "<=") or `value >= target`."""

    name: str
    value: float
    target: float
    direction: Literal["<=", ">="]
    met: bool


class Comparison(msgspec.Struct, forbid_unknown_fields=True):
    """Two runs of one config: their StepCommitted events step by step, their final weights tensor by tensor."""

    steps_compared: int  # steps both runs committed (after the fork point, for a fork)
    steps_in_one_only: int
    first_divergent_step: int | None  # the first step whose event differs in any bit; None: none does
    loss_max_rel: float  # the largest |a - b| / |a| of a step's loss
    tensors: int
    differing_tensors: int  # final tensors not equal byte for byte
    weight_max_rel: float  # the largest ||a - b|| / ||a|| of a final tensor
    # max |a - b| / (atol + rtol |a|) over every final weight (torch.testing.assert_close passes at <= 1)
    weight_tolerance_ratio: float
    diff_exit: int  # `rewind diff A B`'s exit code (0: no divergence, bit for bit)
    diff_rtol: float | None  # `rewind diff A B --rtol R` ...
    diff_rtol_exit: int | None  # ... and its exit code (0: no divergence within R)

    @property
    def bitwise(self) -> bool:
        return (
            self.steps_in_one_only == 0
            and self.first_divergent_step is None
            and self.differing_tensors == 0
            and self.diff_exit == 0
        )


class GpuTestsFigures(msgspec.Struct, tag="gpu_tests", tag_field="part", forbid_unknown_fields=True):
    per_test_timeout_s: float | None = None
    test_files: list[str] = []  # the files that mention the marker, relative to the repository
    pytest_runs: int | None = None  # more than one when a test hung: the rest ran in a new pytest
    tests: int | None = None
    passed: int | None = None
    skipped: int | None = None
    failed: int | None = None
    errors: int | None = None
    timed_out: int | None = None
    failed_tests: list[str] = []  # failed, errors and timed out, by node id
    skip_reasons: dict[str, int] = {}
    slowest_tests: dict[str, float] = {}  # node id -> seconds, the five slowest


class FusedKernel(msgspec.Struct, forbid_unknown_fields=True):
    implementation: str
    seconds: float  # median forward+backward
    peak_bytes: int
    memory_ratio: float  # peak_bytes / the materialised logits' peak
    time_ratio: float  # median over the repeats of seconds / the materialised logits' seconds
    time_ratio_min: float
    time_ratio_max: float


class Agreement(msgspec.Struct, forbid_unknown_fields=True):
    """A fused loss against reference_losses on materialised logits: relative errors."""

    implementation: str
    dtype: str
    num_rows: int
    d_model: int
    vocab_size: int
    objective_rel: float
    ce_rel: float
    kl_rel: float
    num_correct_diff: int
    grad_hidden_rel: float  # ||g - g_ref|| / ||g_ref||
    grad_weight_rel: float
    # The bounds it is held to, tests/kernels' for this dtype: |got - want| <= atol + rtol |want| for the
    # values, the gradients' relative error <= grad_rtol.
    value_rtol: float
    value_atol: float
    grad_rtol: float


class KernelsFigures(msgspec.Struct, tag="kernels", tag_field="part", forbid_unknown_fields=True):
    dtype: str | None = None
    num_rows: int | None = None
    d_model: int | None = None
    vocab_size: int | None = None
    beta: float | None = None
    kl_kind: str | None = None
    repeats: int | None = None
    peak_method: str | None = None
    eager_seconds: float | None = None
    eager_peak_bytes: int | None = None
    fused: list[FusedKernel] = []
    agreement: list[Agreement] = []


class MfuRun(msgspec.Struct, forbid_unknown_fields=True):
    compiled: bool
    warmup_steps: int
    timed_steps: int
    first_step_s: float  # the compile, for a compiled model
    step_ms: float  # median
    step_ms_min: float
    step_ms_max: float
    tokens_per_second: float
    achieved_tflops: float
    mfu: float | None  # None: no peak known for the device
    peak_memory_gib: float | None
    final_loss: float


class MfuFigures(msgspec.Struct, tag="mfu", tag_field="part", forbid_unknown_fields=True):
    precision: str | None = None
    architecture: str | None = None
    num_parameters: int | None = None
    model_flops_per_token: int | None = None
    batch_size: int | None = None
    block_size: int | None = None
    peak_tflops: float | None = None
    mfu_goal: float | None = None
    eager: MfuRun | None = None
    compiled: MfuRun | None = None
    compiled_skipped: str | None = None


class RunFigures(msgspec.Struct, tag_field="part", forbid_unknown_fields=True):
    """A run killed mid-way and resumed, against the same run straight through."""

    config: str | None = None
    overrides: list[str] = []
    num_steps: int | None = None
    straight_s: float | None = None  # wall time of the straight run
    killed_after_checkpoint: int | None = None  # the checkpoint step whose appearance triggered the kill
    killed_after_step: int | None = None  # the last step the killed process committed
    resumed_from: str | None = None  # the checkpoint the resume restored
    resumed: Comparison | None = None


class ExactnessFigures(RunFigures, tag="exactness", forbid_unknown_fields=True):
    rerun: Comparison | None = None  # a second straight run, in another process
    fork_step: int | None = None
    fork: Comparison | None = None  # the straight run against its fork onto the CPU, from the fork on
    replay_exit: int | None = None  # `rewind replay` of the straight run on its device (0: bit for bit)


class ProgressiveFigures(RunFigures, tag="progressive", forbid_unknown_fields=True):
    pass


class FsdpFigures(RunFigures, tag="fsdp", forbid_unknown_fields=True):
    recorded_world_sizes: list[int] = []  # RunStarted's, then every RunResumed's, of the resumed run


Figures = GpuTestsFigures | KernelsFigures | MfuFigures | ExactnessFigures | ProgressiveFigures | FsdpFigures
FIGURES: dict[str, type] = {
    "gpu_tests": GpuTestsFigures,
    "kernels": KernelsFigures,
    "mfu": MfuFigures,
    "exactness": ExactnessFigures,
    "progressive": ProgressiveFigures,
    "fsdp": FsdpFigures,
}


class Progress(msgspec.Struct, forbid_unknown_fields=True):
    """What a part's process has written so far (DIR/parts/NAME/progress.json), rewritten as it goes: what
    survives a timeout."""

    figures: dict[str, Any] = {}
    checks: list[Check] = []
    goals: list[Goal] = []
    doing: str = ""  # what it was doing when it last wrote
    skipped: str = ""  # why it ran nothing (it found nothing to run)


class PartReport(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    title: str
    status: Status
    device: Device | None  # where it ran; None: it did not
    cuda_skipped: str | None  # why its CUDA form did not run ("no CUDA device"): its CPU form did
    reason: str | None  # why it did not pass; None when it passed
    budget_s: float
    duration_s: float
    figures: Figures
    checks: list[Check]
    goals: list[Goal]
    log: str | None  # its output, relative to DIR

    def __post_init__(self) -> None:
        if self.name not in PART_NAMES:
            raise ValueError(f"unknown part {self.name!r}")
        if not isinstance(self.figures, FIGURES[self.name]):
            raise ValueError(f"part {self.name} carries the figures of {type(self.figures).__name__}")
        if (self.status == "passed") != (self.reason is None):
            raise ValueError(f"part {self.name}: a reason is given exactly when it did not pass")


class GpuReport(msgspec.Struct, forbid_unknown_fields=True):
    schema: int
    finished: bool  # False while it runs (the file is rewritten after each part)
    dry_run: bool
    device: str  # "cuda:<name>" or "cpu"
    cuda_skipped: str | None  # why the CUDA parts ran their CPU forms
    torch_version: str | None
    cuda_version: str | None
    python_version: str
    rewind_version: str
    git_commit: str | None
    git_dirty: bool | None
    date: str  # when it started, UTC, ISO 8601
    duration_s: float
    budget_s: float
    parts: list[PartReport]

    def __post_init__(self) -> None:
        names = [part.name for part in self.parts]
        if names != [name for name in PART_NAMES if name in names]:
            raise ValueError(f"parts out of order or repeated: {names}")
        if self.finished and len(names) != len(PART_NAMES):
            raise ValueError(f"a finished report names every part, not only {names}")


def decode_report(data: bytes) -> GpuReport:
    """gpu.json's bytes as a GpuReport; msgspec.ValidationError names the first field that does not fit."""
    return msgspec.json.decode(data, type=GpuReport)
