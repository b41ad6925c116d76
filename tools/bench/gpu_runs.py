"""Parts 4, 5 and 6 of `rewind bench gpu`: runs compared with runs, through the `rewind` command.

4. exactness: the tiny config with compute.deterministic on the device, straight in a `rewind train`
   process; again in this one (bitwise equal); SIGKILLed once a checkpoint at or past the plan's kill_at
   exists and resumed by the same command (bitwise equal to the straight run); the straight run forked onto the CPU
   at its middle (within the documented tolerance: docs/distributed.md); `rewind replay` of the straight
   run on its device (bit for bit).
5. progressive: examples/progressive.toml (a frozen cached trunk, LoRA, an NF4 stack: Linear4bit's CUDA
   kernels), straight, and killed in its last stage then resumed: bitwise equal, and within tolerance.
6. fsdp: the tiny config in bf16-mixed (one-rank FSDP2), straight in one process, and under `torchrun
   --nproc-per-node 1` killed then resumed under torchrun: bitwise equal, and within tolerance.

Runs that are not killed go through the command in this process (`rewind.tools.cli.main`), which costs
no interpreter start; a killed run is its own process (tree) and is killed as a whole. A comparison
reads both logs (the effective StepCommitted events, bit for bit) and both exported final weights, and
asks `rewind diff` too. CPU forms: the same, a handful of steps on the CPU.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import torch

from rewind.tools.bench.gpu_part import ROOT, kill_tree
from rewind.tools.bench.gpu_schema import Comparison

# The documented tolerance across devices and world sizes (docs/distributed.md): losses within 1e-4
# relative, final weights within assert_close(rtol=1e-3, atol=1e-4), `rewind diff --rtol 1e-2` silent.
LOSS_RTOL, WEIGHT_RTOL, WEIGHT_ATOL, DIFF_RTOL = 1e-4, 1e-3, 1e-4, 1e-2
_CHECKPOINT_NAME = re.compile(r"^(\d{8})-[0-9a-f]{8}$")
# The CPU forms' evaluations (before training and at every stage boundary) score one forward's rows per
# task, not the default 64: the same code, at an eighth of what was half of progressive's training time
# on a CPU. The comparisons read the steps and the final weights, which evaluations do not touch.
CPU_EVAL_SAMPLES = "training.eval_samples=8"


@dataclass(frozen=True)
class Plan:
    config: str  # relative to the repository root
    overrides: tuple[str, ...]
    num_steps: int
    kill_at: int  # kill once a checkpoint at or past this step exists
    fork_at: int = 0


PLANS = {
    ("exactness", "cuda"): Plan(
        "examples/tiny.toml",
        (
            "training.tokens=[12800,6400,6400]",
            "logging.checkpoint_interval=10",
            "logging.keep_last_checkpoints=20",
        ),
        num_steps=100,
        kill_at=30,
        fork_at=50,
    ),
    ("exactness", "cpu"): Plan(
        "examples/tiny.toml",
        (
            "training.tokens=[1024,512,512]",
            "logging.checkpoint_interval=2",
            "logging.keep_last_checkpoints=10",
            CPU_EVAL_SAMPLES,
        ),
        num_steps=8,
        kill_at=2,
        fork_at=4,
    ),
    ("progressive", "cuda"): Plan(
        "examples/progressive.toml",
        ("training.tokens=[6400,6400,6400,6400]", "logging.checkpoint_interval=10"),
        num_steps=100,
        kill_at=80,
    ),
    ("progressive", "cpu"): Plan(
        "examples/progressive.toml",
        ("training.tokens=[512,512,512,512]", "logging.checkpoint_interval=2", CPU_EVAL_SAMPLES),
        num_steps=8,
        kill_at=6,
    ),
    ("fsdp", "cuda"): Plan(
        "examples/tiny.toml",
        (
            "training.tokens=[12800,6400,6400]",
            "logging.checkpoint_interval=10",
            'compute.precision="bf16-mixed"',
        ),
        num_steps=100,
        kill_at=30,
    ),
    ("fsdp", "cpu"): Plan(
        "examples/tiny.toml",
        (
            "training.tokens=[1024,512,512]",
            "logging.checkpoint_interval=2",
            'compute.precision="bf16-mixed"',
            CPU_EVAL_SAMPLES,
        ),
        num_steps=8,
        kill_at=2,
    ),
}


def exactness_part(rec, device: str, work: Path) -> None:
    plan = _start(rec, "exactness", device)
    if plan is None:
        return
    straight = work / "straight"
    rec.doing("the straight run")
    rec.figures(straight_s=_run_to_end(_command(plan, straight, device)))
    rec.doing("the same run again, in this process")
    _cli(*_train_args(plan, work / "again", device))
    rerun = compare(straight, work / "again", work)
    rec.figures(rerun=rerun)
    rec.check("a second deterministic run is bitwise equal", rerun.bitwise, describe(rerun))

    _kill_and_resume(rec, plan, device, work, straight, torchrun=False)

    fork = work / "fork"
    rec.doing("forking the straight run onto the CPU")
    _cli("fork", straight, fork, "--at-step", plan.fork_at, "--set", 'compute.device="cpu"', "--no-progress")
    fork_step = _of_type(_records(fork), "RunStarted")[0].parent.step
    forked = compare(straight, fork, work, rtol=DIFF_RTOL, after_step=fork_step)
    rec.figures(fork_step=fork_step, fork=forked)
    rec.check(
        "the fork onto the CPU is within the documented tolerance", within_tolerance(forked), describe(forked)
    )

    rec.doing("replaying the straight run on its device")
    code = _cli("replay", straight, "--no-progress", check=False)
    rec.figures(replay_exit=code)
    rec.check("rewind replay of the straight run matches it bit for bit", code == 0, f"exit {code}")


def progressive_part(rec, device: str, work: Path) -> None:
    plan = _start(rec, "progressive", device)
    if plan is None:
        return
    straight = work / "straight"
    rec.doing("the straight run")
    began = time.perf_counter()
    _cli(*_train_args(plan, straight, device))
    rec.figures(straight_s=time.perf_counter() - began)
    _kill_and_resume(rec, plan, device, work, straight, torchrun=False, tolerance=True)


def fsdp_part(rec, device: str, work: Path) -> None:
    plan = _start(rec, "fsdp", device)
    if plan is None:
        return
    # The reference: one process, no launcher (a one-rank group over an in-memory store). The same world
    # size computes the same bits, so the run under torchrun must end on them (killed or not).
    straight = work / "straight"
    rec.doing("the straight run, in this process")
    began = time.perf_counter()
    _cli(*_train_args(plan, straight, device))
    rec.figures(straight_s=time.perf_counter() - began)
    if _kill_and_resume(rec, plan, device, work, straight, torchrun=True, tolerance=True):
        records = _records(work / "killed")
        sizes = [e.world_size for e in _of_type(records, "RunStarted", "RunResumed")]
        rec.figures(recorded_world_sizes=sizes)
        rec.check("torchrun's start and resume record one process", sizes == [1, 1], f"world sizes {sizes}")


def _start(rec, part: str, device: str) -> Plan | None:
    plan = PLANS[(part, device)]
    if not (ROOT / plan.config).is_file():
        rec.skip(f"no {plan.config} in {ROOT} (an installed copy, not a checkout)")
        return None
    rec.figures(config=plan.config, overrides=list(_overrides(plan, device)), num_steps=plan.num_steps)
    return plan


def _overrides(plan: Plan, device: str) -> tuple[str, ...]:
    return (*plan.overrides, f'compute.device="{device}"', "compute.deterministic=true")


def _train_args(plan: Plan, run: Path, device: str) -> list[str]:
    sets = [part for override in _overrides(plan, device) for part in ("--set", override)]
    return ["train", str(ROOT / plan.config), "--run-dir", str(run), *sets, "--no-progress"]


def _command(plan: Plan, run: Path, device: str, *, torchrun: bool = False) -> list[str]:
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"] if torchrun else []
    return [sys.executable, *launcher, "-m", "rewind.tools.cli", *_train_args(plan, run, device)]


def _kill_and_resume(
    rec, plan: Plan, device: str, work: Path, straight: Path, *, torchrun: bool, tolerance: bool = False
) -> bool:
    """Kill a run once a checkpoint at or past plan.kill_at exists, resume it with the same command (under
    torchrun, or in this process), and compare it with the straight run. False: it was not killed mid-way."""
    killed = work / "killed"
    rec.doing("a run killed mid-way")
    at = _kill_mid_run(_command(plan, killed, device, torchrun=torchrun), killed, plan.kill_at)
    rec.figures(killed_after_checkpoint=at)
    detail = (
        f"after the checkpoint of step {at}"
        if at is not None
        else f"it ended before a checkpoint at {plan.kill_at}"
    )
    if not rec.check("the run was killed mid-way", at is not None, detail):
        return False
    rec.doing("resuming the killed run")
    if torchrun:
        _run_to_end(_command(plan, killed, device, torchrun=True))
    else:
        _cli(*_train_args(plan, killed, device))
    records = _records(killed)
    resumed = _of_type(records, "RunResumed")[0]
    first_resumed_seq = next(seq for seq, e in records if e is resumed)
    before = [e.step for seq, e in records if type(e).__name__ == "StepCommitted" and seq < first_resumed_seq]
    rec.figures(killed_after_step=max(before, default=0), resumed_from=resumed.checkpoint)
    found = compare(straight, killed, work, rtol=DIFF_RTOL if tolerance else None)
    rec.figures(resumed=found)
    rec.check("killed and resumed, bitwise equal to the straight run", found.bitwise, describe(found))
    if tolerance:
        rec.check(
            "killed and resumed, within the documented tolerance", within_tolerance(found), describe(found)
        )
    return True


def _kill_mid_run(command: list[str], run: Path, at_step: int) -> int | None:
    """Start `command`; SIGKILL its process tree once `run` holds a checkpoint directory at or past
    `at_step` (before its CheckpointCommitted, maybe: any moment will do). The checkpoint's step, or None
    when the process ended first."""
    process = subprocess.Popen(command)
    try:
        while process.poll() is None:
            step = _latest_checkpoint(run)
            if step is not None and step >= at_step:
                kill_tree(process.pid)
                process.wait()
                return step
            time.sleep(0.01)
        return None
    finally:
        if process.poll() is None:
            kill_tree(process.pid)
            process.wait()


def _latest_checkpoint(run: Path) -> int | None:
    try:
        names = [
            m.group(1) for m in (_CHECKPOINT_NAME.match(p.name) for p in (run / "checkpoints").iterdir()) if m
        ]
    except OSError:  # not there yet
        return None
    return max(map(int, names), default=None)


def _run_to_end(command: list[str]) -> float:
    """Run a command to its end (its output goes to the part's log); its wall time. A failure ends the part."""
    began = time.perf_counter()
    code = subprocess.run(command, check=False).returncode
    if code != 0:
        raise RuntimeError(f"{' '.join(command[1:6])} ... exited with {code}")
    return time.perf_counter() - began


def _cli(*args: object, check: bool = True) -> int:
    """`rewind ARGS` in this process: its exit code (a failure ends the part unless check is False)."""
    from rewind.tools.cli import main

    words = [str(a) for a in args]
    try:
        code = main(words)
    except SystemExit as exc:  # argparse
        code = int(exc.code or 0)
    sys.stdout.flush()
    if check and code != 0:
        raise RuntimeError(f"rewind {' '.join(words[:3])} ... exited with {code}")
    return code


def _records(run: Path) -> list:
    from rewind.stores.runs import read_seq_events

    return read_seq_events(run)


def _of_type(records: list, *names: str) -> list:
    return [e for _, e in records if type(e).__name__ in names]


def _steps(run: Path, after_step: int) -> dict:
    from rewind.states.history import effective

    steps = _of_type(effective(_records(run)), "StepCommitted")
    return {e.step: e for e in steps if e.step > after_step}


def _weights(run: Path, work: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = work / f"{run.name}.safetensors"
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # a run resumed since its last export
    _cli("export", run, "--to", path)
    return load_file(path)


def compare(a: Path, b: Path, work: Path, *, rtol: float | None = None, after_step: int = -1) -> Comparison:
    """Run b against run a: the steps both committed after `after_step`, the final weights, `rewind diff`
    bitwise and (when rtol is given) within rtol."""
    steps_a, steps_b = _steps(a, after_step), _steps(b, after_step)
    common = sorted(steps_a.keys() & steps_b.keys())
    encode = msgspec.msgpack.encode
    first = next((step for step in common if encode(steps_a[step]) != encode(steps_b[step])), None)
    losses = [(steps_a[s].loss, steps_b[s].loss) for s in common]
    weights_a, weights_b = _weights(a, work), _weights(b, work)
    differing, worst_rel, worst_ratio = 0, 0.0, 0.0
    for name in weights_a.keys() | weights_b.keys():
        x, y = weights_a.get(name), weights_b.get(name)
        if x is None or y is None or x.shape != y.shape or x.dtype != y.dtype:
            differing += 1
            worst_rel = worst_ratio = float("inf")
            continue
        if not torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)):
            differing += 1
        x64, y64 = x.double(), y.double()
        worst_rel = max(worst_rel, float((x64 - y64).norm() / x64.norm().clamp_min(1e-300)))
        ratio = (x64 - y64).abs() / (WEIGHT_ATOL + WEIGHT_RTOL * x64.abs())
        worst_ratio = max(worst_ratio, float(ratio.max()) if ratio.numel() else 0.0)
    return Comparison(
        steps_compared=len(common),
        steps_in_one_only=len(steps_a.keys() ^ steps_b.keys()),
        first_divergent_step=first,
        loss_max_rel=max((abs(x - y) / max(abs(x), 1e-12) for x, y in losses), default=0.0),
        tensors=len(weights_a.keys() | weights_b.keys()),
        differing_tensors=differing,
        weight_max_rel=worst_rel,
        weight_tolerance_ratio=worst_ratio,
        diff_exit=_cli("diff", a, b, check=False),
        diff_rtol=rtol,
        diff_rtol_exit=None if rtol is None else _cli("diff", a, b, "--rtol", rtol, check=False),
    )


def within_tolerance(found: Comparison) -> bool:
    return (
        found.steps_compared > 0
        and found.steps_in_one_only == 0
        and found.loss_max_rel <= LOSS_RTOL
        and found.weight_tolerance_ratio <= 1.0
        and found.diff_rtol_exit == 0
    )


def describe(found: Comparison) -> str:
    where = "none" if found.first_divergent_step is None else f"step {found.first_divergent_step}"
    text = (
        f"{found.steps_compared} steps compared ({found.steps_in_one_only} in one run only), first divergence: "
        f"{where}, losses within {found.loss_max_rel:.3g} relative; {found.differing_tensors} of {found.tensors} "
        f"final tensors differ, by {found.weight_max_rel:.3g} relative at most (tolerance ratio "
        f"{found.weight_tolerance_ratio:.3g}); rewind diff: exit {found.diff_exit}"
    )
    if found.diff_rtol is not None:
        text += f", with --rtol {found.diff_rtol:g}: exit {found.diff_rtol_exit}"
    return text
