"""`rewind bench TARGET`: speed figures as ratios against a baseline measured in the same run.

Targets are never checked by timed unit tests (machines differ); they are printed here, with the raw
figures, so a person can compare like with like.
"""

from __future__ import annotations

import argparse
import importlib
import time

from rewind.tools.errors import UsageError
from rewind.tools.jsonout import NON_FINITE_HELP, print_json

TARGETS = (
    "schedule", "log", "overhead", "resume", "cache", "data", "kernels", "mfu", "gpu", "threads", "startup", "rollout"
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmarks: schedule dry-run, event log, training-loop overhead, resume bookkeeping, activation cache, "
        "data reading and preparation, the fused loss kernel, model FLOPs utilisation (tokens/s, MFU); gpu: every "
        "CUDA claim checked in one call; threads: the tiny example beside CPU-bound competitors; startup: a restart's time "
        "to its first step over `import torch`; rollout: the batched cached sampler against transformers' generate",
    )
    p.add_argument("target", choices=TARGETS)
    p.add_argument("--json", action="store_true", help=f"print one JSON object ({NON_FINITE_HELP})")
    p.add_argument("--quick", action="store_true", help="smaller sizes (for smoke tests)")
    gpu = p.add_argument_group("bench gpu: every CUDA claim checked in one call (docs/distributed.md)")
    gpu.add_argument("--out", metavar="DIR", help="a new directory for gpu.json, summary.txt and each part's output")
    gpu.add_argument("--dry-run", action="store_true", help="hide CUDA: every part runs its CPU form")
    gpu.add_argument("--parts", metavar="A,B", help="only these parts (default: all)")
    p.set_defaults(run=run)


# Targets whose bench lives in one module's `run_*_bench(quick=...)`: (module, function, what it needs).
_MODULE_BENCHES = {
    "resume": ("rewind.tools.bench.resume", "run_resume_bench", "the stores"),
    "overhead": ("rewind.tools.bench.overhead", "run_overhead_bench", "the engine"),
    "data": ("rewind.tools.bench.data", "run_data_bench", "the engine and tokenizers"),
    "kernels": ("rewind.tools.bench.kernels", "run_kernels_bench", "torch"),
    "mfu": ("rewind.tools.bench.mfu", "run_mfu_bench", "the engine"),
    "threads": ("rewind.tools.bench.threads", "run_threads_bench", "the engine"),
    "startup": ("rewind.tools.bench.startup", "run_startup_bench", "the stores"),
    "rollout": ("rewind.tools.bench.rollout", "run_rollout_bench", "the engine and transformers"),
}


def _bench_function(target: str):
    module, function, needs = _MODULE_BENCHES[target]
    try:  # imported only when asked for: `rewind bench schedule` never imports torch
        return getattr(importlib.import_module(module), function)
    except ImportError as exc:
        raise UsageError(f"bench {target} needs {needs}: {exc}") from None


def run(args: argparse.Namespace) -> int:
    if args.target == "gpu":
        return _run_gpu(args)
    if args.out is not None or args.dry_run or args.parts is not None:
        raise UsageError(f"--out, --dry-run and --parts are options of bench gpu, not of bench {args.target}")
    if args.target == "schedule":
        result = bench_schedule(quick=args.quick)
    elif args.target == "log":
        from rewind.tools.bench.log import run_log_bench

        result = run_log_bench(num_events=2_000 if args.quick else 20_000)
    elif args.target == "cache":
        try:  # zarr for the cache, torch and the engine for the training half
            from rewind.tools.bench.cache_store import run_cache_bench
            from rewind.tools.bench.cache_trunk import run_trunk_speedup
        except ImportError as exc:
            raise UsageError(f"bench cache needs the engine and zarr: {exc}") from None
        result = {**run_cache_bench(quick=args.quick), **run_trunk_speedup(quick=args.quick)}
    elif args.target in _MODULE_BENCHES:
        result = _bench_function(args.target)(quick=args.quick)
    else:  # argparse's choices make this unreachable
        raise UsageError(f"unknown bench target {args.target!r}")
    if args.json:
        print_json(result)
    else:
        for key, value in result.items():
            print(f"{key:>28}: {value:.4g}" if isinstance(value, float) else f"{key:>28}: {value}")
    return 0


def _run_gpu(args: argparse.Namespace) -> int:
    from rewind.tools.bench.gpu import parse_parts, run_gpu_check  # torch-free: the parts import it

    if args.out is None:
        raise UsageError("bench gpu needs --out DIR (a new directory for gpu.json and summary.txt)")
    if args.quick:
        raise UsageError("bench gpu has no --quick: --dry-run runs every part's small CPU form")
    return run_gpu_check(args.out, dry_run=args.dry_run, parts=parse_parts(args.parts), as_json=args.json)


def _bench_config(num_steps: int):
    from rewind.states.config_reading import loads_config

    # Five stages with cosine fades over half of each smaller neighbour: the worst case for a walker.
    budgets = [num_steps * w // 10 for w in (4, 2, 2, 1, 1)]
    text = f"""
[architecture]
block_size = 1
[training]
batch_size = 1
tokens = {budgets}
datasets = [[{{name="grammar"}}], [{{name="reverse"}}], [{{name="sort"}}], [{{name="add"}}], [{{name="grammar"}}]]
[training.fade]
overlap = 0.5
curve = "cosine"
[optimization]
schedule = "wsd"
[optimization.kl]
betas = [0, 0.1, 0.1, 0.1, 0.1]
reference_update_stages = [1, 3]
"""
    return loads_config(text, source="bench")


def _walk_every_step(schedule) -> int:
    """The baseline: what a trainer without a pure schedule does, one decision per step."""
    from rewind.states.plan import due_events, started_state

    _, state = started_state(schedule.config)
    num_events = 0
    for k in range(schedule.num_steps + 1):
        state, events = due_events(state, schedule, k)
        num_events += len(events)
    return num_events


def _stages_config(num_stages: int):
    from rewind.states.config_reading import loads_config

    # 16 steps a stage, every boundary faded: a transition every few steps.
    return loads_config(
        f"""
[architecture]
block_size = 1
[training]
batch_size = 4
tokens = [{", ".join(["64"] * num_stages)}]
datasets = [{", ".join(['[{name="grammar"}]'] * num_stages)}]
[training.fade]
overlap = 0.5
""",
        source="bench",
    )


def _build_and_plan_s(num_stages: int) -> float:
    """Seconds to build a schedule of `num_stages` stages and plan the whole run (what `rewind schedule`
    and the fold of RunStarted do), the fastest of three."""
    from rewind.states.plan import plan
    from rewind.states.schedule import Schedule

    config = _stages_config(num_stages)
    times = []
    for _ in range(3):  # the fastest of three: the machine's noise is larger than a small run
        t0 = time.perf_counter()
        list(plan(Schedule(config)))
        times.append(time.perf_counter() - t0)
    return min(times)


def bench_schedule(quick: bool = False) -> dict:
    from rewind.states.check_stages import MAX_STAGES
    from rewind.states.plan import plan
    from rewind.states.schedule import Schedule

    big = 100_000 if quick else 1_000_000
    small = 10_000 if quick else 100_000
    t0 = time.perf_counter()
    schedule = Schedule(_bench_config(big))
    events = list(plan(schedule))
    dry_run_s = time.perf_counter() - t0

    small_schedule = Schedule(_bench_config(small))
    t0 = time.perf_counter()
    planned = len(list(plan(small_schedule)))
    plan_small_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    walked = _walk_every_step(small_schedule)
    walk_small_s = time.perf_counter() - t0
    if walked != planned:
        raise RuntimeError(f"plan and per-step walk disagree: {planned} vs {walked} events")
    # Linear in stages: time per stage at the most a config may have over that at a tenth of it (~1;
    # a schedule quadratic in its stages gives ~10).
    many = MAX_STAGES // 2 if quick else MAX_STAGES
    stages_s = _build_and_plan_s(many)
    few_s = _build_and_plan_s(many // 10)
    return {
        "num_steps": schedule.num_steps,
        "num_events": len(events),
        "dry_run_s": dry_run_s,
        "baseline": f"decide() at every one of {small:,} steps",
        "plan_small_s": plan_small_s,
        "walk_small_s": walk_small_s,
        "ratio": plan_small_s / walk_small_s,
        "num_stages": many,
        "stages_s": stages_s,
        "stages_baseline": f"the same run per stage with {many // 10} stages",
        "stages_ratio": (stages_s / many) / (few_s / (many // 10)),
    }
