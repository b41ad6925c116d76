"""Regression checks for the exactness harness: three deliberate engine bugs it must catch.

Each bug is patched into every process the harness starts (tests/engine/breakage_launcher.py), the
harness trains the run through the very kill schedule that passes without the patch, and the check
that must catch the bug has to fail. Every bug is invisible in a run that never stops, which is why
the straight run is shared: the patches only act on a resume (their marks say they did).

- resume-from-start: resume ignores every checkpoint and retrains from step 0. The weights and the
  effective steps still come out right (training is deterministic), so only the restore-point check
  sees it.
- effective-counts-superseded: `effective()` keeps superseded records: only a log with committed steps
  past a checkpoint at a kill (a non-empty superseded range) shows it.
- dropout-seed-from-counter: dropout masks keyed by a process-local step counter instead of the step
  (the classic lost-RNG bug): only dropout > 0 and a resume from a checkpoint after step 0 show it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.exactness import CI_SCHEDULE, KILL_SEED, shared_killed, shared_straight, train_killed
from tests.engine.exactness_checks import check


def _caught(factory: pytest.TempPathFactory, tmp_path: Path, breakage: str) -> tuple[dict[str, str], str]:
    """The harness's problems with `breakage` patched in, and the marks its patches left."""
    _, clean = shared_killed(factory)
    assert clean == {}, "without the patch the same harness must pass"
    server, straight = shared_straight(factory)
    marks = tmp_path / "marks"
    killed = train_killed(
        server, tmp_path / "run", CI_SCHEDULE, straight.seconds_per_step, seed=KILL_SEED, breakage=breakage, marks=marks
    )
    problems = check(server, straight, killed, breakage, marks)
    return problems, marks.read_text() if marks.exists() else ""


def test_resume_ignoring_every_checkpoint_is_caught(tmp_path_factory, tmp_path):
    problems, marks = _caught(tmp_path_factory, tmp_path, "resume-from-start")
    assert "resume-from-start: a resume ignored the log's checkpoints" in marks
    assert "restore-point" in problems
    assert "resumed from the start (step 0)" in problems["restore-point"]
    # What let it through before: the weights and the steps it reports are those of the straight run.
    assert "weights" not in problems and "effective-steps" not in problems


def test_effective_counting_superseded_records_is_caught(tmp_path_factory, tmp_path):
    problems, marks = _caught(tmp_path_factory, tmp_path, "effective-counts-superseded")
    assert "effective-counts-superseded: superseded records were counted" in marks
    assert "effective-steps" in problems
    assert "superseded" not in problems  # the schedule did make superseded steps for it to count


def test_dropout_seed_from_a_process_local_counter_is_caught(tmp_path_factory, tmp_path):
    problems, marks = _caught(tmp_path_factory, tmp_path, "dropout-seed-from-counter")
    assert "dropout-seed-from-counter: a step drew another step's dropout masks" in marks
    assert {"weights", "effective-steps", "recomputed"} <= problems.keys()
