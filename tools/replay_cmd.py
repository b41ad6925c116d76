"""`rewind replay RUN [--from-checkpoint C] [--to-step N] [--rtol R]`: re-execute a window of a run and
compare every recomputed step with the logged one, and the live tensors with every checkpoint (its
recorded hashes; within --rtol, its files' values). Exit 0 when everything matches, 1 at the first
mismatch (which is reported, with a hint when the window was computed where bits are not promised)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys

from rewind.states.diffing import promises_bits
from rewind.tools.errors import CommandError, UsageError
from rewind.tools.jsonout import NON_FINITE_HELP, print_json

COMPARED = "stage, lr, beta, loss, kl, grad norm, rows, cursors, skipped, metrics"
# What a run computed on a GPU or by several processes can be expected to match within (docs/distributed.md).
TOLERANCE_ADVICE = "--rtol 1e-5 (fp32; bf16 runs need ~1e-2), see docs/distributed.md"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("replay", help="re-execute a run's steps from a checkpoint and compare them with the log")
    p.add_argument("run_dir", metavar="RUN")
    p.add_argument("--from-checkpoint", metavar="C", help="a checkpoint name or step (default: the earliest start)")
    p.add_argument("--to-step", type=int, metavar="N", help="last step to re-execute (default: the last logged)")
    p.add_argument("--rtol", type=float, default=0.0, help="relative tolerance for floats (default 0: bit for bit)")
    p.add_argument("--json", action="store_true", help=f"the report as one JSON object ({NON_FINITE_HELP})")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from rewind.engine.model.placement import leave_process_group
    from rewind.engine.run.entry import enter
    from rewind.engine.run.parts import RunError
    from rewind.engine.run.replay import ReplayError, replay
    from rewind.states.entry import Replay

    if not (args.rtol >= 0.0 and math.isfinite(args.rtol)):
        raise UsageError(f"--rtol {args.rtol}: must be a finite number >= 0")
    bar = None
    try:
        # Where it starts, computing as the run did there (compute.device = "auto": where the run computed,
        # if this machine has it; a bf16-mixed run through FSDP2, a one-rank group here, as it trained).
        entered = enter(Replay(args.from_checkpoint, args.to_step), args.run_dir)
        if entered.note:
            print(f"rewind: {entered.note}", file=sys.stderr)
        bar = _ProgressBar(enabled=not args.no_progress and not args.json, total=entered.entry.to_step)
        report = replay(entered, rtol=args.rtol, progress=bar)
    except (ReplayError, RunError) as exc:
        raise CommandError(str(exc), exc.exit_code) from None
    finally:
        if bar is not None:
            bar.close()
        leave_process_group()
    if args.json:
        print_json(as_dict(report, args.rtol), default=repr)
    else:
        print(describe(report, args.run_dir, args.rtol))
    return 0 if report.mismatch is None else 1


def as_dict(report, rtol: float) -> dict:
    mismatch = report.mismatch
    return {
        "start_checkpoint": report.start_checkpoint,
        "start_step": report.start_step,
        "to_step": report.to_step,
        "rtol": rtol,
        "num_steps_compared": report.num_steps,
        "num_rollouts_resampled": report.num_rollouts,
        "checkpoints_matched": report.checkpoints_matched,
        "checkpoints_not_compared": report.checkpoints_not_compared,
        "computed_on": [{"device": device, "world_size": size} for device, size in report.computed_on],
        "reproducible": mismatch is None,
        "mismatch": None
        if mismatch is None
        else {
            "step": mismatch.step,
            "seq": mismatch.seq,
            "event": mismatch.event,
            "field": mismatch.difference.field,
            "logged": mismatch.difference.a,
            "recomputed": mismatch.difference.b,
            "tensor": None if mismatch.tensor is None else dataclasses.asdict(mismatch.tensor),
        },
        "hint": replay_hint(report, rtol) or None,
    }


def describe(report, run_dir: str, rtol: float) -> str:
    start = f"checkpoint {report.start_checkpoint}" if report.start_checkpoint else "the run's start"
    exact = "bit for bit" if rtol == 0 else f"within rtol {rtol:g}"
    lines = [f"replayed {run_dir} from {start} (step {report.start_step}) towards step {report.to_step}"]
    mismatch = report.mismatch
    if mismatch is None:
        lines.append(f"  steps {report.start_step + 1}..{report.to_step}: {report.num_steps} recomputed, "
                     f"all equal to the log {exact} ({COMPARED})")
    else:
        lines.append(f"  {report.num_steps - (mismatch.event == 'StepCommitted')} steps matched {exact} before")
    if report.num_rollouts and (mismatch is None or mismatch.event != "RolloutsRecorded"):
        lines.append(f"  rollouts: {report.num_rollouts} batch(es) sampled again, the same tokens as on record "
                     "(their files' names)")
    if report.checkpoints_matched:
        against = "hashes" if rtol == 0 else f"files (hashes, once deleted) within rtol {rtol:g} by norm"
        lines.append(f"  model and optimizer tensors equal the {against} of {len(report.checkpoints_matched)} "
                     f"checkpoint(s): {', '.join(report.checkpoints_matched)}")
    if report.checkpoints_not_compared:
        lines.append(f"  not compared (files deleted, bits differ): {len(report.checkpoints_not_compared)} "
                     f"checkpoint(s): {', '.join(report.checkpoints_not_compared)}")
    if mismatch is None:
        lines.append("replay: reproducible")
        return "\n".join(lines)
    d = mismatch.difference
    lines.append(f"FIRST MISMATCH at step {mismatch.step} (seq {mismatch.seq}, {mismatch.event}.{d.field}):")
    lines.append(f"  logged      {d.a!r}")
    lines.append(f"  recomputed  {d.b!r}")
    if isinstance(d.a, float) and isinstance(d.b, float):
        delta = abs(d.a - d.b)
        lines.append(f"  |delta| {delta:.3g}, relative {delta / max(abs(d.a), abs(d.b), 1e-300):.3g}")
    if mismatch.tensor is not None:
        t = mismatch.tensor
        lines.append(f"  worst tensor {t.tensor} of {t.file}: ||recomputed - logged|| / ||logged|| = "
                     f"{t.relative_difference:.3g} (rtol {rtol:g}); {t.num_different:,} of {t.num_elements:,} "
                     f"elements differ, most at {t.index} (shown above)")
    if mismatch.event == "CheckpointCommitted":
        lines.append("  every step before matched, so the difference is in state no step reports (e.g. optimizer moments)")
    if hint := replay_hint(report, rtol):
        lines.append(f"  hint: {hint}")
    lines.append(f"replay: not reproducible at step {mismatch.step}")
    return "\n".join(lines)


def describe_sites(sites) -> str:
    """(device, world size) pairs as words: "cuda:NVIDIA H100 80GB HBM3 in 8 processes, then cpu"."""
    return ", then ".join(device + (f" in {size} processes" if size > 1 else "") for device, size in sites)


def replay_hint(report, rtol: float) -> str:
    """Why a bitwise mismatch may be no fault, when the window was computed on a GPU or by several
    processes: their bits are promised only within a tolerance. "" otherwise."""
    if report.mismatch is None or rtol != 0 or all(promises_bits(site) for site in report.computed_on):
        return ""
    return (
        f"the replayed window was computed on {describe_sites(report.computed_on)}, where bits are promised "
        f"only within a tolerance, not bit for bit: compare with {TOLERANCE_ADVICE}"
    )


class _ProgressBar:
    """Appears with the first replayed step, so a request refused up front prints only its one line;
    counts steps up to `total`, the last step replayed."""

    def __init__(self, enabled: bool, total: int):
        self.enabled = enabled
        self.total = total
        self.bar = None

    def __call__(self, step: int) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(
                unit="step", dynamic_ncols=True, file=sys.stderr, desc="replay", initial=step - 1, total=self.total
            )
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
