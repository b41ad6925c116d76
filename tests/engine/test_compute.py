"""The [compute] options end to end on the CPU: the loss kernels, bf16 autocast, bf16-mixed (FSDP2 as a
one-rank group), torch.compile, where a run records that it computed, and the one-line refusals.

Runs are the tiny config shrunk to 2 + 2 + 2 steps with the KL term on from stage 1 (the reference is
refreshed at its entry), trained in-process through `rewind train` with one torch thread (as
tests/engine/test_loop.py does) unless a test needs a fresh process: the compile run is a CLI subprocess
(OMP_NUM_THREADS=1, the same thread count; dynamo's counters are its own), and so is a Triton loaded
without its interpreter (which must be decided before triton is imported)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from rewind.engine.model import placement
from rewind.engine.step import step as step_module
from rewind.states.events import RunResumed, RunStarted, StepCommitted
from tests.engine.test_loop import (
    TINY,
    assert_bitwise_equal,
    effective_steps,
    events_of,
    exported_weights,
    run_cli,
    train_args,
)

# 2 + 2 + 2 steps, a checkpoint every 2; the reference is refreshed at stage 1's entry and the KL term
# weighs 0.2 from there: steps 5 and 6 have a KL > 0 (step 4 starts from the reference's own weights).
SHORT = (
    "training.tokens=[512,512,512]",
    "logging.checkpoint_interval=2",
    "optimization.kl.betas=[0.0,0.2,0.2]",
)
VARIANTS = {
    "clm": (),
    # Masked tokens, bidirectional attention; neither accuracy nor next-token validation applies.
    "mlm": ('objective.kind="mlm"', "training.evaluations=[]", "logging.validation_interval=0"),
    # Dropout masks drawn per micro-batch: every kernel must see the same ones.
    "dropout": ("architecture.dropout=0.1",),
}
FUSED_KERNELS = ("chunked", "triton")
# The fused kernels compute the same float32 values in another order. Measured over these runs: losses
# and gradient norms within 1e-7 relative. The KL term is a small difference of log-probabilities of
# the loss's size (~5), so its error is absolute (measured: 6e-8 on KLs of 3e-4 .. 1.5e-3).
RTOL, KL_ATOL = 1e-5, 1e-6
CUDA_MESSAGE = "rewind: compute.device is cuda (or the run computed on CUDA), and this machine has no CUDA device"


@pytest.fixture(autouse=True)
def _adopted_device_restored(monkeypatch):
    """A resume sets the process's adopted device (placement.adopt_device); each test leaves it as found."""
    monkeypatch.setattr(placement, "_adopted_device", placement._adopted_device)


# --- helpers ----------------------------------------------------------------------------------------


def steps_of(run: Path) -> list[StepCommitted]:
    return [e for e in events_of(run) if isinstance(e, StepCommitted)]


def train_in_process(run: Path, overrides: tuple[str, ...], *extra: str) -> Counter:
    """`rewind train` in-process; returns how many training micro-batches each loss path computed
    ("logits", "chunked", "triton", and "triton kernel": calls of the Triton row kernel itself)."""
    used: Counter = Counter()
    real_fused, real_linear = step_module.fused_losses, step_module.linear_losses

    def fused(*args, **kwargs):
        used["logits"] += 1
        return real_fused(*args, **kwargs)

    def linear(*args, implementation, **kwargs):
        used[implementation] += 1
        return real_linear(*args, implementation=implementation, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(step_module, "fused_losses", fused)
        patch.setattr(step_module, "linear_losses", linear)
        if any("triton" in o for o in overrides):
            from rewind.kernels import triton_losses

            real_rows = triton_losses.row_losses

            def rows(*args, **kwargs):
                used["triton kernel"] += 1
                return real_rows(*args, **kwargs)

            patch.setattr(triton_losses, "row_losses", rows)
        code, _, err = run_cli(*train_args(run, *extra, overrides=overrides))
    assert code == 0, err
    return used


def kernel_overrides(variant: str, kernel: str) -> tuple[str, ...]:
    return (*SHORT, *VARIANTS[variant], f'compute.loss_kernel="{kernel}"')


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Callable[[str, str], Path]:
    """runs(variant, kernel): that run trained straight through, once per module."""
    done: dict[tuple[str, str], Path] = {}
    base = tmp_path_factory.mktemp("kernels")

    def get(variant: str, kernel: str) -> Path:
        if (variant, kernel) not in done:
            run = base / f"{variant}-{kernel}"
            used = train_in_process(run, kernel_overrides(variant, kernel))
            # The config chose the path every training micro-batch took, and nothing else.
            want = {"logits": 6} if kernel == "logits" else {kernel: 6}
            assert {k: v for k, v in used.items() if k != "triton kernel"} == want, used
            assert (used["triton kernel"] > 0) == (kernel == "triton"), used
            done[variant, kernel] = run
        return done[variant, kernel]

    return get


def cli(cwd: Path, *args: object, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m rewind.tools.cli ARGS...` in a fresh process, cwd = `cwd`, one torch thread."""
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "rewind.tools.cli", *map(str, args)],
        cwd=cwd, env=environment, capture_output=True, text=True, timeout=300,
    )


def sets(overrides: tuple[str, ...]) -> list[str]:
    return [part for override in overrides for part in ("--set", override)]


def assert_close_steps(want: list[StepCommitted], got: list[StepCommitted], rtol: float = RTOL) -> None:
    assert [e.step for e in got] == [e.step for e in want] == list(range(1, 7))
    for a, b in zip(want, got, strict=True):
        assert (b.stage, b.lr, b.beta, b.rows, b.cursors) == (a.stage, a.lr, a.beta, a.rows, a.cursors)
        assert b.loss == pytest.approx(a.loss, rel=rtol), a.step
        assert b.grad_norm == pytest.approx(a.grad_norm, rel=rtol), a.step
        assert b.kl == pytest.approx(a.kl, rel=rtol, abs=KL_ATOL), a.step


def checkpoint_dtypes(run: Path) -> set[torch.dtype]:
    files = sorted((run / "checkpoints").glob("*/*.safetensors"))
    assert {f.name for f in files} == {"model.safetensors", "optimizer.safetensors"}
    return {tensor.dtype for f in files for tensor in load_file(f).values()}


def assert_same_run(want: Path, got: Path, tmp_path: Path) -> None:
    """Every effective step and the final weights of `got` bitwise those of `want`."""
    assert effective_steps(got) == effective_steps(want)
    assert_bitwise_equal(
        exported_weights(want, tmp_path / "a.safetensors"), exported_weights(got, tmp_path / "b.safetensors")
    )


def all_finite(steps: list[StepCommitted]) -> bool:
    return all(math.isfinite(v) for e in steps for v in (e.loss, e.kl, e.grad_norm))


def worst_relative(want: list[StepCommitted], got: list[StepCommitted]) -> float:
    return max(abs(a.loss - b.loss) / abs(a.loss) for a, b in zip(want, got, strict=True))


# --- loss kernels -----------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kernel", FUSED_KERNELS)
def test_a_fused_loss_kernel_trains_as_the_logits_path_does(runs, tmp_path, kernel, variant):
    want, got = steps_of(runs(variant, "logits")), steps_of(runs(variant, kernel))
    # The KL term is really on: in steps 5 and 6 at least (in step 4 too under dropout, which the
    # training model draws and the reference does not), and nowhere before the reference.
    assert sum(e.kl > 1e-4 for e in want) >= 2 and all(e.kl == 0 for e in want if e.beta == 0)
    assert all_finite(got) and not any(e.skipped for e in got)
    assert_close_steps(want, got)
    # Where the steps lead: the final weights, each tensor within 1e-5 of its norm (measured: 2e-6;
    # single elements move more, where Adam divides a near-zero gradient by its own tiny moment).
    a = exported_weights(runs(variant, "logits"), tmp_path / "a.safetensors")
    b = exported_weights(runs(variant, kernel), tmp_path / "b.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert float((b[name] - a[name]).norm()) <= 1e-5 * float(a[name].norm()), name


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kernel", ("logits", *FUSED_KERNELS))
def test_each_loss_kernel_repeats_its_run_bit_for_bit_across_a_stop(runs, tmp_path, kernel, variant):
    """A second run of the same config, stopped after 3 steps (mid-stage, the reference refreshed)
    and resumed: every step and the final weights bitwise those of the first."""
    first, second = runs(variant, kernel), tmp_path / "again"
    train_in_process(second, kernel_overrides(variant, kernel), "--max-steps", "3")
    assert len(steps_of(second)) == 3
    train_in_process(second, kernel_overrides(variant, kernel))
    assert any(isinstance(e, RunResumed) for e in events_of(second))
    assert_same_run(first, second, tmp_path)


# --- precision --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_bf16_autocast_computes_in_bf16_keeps_fp32_weights_and_resumes_bit_for_bit(runs, tmp_path):
    bf16 = (*SHORT, 'compute.precision="bf16-autocast"')
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    code, out, err = run_cli(*train_args(straight, overrides=bf16))
    assert code == 0, err
    assert "run finished: 6 steps" in out
    got = steps_of(straight)
    assert len(got) == 6 and all_finite(got)
    assert checkpoint_dtypes(straight) == {torch.float32}  # weights and Adam moments stay fp32
    # It really computed in bf16: the fp32 run's losses moved by bf16 rounding (measured 2e-5 .. 1e-4
    # relative), far beyond fp32 reordering (1e-7), and still the same training.
    assert 1e-5 < worst_relative(steps_of(runs("clm", "logits")), got) < 1e-2

    code, _, err = run_cli(*train_args(stopped, "--max-steps", "3", overrides=bf16))
    assert code == 0, err
    assert "stopped after step 3" in err
    code, _, err = run_cli(*train_args(stopped, overrides=bf16))
    assert code == 0, err
    assert [type(e) for e in events_of(stopped)].count(RunResumed) == 1
    assert_same_run(straight, stopped, tmp_path)


def test_bf16_mixed_runs_as_a_one_rank_fsdp2_group_in_one_process(runs, tmp_path, monkeypatch):
    """No torchrun: the CLI makes a one-rank gloo group over an in-memory store, shards the model
    with FSDP2's bf16 policy, and tears the group down when the command ends."""
    sharded: list[bool] = []
    real_is_sharded = step_module.is_sharded

    def is_sharded(model):
        sharded.append(real_is_sharded(model))
        return sharded[-1]

    monkeypatch.setattr(step_module, "is_sharded", is_sharded)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    mixed = (*SHORT, 'compute.precision="bf16-mixed"')
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    code, out, err = run_cli(*train_args(straight, overrides=mixed))
    assert code == 0, err
    assert "run finished: 6 steps" in out
    assert not dist.is_initialized()
    assert sharded and all(sharded)  # every step computed on the FSDP2 module
    events = events_of(straight)
    assert isinstance(events[0], RunStarted) and (events[0].device, events[0].world_size) == ("cpu", 1)
    got = steps_of(straight)
    assert len(got) == 6 and all_finite(got)
    assert checkpoint_dtypes(straight) == {torch.float32}  # gathered whole, as the fp32 masters
    assert 1e-5 < worst_relative(steps_of(runs("clm", "logits")), got) < 1e-2  # bf16 compute, really

    code, _, err = run_cli(*train_args(stopped, "--max-steps", "3", overrides=mixed))
    assert code == 0, err
    code, _, err = run_cli(*train_args(stopped, overrides=mixed))
    assert code == 0, err
    assert not dist.is_initialized()
    resumed = [e for e in events_of(stopped) if isinstance(e, RunResumed)]
    assert [(e.step, e.device, e.world_size) for e in resumed] == [(3, "cpu", 1)]
    assert_same_run(straight, stopped, tmp_path)


# --- compile ----------------------------------------------------------------------------------------

# The CLI's main() in a fresh process, then what dynamo and inductor did in it (a cold compile of the
# tiny model costs ~20 s here, a warm inductor cache ~3 s).
COMPILE_PROBE = """
import json, sys
from rewind.tools.cli import main
code = main(sys.argv[1:])
from torch._dynamo.utils import counters
print("COUNTERS " + json.dumps({"stats": dict(counters["stats"]), "inductor": dict(counters["inductor"])}))
sys.exit(code)
"""


@pytest.mark.slow
def test_compile_trains_with_inductor_close_to_eager(runs, tmp_path):
    run = tmp_path / "compiled"
    args = ["train", TINY, "--run-dir", run, "--no-progress", *sets((*SHORT, "compute.compile=true"))]
    done = subprocess.run(
        [sys.executable, "-c", COMPILE_PROBE, *map(str, args)],
        cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    line = next(x for x in done.stdout.splitlines() if x.startswith("COUNTERS "))
    counters = msgspec.json.decode(line.removeprefix("COUNTERS "))
    assert counters["stats"].get("unique_graphs", 0) >= 1, counters  # dynamo captured the model
    inductor = counters["inductor"]
    assert inductor.get("fxgraph_cache_hit", 0) + inductor.get("fxgraph_cache_miss", 0) >= 1, counters
    assert events_of(run)[0].config.compute.compile
    # Not bitwise (inductor fuses and reorders), close: measured within 1e-7 relative over these steps.
    assert_close_steps(steps_of(runs("clm", "logits")), steps_of(run), rtol=1e-4)


# --- on a GPU (skipped here) ------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kernel", FUSED_KERNELS)
def test_on_cuda_the_run_records_the_gpu_and_a_fused_kernel_agrees_with_logits(tmp_path, monkeypatch, kernel):
    # compute.deterministic sets process-wide switches: each is restored after.
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", torch.backends.cudnn.benchmark)
    deterministic_before = torch.are_deterministic_algorithms_enabled()
    on_cuda = (*SHORT, 'compute.device="cuda"')
    want, got = tmp_path / "logits", tmp_path / kernel
    try:
        train_in_process(want, on_cuda)
        train_in_process(got, (*on_cuda, f'compute.loss_kernel="{kernel}"'))
    finally:
        torch.use_deterministic_algorithms(deterministic_before)
    started = events_of(got)[0]
    assert isinstance(started, RunStarted)
    assert started.device == f"cuda:{torch.cuda.get_device_name()}" and started.world_size == 1
    assert_close_steps(steps_of(want), steps_of(got), rtol=1e-4)
