"""DIR/summary.txt of `rewind bench gpu`: the report in a few lines a person reads (gpu.json has it all)."""

from __future__ import annotations

from rewind.tools.bench.gpu_schema import (
    Comparison,
    ExactnessFigures,
    GpuReport,
    GpuTestsFigures,
    KernelsFigures,
    MfuFigures,
    MfuRun,
    PartReport,
    RunFigures,
)


def summary(report: GpuReport) -> str:
    commit = (report.git_commit or "no commit")[:12] + (" (with changes)" if report.git_dirty else "")
    where = (
        report.device
        if report.cuda_skipped is None
        else f"{report.device} (CPU forms: {report.cuda_skipped})"
    )
    state = "" if report.finished else ", UNFINISHED"
    lines = [
        f"rewind bench gpu: {where}, torch {report.torch_version}, rewind {report.rewind_version} at {commit}",
        f"{report.date}, {report.duration_s:.0f} s (budget {report.budget_s:.0f} s){state}",
        "",
    ]
    for part in report.parts:
        device = part.device or "-"
        lines.append(
            f"{part.name:<12} {device:<5} {part.status:<9} {part.duration_s:5.0f} s of {part.budget_s:3.0f}"
        )
        if part.reason is not None and part.status != "failed":
            lines.append(f"    {part.reason}")
        lines.extend(f"    {line}" for line in headline(part))
        lines.extend(f"    FAILED: {c.name}: {c.detail}" for c in part.checks if not c.passed)
        for goal in part.goals:
            verdict = "met" if goal.met else "MISSED"
            lines.append(
                f"    goal {goal.name}: {goal.value:.3g} ({goal.direction} {goal.target:g}) {verdict}"
            )
    return "\n".join(lines) + "\n"


def headline(part: PartReport) -> list[str]:
    """What a part measured, in a line or two; nothing when it measured nothing."""
    f = part.figures
    if isinstance(f, GpuTestsFigures) and f.tests is not None:
        return [
            f"{f.tests} tests: {f.passed} passed, {f.skipped} skipped, {f.failed} failed, {f.errors} errors, "
            f"{f.timed_out} timed out (limit {f.per_test_timeout_s:g} s each)"
        ]
    if isinstance(f, KernelsFigures):
        lines = [
            f"{k.implementation} vs logits: memory {k.memory_ratio:.3f}x, time {k.time_ratio:.2f}x "
            f"({k.time_ratio_min:.2f}-{k.time_ratio_max:.2f})"
            for k in f.fused
        ]
        if f.agreement:
            worst = max(max(a.grad_hidden_rel, a.grad_weight_rel) for a in f.agreement)
            lines.append(
                f"agreement with the reference: {len(f.agreement)} cases, gradients within {worst:.2g} relative"
            )
        return lines
    if isinstance(f, MfuFigures):
        return [
            _mfu(name, run) for name, run in (("eager", f.eager), ("compiled", f.compiled)) if run is not None
        ]
    if isinstance(f, RunFigures):
        lines = []
        if isinstance(f, ExactnessFigures) and f.rerun is not None:
            lines.append(f"run again: {_compared(f.rerun)}")
        if f.resumed is not None:
            lines.append(f"killed after step {f.killed_after_step}, resumed: {_compared(f.resumed)}")
        if isinstance(f, ExactnessFigures) and f.fork is not None:
            lines.append(f"forked onto the CPU at step {f.fork_step}: {_compared(f.fork)}")
        return lines
    return []


def _mfu(name: str, run: MfuRun) -> str:
    mfu = "" if run.mfu is None else f"MFU {run.mfu:.1%}, "
    return (
        f"{name}: {mfu}{run.tokens_per_second:,.0f} tokens/s, step {run.step_ms:.1f} ms "
        f"({run.step_ms_min:.1f}-{run.step_ms_max:.1f}), first step {run.first_step_s:.1f} s"
    )


def _compared(c: Comparison) -> str:
    if c.bitwise:
        return f"bitwise equal ({c.steps_compared} steps, {c.tensors} tensors)"
    return (
        f"losses within {c.loss_max_rel:.2g}, weights within {c.weight_max_rel:.2g} relative "
        f"({c.differing_tensors} of {c.tensors} tensors differ)"
    )
