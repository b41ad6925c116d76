"""Regenerate the demo figures: every output README.md and the guide under docs/ quote from a demo run.

Run by hand from the repository root:  python tests/docs/make_readme_figures.py [--work DIR] [--seeds 1234,1,2]

It trains the demo (straight; killed with SIGKILL once step 330 is durable, then resumed by the same
command; a fork; the no-KL variant; several seeds of both) in DIR (default /tmp/rewind-readme), runs the
commands the worked session (README.md, docs/inspecting.md) shows, and writes what each printed to
docs/figures/*.txt, with docs/figures/machine.json saying where the figures were made, then pastes each
file into the blocks that quote it. tests/docs/test_readme.py checks that every block of README.md or a
page under docs/ marked `<!-- figure: docs/figures/NAME.txt -->` is exactly that file, and re-runs the
straight demo to compare its figures where the machine is the same kind (see machine_fingerprint).

Why "the same kind": a CPU run is bit for bit reproducible for a given torch build, CPU kernel capability
(AVX2, AVX512, ...: torch dispatches to different kernels, whose float sums differ) and thread count. On
another kind of machine the demo prints other figures, and resumes there still match its straight runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # for `tests.docs`

from tests.docs.readme_figures import FIGURES_DIR, doc_pages, machine_fingerprint  # noqa: E402

KILL_AT_STEP = 330
DEMO_SEED = 1234  # examples/abcd*.toml's run.seed
FORK_STEP = 481
# The tasks with answers: accuracy is an answer-token figure (grammar is running text: it gets a loss).
TASKS = ["reverse", "sort", "add"]


def rewind(work: Path, *args: str, check: bool = True) -> str:
    """`$ rewind ARGS` and what it printed (stdout then stderr), run in `work` as a user would."""
    done = subprocess.run(
        [sys.executable, "-m", "rewind.tools.cli", *args], cwd=work, capture_output=True, text=True
    )
    if check and done.returncode not in (0, 1):
        raise SystemExit(f"rewind {' '.join(args)} failed ({done.returncode}):\n{done.stderr}")
    return done.stdout + done.stderr


def last_durable_step(run: Path) -> int:
    from rewind.states.events import StepCommitted
    from rewind.stores.runs import LogNotFoundError, iter_records

    try:
        steps = [e.step for _, e in iter_records(run) if isinstance(e, StepCommitted)]
    except (LogNotFoundError, FileNotFoundError):
        return -1
    return max(steps, default=-1)


def train_killed(work: Path, config: str, run: str) -> None:
    """Train until step KILL_AT_STEP is durable in the log, then SIGKILL: the log then ends exactly at
    the group commit holding that step (the next one comes report_interval steps later)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "rewind.tools.cli", "train", config, "--run-dir", run, "--no-progress"],
        cwd=work,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while last_durable_step(work / run) < KILL_AT_STEP:
            if process.poll() is not None:
                raise SystemExit("the run ended before it could be killed")
            time.sleep(0.01)
        process.send_signal(signal.SIGKILL)
    finally:
        process.wait()
    if last_durable_step(work / run) != KILL_AT_STEP:
        raise SystemExit("the next group commit landed before the kill: run again")


def accuracy(work: Path, run: str) -> dict[int, dict[str, float]]:
    """boundary -> task -> answer-token accuracy (boundary -1: before training)."""
    summary = json.loads(rewind(work, "timeline", run, "--json"))
    table = {row["stage"]: row["evaluation"] for row in summary["stages"] if row["evaluation"]}
    if summary.get("evaluation_before_training"):
        table[-1] = summary["evaluation_before_training"]
    return table


def accuracy_table(kl: dict, nokl: dict) -> str:
    lines = [
        f"{'':13}{'with token_kl (reference after A)':^27}  {'without KL':^25}",
        f"{'after stage':>12}  "
        + "  ".join(f"{t:>7}" for t in TASKS)
        + "    "
        + "  ".join(f"{t:>7}" for t in TASKS),
    ]
    for boundary in sorted(kl):
        name = "(start)" if boundary < 0 else str(boundary)
        left = "  ".join(f"{kl[boundary].get(t, float('nan')):7.3f}" for t in TASKS)
        right = "  ".join(f"{nokl.get(boundary, {}).get(t, float('nan')):7.3f}" for t in TASKS)
        lines.append(f"{name:>12}  {left}    {right}")
    return "\n".join(lines)


# What else might keep the earlier tasks, run over the same seeds: the reference refreshed at every
# stage, and replay of every earlier task's data (10-20% of each batch), with and without KL.
REPLAY = (
    'training.datasets=[[{name="grammar",rate=1.0}],[{name="reverse",rate=0.8},{name="grammar",rate=0.2}],'
    '[{name="sort",rate=0.6},{name="reverse",rate=0.2},{name="grammar",rate=0.2}],'
    '[{name="add",rate=0.6},{name="reverse",rate=0.1},{name="sort",rate=0.1},{name="grammar",rate=0.2}]]'
)
VARIANTS = {  # name -> (config, overrides)
    "kl": ("abcd", ()),
    "no_kl": ("abcd_nokl", ()),
    "kl_refresh": ("abcd", ("optimization.kl.reference_update_stages=[1,2,3]",)),
    "replay_kl": ("abcd", (REPLAY,)),
    "replay_no_kl": ("abcd_nokl", (REPLAY,)),
}


def seeds_table(work: Path, seeds: list[int]) -> str:
    """Accuracy at the end of stages C (2) and D (3) per variant: the mean over the seeds and the range."""
    lines = [f"{'variant':>13} {'after':>6}  " + "  ".join(f"{t:>15}" for t in TASKS)]
    for variant, (config, overrides) in VARIANTS.items():
        tables = []
        for seed in seeds:
            if overrides:
                run = f"runs/{variant}_s{seed}"
            else:  # the demo's own config: its own run for its own seed
                run = f"runs/{config}" if seed == DEMO_SEED else f"runs/{config}_s{seed}"
            if not (work / run / "events").exists() or last_durable_step(work / run) < 800:
                sets = [part for o in (f"run.seed={seed}", *overrides) for part in ("--set", o)]
                rewind(work, "train", f"examples/{config}.toml", "--run-dir", run, "--no-progress", *sets)
            tables.append(accuracy(work, run))
        for boundary in (2, 3):
            cells = []
            for task in TASKS:
                values = [table[boundary][task] for table in tables]
                cells.append(f"{statistics.fmean(values):.3f} ({min(values):.2f}-{max(values):.2f})")
            lines.append(f"{variant:>13} {boundary:>6}  " + "  ".join(f"{c:>15}" for c in cells))
    lines.append(f"(mean over seeds {', '.join(map(str, seeds))}, and the range)")
    return "\n".join(lines)


def progressive_table(work: Path) -> str:
    """The per-stack table examples/progressive.toml ends with (trained from scratch)."""
    shutil.rmtree(work / "runs/progressive", ignore_errors=True)
    printed = rewind(work, "train", "examples/progressive.toml", "--run-dir", "runs/progressive", "--no-progress")
    lines = printed.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("per stack:"))
    return "\n".join(lines[start : start + 6])


# What docs/own_text.md shows of examples/text.toml: samples before and after the task stage, the export loaded
# in transformers by examples/load_hf.py (its greedy continuation next to rewind's), and `rewind eval`.
TEXT_PROMPTS = ("def parse_args(", "sort qzkd=")
TEXT_BEFORE_STEP = 321  # the checkpoint that closes pretraining (the boundary of stage 0)


def text_figure(work: Path) -> str:
    shutil.rmtree(work / "runs/text", ignore_errors=True)
    shutil.rmtree(work / "runs/text-hf", ignore_errors=True)
    trained = rewind(work, "train", "examples/text.toml", "--run-dir", "runs/text", "--no-progress")
    lines = trained.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("answer-token accuracy"))
    shown = ["$ rewind train examples/text.toml --run-dir runs/text", "...", *lines[start:]]
    for prompt in TEXT_PROMPTS:
        for step in (TEXT_BEFORE_STEP, None):
            at = ["--at-step", str(step)] if step is not None else []
            args = ["sample", "runs/text", *at, "--prompt", prompt, "--max-tokens", "16", "--temperature", "0"]
            shown += ["", f"$ rewind {' '.join(args[:-6])} --prompt {prompt!r} --max-tokens 16 --temperature 0"]
            shown.append(rewind(work, *args).rstrip("\n"))  # as it prints: the completion's raw text
    shown += ["", "$ rewind eval runs/text --dataset stdlib", rewind(work, "eval", "runs/text", "--dataset", "stdlib").rstrip()]
    shown += ["", "$ rewind export runs/text --hf runs/text-hf", rewind(work, "export", "runs/text", "--hf", "runs/text-hf").rstrip()]
    loaded = subprocess.run(
        [sys.executable, "examples/load_hf.py", "runs/text-hf", TEXT_PROMPTS[0]],
        cwd=work, capture_output=True, text=True, check=True,
    ).stdout.rstrip("\n")
    shown += ["", f"$ python examples/load_hf.py runs/text-hf {TEXT_PROMPTS[0]!r}", loaded]
    return "\n".join(shown)


def excerpt(text: str, keep) -> str:
    return "\n".join(line for line in text.splitlines() if keep(line))


def fill_pages() -> int:
    """Paste each figure file into the blocks of README.md and of the pages under docs/ marked with it;
    returns how many blocks changed (a page with none changed is not rewritten)."""
    changed = 0
    for page in doc_pages():
        lines = page.read_text().splitlines()
        before = changed
        for i, line in enumerate(lines):
            if not line.startswith("<!-- figure: "):
                continue
            marked = line.strip().removeprefix("<!-- figure: ").removesuffix(" -->")
            end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith("```"))
            figure = (REPO / marked).read_text().splitlines()
            if lines[i + 2 : end] != figure:
                lines[i + 2 : end] = figure
                changed += 1
        if changed > before:
            page.write_text("\n".join(lines) + "\n")
    return changed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/rewind-readme"))
    parser.add_argument("--seeds", default="1234,1,2")
    parser.add_argument("--fill-only", action="store_true", help="only paste the figure files into the pages")
    parser.add_argument("--seeds-only", action="store_true", help="only the seeds table (reuses finished runs)")
    parser.add_argument("--progressive-only", action="store_true", help="only the progressive growth table")
    parser.add_argument("--text-only", action="store_true", help="only the real-data example (examples/text.toml)")
    options = parser.parse_args()
    if options.fill_only:
        print(f"{fill_pages()} page block(s) updated")
        return
    work = options.work
    if options.progressive_only:
        work.mkdir(parents=True, exist_ok=True)
        if not (work / "examples").exists():
            (work / "examples").symlink_to(REPO / "examples")
        (FIGURES_DIR / "progressive.txt").write_text(progressive_table(work) + "\n")
        print(f"wrote the progressive table; {fill_pages()} page block(s) updated")
        return
    if options.text_only:
        work.mkdir(parents=True, exist_ok=True)
        if not (work / "examples").exists():
            (work / "examples").symlink_to(REPO / "examples")
        (FIGURES_DIR / "text.txt").write_text(text_figure(work) + "\n")
        print(f"wrote the text example's figure; {fill_pages()} page block(s) updated")
        return
    if options.seeds_only:
        seeds = [int(s) for s in options.seeds.split(",")]
        (FIGURES_DIR / "seeds.txt").write_text(seeds_table(work, seeds) + "\n")
        print(f"wrote the seeds table; {fill_pages()} page block(s) updated")
        return
    # The demo's runs are made again; the seeds' variants are kept when finished (they are deterministic,
    # and the seeds table reads only their logs).
    for run in ("abcd", "abcd_nokl", "killed", "seed8", "progressive"):
        shutil.rmtree(work / "runs" / run, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "examples").exists():
        (work / "examples").symlink_to(REPO / "examples")
    figures: dict[str, str] = {}

    started = time.perf_counter()
    rewind(work, "train", "examples/abcd.toml", "--run-dir", "runs/abcd", "--no-progress")
    straight_seconds = time.perf_counter() - started
    train_killed(work, "examples/abcd.toml", "runs/killed")
    resumed = rewind(work, "train", "examples/abcd.toml", "--run-dir", "runs/killed", "--no-progress")
    figures["resume"] = excerpt(resumed, lambda line: line.startswith("resuming"))
    figures["state"] = rewind(work, "state", "runs/killed", "--at-step", str(KILL_AT_STEP))
    timeline = rewind(work, "timeline", "runs/killed", "--plot", "runs/killed/plots/timeline.png")
    figures["timeline"] = timeline
    shutil.copyfile(work / "runs/killed/plots/timeline.png", REPO / "docs" / "timeline.png")
    figures["diff_killed"] = rewind(work, "diff", "runs/abcd", "runs/killed")
    rewind(work, "fork", "runs/abcd", "runs/seed8", "--at-step", str(FORK_STEP), "--set", "run.seed=8")
    figures["diff_fork"] = rewind(work, "diff", "runs/abcd", "runs/seed8")
    figures["replay"] = rewind(work, "replay", "runs/killed", "--from-checkpoint", "321", "--to-step", "400", "--no-progress")
    rewind(work, "train", "examples/abcd_nokl.toml", "--run-dir", "runs/abcd_nokl", "--no-progress")
    figures["demo_table"] = accuracy_table(accuracy(work, "runs/abcd"), accuracy(work, "runs/abcd_nokl"))
    seeds = [int(s) for s in options.seeds.split(",")]
    figures["seeds"] = seeds_table(work, seeds)
    figures["progressive"] = progressive_table(work)
    figures["text"] = text_figure(work)
    checkpoints = sorted(p.name for p in (work / "runs/abcd/checkpoints").iterdir() if p.name[0].isdigit())
    FIGURES_DIR.mkdir(parents=True, exist_ok=True)
    for name, text in figures.items():
        (FIGURES_DIR / f"{name}.txt").write_text(text.rstrip("\n") + "\n")
    machine = {
        **machine_fingerprint(),
        "straight_seconds": round(straight_seconds, 1),
        "final_checkpoint": checkpoints[-1],
    }
    (FIGURES_DIR / "machine.json").write_text(json.dumps(machine, indent=1) + "\n")
    print(f"wrote {len(figures)} figures to {FIGURES_DIR} ({os.cpu_count()} CPUs here); {fill_pages()} page block(s) updated")


if __name__ == "__main__":
    main()
