"""`rewind replay --rtol R` compares checkpoints by value: tensors within R by norm pass (noise in elements
near zero included), a real difference names the worst tensor and its element, checkpoints whose files
retention deleted are matched by hash or reported as not compared, and missing files are one line."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from rewind.engine.run.replay import ATOL, compare_tensors, tensor_difference
from rewind.engine.step import mixed_step
from rewind.states.events import CheckpointCommitted, CheckpointDeleted
from rewind.states.history import effective
from rewind.stores.runs import read_seq_events
from tests.engine.test_loop import one_line, one_torch_thread, run_cli, straight_run

NUM_STEPS = 20
DELETED_STEPS = [4, 8, 12]  # the straight run's interval checkpoints that retention deleted
KEPT_STEPS = [11, 16, 20]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    return straight_run(tmp_path_factory)


def checkpoints_at(run: Path, steps: list[int]) -> list[str]:
    by_step = {e.step: e.checkpoint for _, e in effective(read_seq_events(run)) if isinstance(e, CheckpointCommitted)}
    return [by_step[step] for step in steps]


def replay_json(*args: object) -> tuple[int, dict, str]:
    code, out, err = run_cli("replay", *args, "--json", "--no-progress")
    return code, (json.loads(out) if out.strip() else {}), err


def after_every_step(monkeypatch: pytest.MonkeyPatch, change, only_step: int | None = None) -> None:
    """Run `change(model, optimizer)` after every step of the replay (or only after step index `only_step`)."""
    real = mixed_step.train_step

    def train_step(model, optimizer, *args, step, **kwargs):
        result = real(model, optimizer, *args, step=step, **kwargs)
        if only_step is None or step == only_step:
            change(model, optimizer)
        return result

    monkeypatch.setattr(mixed_step, "train_step", train_step)


def device_noise(model, optimizer) -> None:
    """What computing elsewhere does to a run, roughly: every weight off by a relative 1e-7 per step."""
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1 + 1e-7)


# --- the comparison ------------------------------------------------------------------------------------


def weights(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.02


def test_equal_tensors_and_nans_in_the_same_places_compare_equal():
    a = weights(8, 8)
    a[2, 3] = math.nan
    assert tensor_difference("w", "model.safetensors", a, a.clone()) is None
    assert compare_tensors("model.safetensors", {"w": a}, {"w": a.clone()}, rtol=0.0) == (None, None)


def test_noise_within_rtol_by_norm_passes_and_fails_under_a_tighter_rtol():
    a = weights(64, 64)
    b = a * (1 + 1e-7 * torch.randn(a.shape, generator=torch.Generator().manual_seed(1)))
    assert compare_tensors("model.safetensors", {"w": a}, {"w": b}, rtol=1e-5) == (None, None)
    difference, tensor = compare_tensors("model.safetensors", {"w": a}, {"w": b}, rtol=1e-9)
    assert tensor is not None and difference is not None
    assert 1e-9 < tensor.relative_difference < 1e-6
    assert tensor.num_different > 0 and tensor.num_elements == 64 * 64


def test_elements_near_zero_may_differ_by_large_relative_amounts():
    """Adam's first moment averages gradients of both signs: some elements sit near zero, and noise of
    the size of the others' moves them by far more than rtol of themselves."""
    a = weights(1000)
    a[7] = 1e-9
    b = a.clone()
    b[7] = 3e-9  # 200% off, 2e-9 away
    assert not torch.allclose(a, b, rtol=1e-5, atol=0.0)  # elementwise it fails
    assert compare_tensors("optimizer.safetensors", {"m": a}, {"m": b}, rtol=1e-5) == (None, None)


def test_one_element_far_off_in_a_large_tensor_is_found_and_named():
    a = weights(100, 100)
    b = a.clone()
    b[31, 4] += 0.02  # one element off by about one standard deviation: 1e-2 of the norm
    difference, tensor = compare_tensors("model.safetensors", {"w": a}, {"w": b}, rtol=1e-5)
    assert tensor is not None and (tensor.tensor, tensor.file, tensor.index) == ("w", "model.safetensors", [31, 4])
    assert tensor.num_different == 1 and 5e-3 < tensor.relative_difference < 2e-2
    assert tensor.max_abs_difference == pytest.approx(0.02, rel=1e-5)
    assert difference.field == "files.model.safetensors[w]"
    assert (difference.a, difference.b) == (a[31, 4].item(), b[31, 4].item())


def test_the_worst_tensor_is_the_one_furthest_outside_the_tolerance():
    a, c = weights(50, 50), weights(50, 50, seed=2)
    b, d = a * (1 + 1e-3), c * (1 + 1e-2)
    _, tensor = compare_tensors("model.safetensors", {"a": a, "c": c}, {"a": b, "c": d}, rtol=1e-5)
    assert tensor.tensor == "c" and tensor.relative_difference == pytest.approx(1e-2, rel=1e-3)


def test_a_tensor_of_zeros_passes_against_denormals_only():
    """Moments of a parameter that got no gradient yet: zero here, denormal-sized on another device."""
    zeros = torch.zeros(16)
    assert compare_tensors("optimizer.safetensors", {"v": zeros}, {"v": zeros + ATOL / 10}, rtol=1e-5) == (None, None)
    _, tensor = compare_tensors("optimizer.safetensors", {"v": zeros}, {"v": zeros + 1e-10}, rtol=1e-5)
    assert tensor is not None and tensor.relative_difference == math.inf


def test_squared_gradients_are_compared_at_their_own_scale():
    """exp_avg_sq holds values of 1e-10: a fixed absolute tolerance of any useful size would hide them."""
    v = weights(256).square() / 4e6  # about 1e-10
    assert compare_tensors("optimizer.safetensors", {"v": v}, {"v": v * 1.01}, rtol=1e-5)[1] is not None


@pytest.mark.parametrize(
    "live, expected",
    [
        ({"w": torch.zeros(4, dtype=torch.bfloat16)}, ("w", "float32[4]", "bfloat16[4]")),
        ({"w": torch.zeros(2, 2)}, ("w", "float32[4]", "float32[2, 2]")),
        ({"v": torch.zeros(4)}, ("v", None, "float32[4]")),  # v is the first name on one side only
    ],
    ids=["dtype", "shape", "name"],
)
def test_names_dtypes_and_shapes_must_agree_exactly(live, expected):
    difference, tensor = compare_tensors("model.safetensors", {"w": torch.zeros(4)}, live, rtol=1.0)
    name, logged, recomputed = expected
    assert tensor is None
    assert (difference.field, difference.a, difference.b) == (f"files.model.safetensors[{name}]", logged, recomputed)


def test_integer_tensors_and_one_sided_nans_are_never_within_a_tolerance():
    counts = torch.tensor([3, 4, 5])
    _, tensor = compare_tensors("optimizer.safetensors", {"n": counts}, {"n": counts + torch.tensor([0, 1, 0])}, 1.0)
    assert tensor.relative_difference == math.inf and tensor.index == [1]
    a = weights(10)
    b = a.clone()
    b[6] = math.nan
    _, tensor = compare_tensors("model.safetensors", {"w": a}, {"w": b}, rtol=1.0)
    assert tensor.relative_difference == math.inf and tensor.index == [6]


def test_bf16_tensors_are_compared_in_a_wider_type():
    a = weights(32, 32).bfloat16()
    b = (a.float() * (1 + 2**-7)).bfloat16()  # one bf16 ulp or so
    assert compare_tensors("model.safetensors", {"w": a}, {"w": b}, rtol=1e-2) == (None, None)
    _, tensor = compare_tensors("model.safetensors", {"w": a}, {"w": b}, rtol=1e-5)
    assert tensor is not None and 1e-3 < tensor.relative_difference < 2e-2


# --- replay within a tolerance ---------------------------------------------------------------------------


def test_an_exact_run_matches_every_checkpoint_within_a_tolerance_deleted_ones_by_hash(straight):
    code, report, err = replay_json(straight, "--rtol", "1e-5")
    assert code == 0, err
    assert report["num_steps_compared"] == NUM_STEPS
    assert report["checkpoints_matched"] == checkpoints_at(straight, [4, 8, 11, 12, 16, 20])
    assert report["checkpoints_not_compared"] == []
    assert report["computed_on"] == [{"device": "cpu", "world_size": 1}] and report["hint"] is None


def test_device_noise_fails_bitwise_and_passes_within_rtol(straight, monkeypatch):
    after_every_step(monkeypatch, device_noise)
    code, report, _ = replay_json(straight)
    assert code == 1 and report["mismatch"]["step"] == 2  # the first step after the first nudge
    code, out, err = run_cli("replay", straight, "--rtol", "1e-4", "--no-progress")
    assert code == 0, err
    assert out.strip().splitlines()[-1] == "replay: reproducible"
    kept, deleted = checkpoints_at(straight, KEPT_STEPS), checkpoints_at(straight, DELETED_STEPS)
    assert f"within rtol 0.0001 by norm of 3 checkpoint(s): {', '.join(kept)}" in out
    assert f"not compared (files deleted, bits differ): 3 checkpoint(s): {', '.join(deleted)}" in out
    code, report, _ = replay_json(straight, "--rtol", "1e-4")
    assert code == 0
    assert (report["checkpoints_matched"], report["checkpoints_not_compared"]) == (kept, deleted)


def test_moments_no_step_reports_are_caught_by_value_naming_the_worst_tensor(straight, monkeypatch):
    def bump_a_moment(model, optimizer):
        optimizer.state[model.embed.weight]["exp_avg_sq"].view(-1)[0] += 1.0

    after_every_step(monkeypatch, bump_a_moment, only_step=NUM_STEPS - 1)  # after the last step: no loss shows it
    code, report, _ = replay_json(straight, "--rtol", "1e-4")
    assert code == 1
    mismatch = report["mismatch"]
    name = "state.embed.weight.exp_avg_sq"
    assert (mismatch["event"], mismatch["step"]) == ("CheckpointCommitted", NUM_STEPS)
    assert mismatch["field"] == f"files.optimizer.safetensors[{name}]"
    tensor = mismatch["tensor"]
    assert (tensor["file"], tensor["tensor"], tensor["index"], tensor["num_different"]) == (
        "optimizer.safetensors", name, [0, 0], 1
    )
    assert tensor["relative_difference"] > 1e-4 and mismatch["recomputed"] - mismatch["logged"] == pytest.approx(1.0)
    code, out, _ = run_cli("replay", straight, "--rtol", "1e-4", "--no-progress")
    assert code == 1
    assert f"worst tensor {name} of optimizer.safetensors: ||recomputed - logged|| / ||logged|| = " in out
    assert "1 of 8,192 elements differ, most at [0, 0]" in out
    assert out.strip().splitlines()[-1] == f"replay: not reproducible at step {NUM_STEPS}"


def test_checkpoint_files_missing_without_a_deletion_on_record_is_one_line(straight, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    (name,) = checkpoints_at(run, [16])
    assert not any(isinstance(e, CheckpointDeleted) and e.checkpoint == name for _, e in read_seq_events(run))
    shutil.rmtree(run / "checkpoints" / name)
    code, out, err = run_cli("replay", run, "--rtol", "1e-5", "--no-progress")
    assert code == 1 and out == ""
    assert f"checkpoint {name} is not on disk, yet the log never deleted it" in one_line(err)
    assert run_cli("replay", run, "--no-progress")[0] == 0  # bitwise: the hashes the log recorded suffice


def test_a_damaged_checkpoint_file_is_one_line(straight, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    (name,) = checkpoints_at(run, [20])
    path = run / "checkpoints" / name / "optimizer.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    code, _, err = run_cli("replay", run, "--from-checkpoint", "16", "--rtol", "1e-5", "--no-progress")
    assert code == 1 and "Traceback" not in err
    assert f"cannot read checkpoint {name} to compare it" in one_line(err)
