"""The rollout files of a grpo run (stores/rollouts.py): written durably under their content's name, the
same batch always the same bytes, and every file a forged or damaged run could hold refused in one line."""

from __future__ import annotations

import hashlib
import os
import pickle
import tempfile
from pathlib import Path

import pytest
import safetensors.torch
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rewind.stores import fsio, rollouts
from rewind.stores.rollouts import (
    METADATA_KEY,
    RolloutError,
    check_rollout_tensors,
    encode_rollouts,
    read_rollouts,
    write_rollouts,
)

METADATA = {"reward_functions": "exact_match,length", "group_size": "3", "policy_step": "12"}


def make_batch(
    num_prompts: int = 2,
    group_size: int = 3,
    num_rewards: int = 2,
    prompt_width: int = 5,
    completion_width: int = 4,
    *,
    reference: bool = True,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """A consistent rollout batch of the module doc's format, random values."""
    gen = torch.Generator().manual_seed(seed)
    n = num_prompts * group_size
    completion_lengths = torch.randint(0, completion_width + 1, (n,), generator=gen)
    finished = ((completion_lengths > 0) & (torch.rand(n, generator=gen) < 0.5)).to(torch.int8)
    rewards = torch.rand(num_rewards, n, generator=gen)
    rewards[0, 0] = float("nan")  # a function that gave None
    batch = {
        "prompt_sources": torch.randint(0, 3, (num_prompts,), generator=gen),
        "prompt_rows": torch.randint(0, 1000, (num_prompts,), generator=gen),
        "prompts": torch.randint(0, 256, (num_prompts, prompt_width), generator=gen),
        "prompt_lengths": torch.randint(1, prompt_width + 1, (num_prompts,), generator=gen),
        "completions": torch.randint(0, 256, (n, completion_width), generator=gen),
        "completion_lengths": completion_lengths,
        "finished": finished,
        "sample_logprobs": -torch.rand(n, completion_width, generator=gen),
        "rewards": rewards,
        "advantages": torch.randn(n, generator=gen),
        "old_logprobs": -torch.rand(n, completion_width, generator=gen),
    }
    if reference:
        batch["reference_logprobs"] = -torch.rand(n, completion_width, generator=gen)
    return batch


def metadata_for(batch: dict[str, torch.Tensor]) -> dict[str, str]:
    num_rewards, n = batch["rewards"].shape
    names = ",".join(f"reward{i}" for i in range(num_rewards))
    return {"reward_functions": names, "group_size": str(n // len(batch["prompts"])), "policy_step": "3"}


def bits(tensor: torch.Tensor) -> tuple:
    """Dtype, shape and raw bytes: equal bit for bit, NaN included."""
    return tensor.dtype, tuple(tensor.shape), tensor.contiguous().numpy().tobytes()


def assert_one_line(exc: pytest.ExceptionInfo, *phrases: str) -> None:
    message = str(exc.value)
    assert "\n" not in message and "Traceback" not in message
    for phrase in phrases:
        assert phrase in message, message


def rollout_files(run: Path) -> list[str]:
    return sorted(os.listdir(run / "rollouts"))


# --- writing ------------------------------------------------------------------------------------------


def test_a_batch_reads_back_bit_for_bit_with_its_metadata(run_url):
    batch = make_batch()
    path, sha256 = write_rollouts(run_url, batch, METADATA)
    assert path == f"rollouts/{sha256}.safetensors"
    tensors, metadata = read_rollouts(run_url, path, sha256)
    assert metadata == METADATA
    assert {name: bits(t) for name, t in tensors.items()} == {name: bits(t) for name, t in batch.items()}


def test_the_name_is_the_sha256_of_the_bytes_on_disk(tmp_path):
    path, sha256 = write_rollouts(str(tmp_path), make_batch(), METADATA)
    assert hashlib.sha256((tmp_path / path).read_bytes()).hexdigest() == sha256


def test_the_same_batch_twice_is_the_same_name_and_one_file(run_url):
    batch = make_batch()
    first = write_rollouts(run_url, batch, METADATA)
    # The same content given in another order, and as new tensor objects.
    reordered = {name: batch[name].clone() for name in reversed(list(batch))}
    second = write_rollouts(run_url, reordered, dict(reversed(list(METADATA.items()))))
    assert first == second
    assert fsio.filesystem(run_url).join("rollouts").list_names() == [f"{first[1]}.safetensors"]


def test_the_bytes_do_not_depend_on_the_order_safetensors_keeps_metadata_in():
    # safetensors writes its metadata map in a Rust HashMap's random order: a dozen keys, each batch
    # written a dozen times, must still give one set of bytes.
    metadata = {**METADATA, **{f"extra{i}": str(i) for i in range(12)}}
    batch = make_batch()
    assert len({encode_rollouts(batch, metadata) for _ in range(12)}) == 1


def test_different_batches_get_different_names(tmp_path):
    a = write_rollouts(str(tmp_path), make_batch(seed=1), METADATA)
    b = write_rollouts(str(tmp_path), make_batch(seed=2), METADATA)
    assert a != b and len(rollout_files(tmp_path)) == 2


def test_the_file_is_synced_and_renamed_into_place_and_its_directory_synced_before_write_returns(
    tmp_path, monkeypatch
):
    steps: list[tuple] = []
    sync_fd, fsync_dir, replace = fsio.sync_fd, fsio.fsync_dir, os.replace

    def note_sync(fd):
        steps.append(("sync", os.readlink(f"/proc/self/fd/{fd}")))
        sync_fd(fd)

    def note_dir(path):
        steps.append(("dir", os.path.realpath(path)))
        fsync_dir(path)

    def note_replace(src, dst):
        steps.append(("rename", os.path.realpath(src), os.path.realpath(dst)))
        replace(src, dst)

    monkeypatch.setattr(fsio, "sync_fd", note_sync)
    monkeypatch.setattr(fsio, "fsync_dir", note_dir)
    monkeypatch.setattr(rollouts, "fsync_dir", note_dir)
    monkeypatch.setattr(os, "replace", note_replace)
    run = tmp_path.resolve()
    path, sha256 = write_rollouts(str(run), make_batch(), METADATA)
    final, directory = str(run / path), str(run / "rollouts")
    temporary = steps[1][1]
    assert steps == [
        ("dir", str(run)),  # rollouts/ made, and its name synced
        ("sync", temporary),  # the bytes synced under a temporary name beside the final one
        ("rename", temporary, final),
        ("dir", directory),  # the new name synced
    ]
    assert os.path.dirname(temporary) == directory and not os.path.exists(temporary)
    assert hashlib.sha256(Path(final).read_bytes()).hexdigest() == sha256


def test_a_write_that_dies_before_the_rename_leaves_no_file_under_the_name(tmp_path, monkeypatch):
    def crash(src, dst):
        raise OSError(28, "No space left on device", dst)

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        write_rollouts(str(tmp_path), make_batch(), METADATA)
    assert not [name for name in rollout_files(tmp_path) if not name.startswith(".")]


def test_a_damaged_copy_under_the_name_is_replaced(tmp_path):
    path, sha256 = write_rollouts(str(tmp_path), make_batch(), METADATA)
    good = (tmp_path / path).read_bytes()
    (tmp_path / path).write_bytes(good[: len(good) // 2])
    assert write_rollouts(str(tmp_path), make_batch(), METADATA) == (path, sha256)
    assert (tmp_path / path).read_bytes() == good


def test_a_batch_that_breaks_the_format_is_refused_before_anything_is_written(tmp_path):
    batch = make_batch()
    batch["advantages"] = batch["advantages"][:-1]
    with pytest.raises(RolloutError) as exc:
        write_rollouts(str(tmp_path), batch, METADATA)
    assert_one_line(exc, "not written", "advantages")
    assert not (tmp_path / "rollouts").exists()


def test_a_batch_whose_metadata_does_not_fit_is_refused(tmp_path):
    with pytest.raises(RolloutError) as exc:
        write_rollouts(str(tmp_path), make_batch(), {**METADATA, "group_size": "2"})
    assert_one_line(exc, "group_size")


@settings(max_examples=25, deadline=None)
@given(
    num_prompts=st.integers(1, 4),
    group_size=st.integers(1, 4),
    num_rewards=st.integers(1, 3),
    prompt_width=st.integers(1, 6),
    completion_width=st.integers(0, 6),
    reference=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_batches_of_any_shape_round_trip(
    num_prompts, group_size, num_rewards, prompt_width, completion_width, reference, seed
):
    batch = make_batch(
        num_prompts, group_size, num_rewards, prompt_width, completion_width, reference=reference, seed=seed
    )
    assert check_rollout_tensors(batch, metadata_for(batch)) == []
    with tempfile.TemporaryDirectory() as run:
        path, sha256 = write_rollouts(run, batch, metadata_for(batch))
        assert write_rollouts(run, batch, metadata_for(batch)) == (path, sha256)
        tensors, metadata = read_rollouts(run, path, sha256)
        assert os.listdir(os.path.join(run, "rollouts")) == [f"{sha256}.safetensors"]
    assert metadata == metadata_for(batch)
    assert {name: bits(t) for name, t in tensors.items()} == {name: bits(t) for name, t in batch.items()}


# --- what reading refuses -----------------------------------------------------------------------------


@pytest.fixture
def written(tmp_path) -> tuple[Path, str, str]:
    path, sha256 = write_rollouts(str(tmp_path), make_batch(), METADATA)
    return tmp_path, path, sha256


@pytest.mark.parametrize(
    "forged",
    [
        "../x",
        "rollouts/../../etc/passwd",
        "/etc/passwd",
        "rollouts/{sha}.safetensors/../../x",
        "./rollouts/{sha}.safetensors",
        "rollouts/{sha}.pt",
        "rollouts/{upper}.safetensors",
        "checkpoints/{sha}.safetensors",
        "",
    ],
)
def test_a_path_that_is_not_a_rollout_files_name_is_refused_before_any_read(written, forged):
    run, _, sha256 = written
    with pytest.raises(RolloutError) as exc:
        read_rollouts(str(run), forged.format(sha=sha256, upper=sha256.upper()), sha256)
    assert_one_line(exc, "is not one rewind writes")


def test_a_path_not_named_by_the_recorded_hash_is_refused(written):
    run, path, _ = written
    with pytest.raises(RolloutError) as exc:
        read_rollouts(str(run), path, "0" * 64)
    assert_one_line(exc, "not named by its recorded sha256")


def test_a_missing_file_is_refused(tmp_path):
    sha256 = "ab" * 32
    with pytest.raises(RolloutError) as exc:
        read_rollouts(str(tmp_path), f"rollouts/{sha256}.safetensors", sha256)
    assert_one_line(exc, "missing")


def test_a_truncated_file_is_refused_as_damaged(written):
    run, path, sha256 = written
    data = (run / path).read_bytes()
    (run / path).write_bytes(data[:-7])
    with pytest.raises(RolloutError) as exc:
        read_rollouts(str(run), path, sha256)
    assert_one_line(exc, "damaged", sha256[:12])


def plant(run: Path, data: bytes) -> tuple[str, str]:
    """A file holding `data` under the name its hash gives it: it passes every check but its content's."""
    sha256 = hashlib.sha256(data).hexdigest()
    (run / "rollouts").mkdir(exist_ok=True)
    (run / "rollouts" / f"{sha256}.safetensors").write_bytes(data)
    return f"rollouts/{sha256}.safetensors", sha256


class Boom:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_a_pickle_named_like_a_rollout_file_is_refused_unopened(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path, sha256 = plant(tmp_path, pickle.dumps({"prompts": Boom()}))
    with pytest.raises(RolloutError) as exc:
        read_rollouts(str(tmp_path), path, sha256)
    assert_one_line(exc, "not a safetensors file")
    assert not (tmp_path / "pwned").exists()


def test_a_safetensors_file_without_rewinds_metadata_is_refused(tmp_path):
    path, sha256 = plant(tmp_path, safetensors.torch.save(make_batch(), metadata=METADATA))
    with pytest.raises(RolloutError) as exc:
        read_rollouts(str(tmp_path), path, sha256)
    assert_one_line(exc, METADATA_KEY)


def test_a_file_with_inconsistent_tensors_is_refused(tmp_path):
    batch = make_batch()
    batch["old_logprobs"] = batch["old_logprobs"][:, :-1].contiguous()
    entry = '{"group_size":"3","policy_step":"12","reward_functions":"exact_match,length"}'
    path, sha256 = plant(tmp_path, safetensors.torch.save(batch, metadata={METADATA_KEY: entry}))
    with pytest.raises(RolloutError) as exc:
        read_rollouts(str(tmp_path), path, sha256)
    assert_one_line(exc, "not a rollout batch rewind writes", "old_logprobs has Lc = 3")


def test_a_file_over_the_size_bound_is_refused_before_it_is_read(written, monkeypatch):
    run, path, sha256 = written
    monkeypatch.setattr(rollouts, "MAX_ROLLOUT_BYTES", 100)
    with pytest.raises(RolloutError) as exc:
        read_rollouts(str(run), path, sha256)
    assert_one_line(exc, "more than the 100")


def test_a_link_out_of_the_run_is_refused(tmp_path):
    outside = tmp_path / "outside.safetensors"
    data = encode_rollouts(make_batch(), METADATA)
    outside.write_bytes(data)
    sha256 = hashlib.sha256(data).hexdigest()
    run = tmp_path / "run"
    (run / "rollouts").mkdir(parents=True)
    (run / "rollouts" / f"{sha256}.safetensors").symlink_to(outside)
    with pytest.raises(RolloutError) as exc:
        read_rollouts(str(run), f"rollouts/{sha256}.safetensors", sha256)
    assert_one_line(exc, "leads outside the run directory")


def test_a_fifo_under_a_rollout_name_is_refused_without_blocking(tmp_path):
    sha256 = "cd" * 32
    (tmp_path / "rollouts").mkdir()
    os.mkfifo(tmp_path / "rollouts" / f"{sha256}.safetensors")
    with pytest.raises(RolloutError) as exc:
        read_rollouts(str(tmp_path), f"rollouts/{sha256}.safetensors", sha256)
    assert_one_line(exc, "not a regular file")


# --- the format's checks ------------------------------------------------------------------------------


def test_a_consistent_batch_has_no_problem():
    assert check_rollout_tensors(make_batch(), METADATA) == []
    assert check_rollout_tensors(make_batch(reference=False), METADATA) == []


def _set(name, value):
    def change(batch):
        batch[name] = value(batch[name]) if callable(value) else value

    return change


BREAKAGES = {
    "missing": (lambda b: b.pop("advantages"), "no tensor 'advantages'"),
    "unknown": (_set("values", torch.zeros(6)), "unknown tensor 'values'"),
    "dtype": (_set("finished", lambda t: t.to(torch.int64)), "finished is int64"),
    "rank": (_set("rewards", lambda t: t[0]), "rewards is float32 [6]"),
    "N": (_set("completion_lengths", lambda t: t[:-1]), "completion_lengths has N = 5"),
    "not a tensor": (_set("prompt_rows", [1, 2]), "prompt_rows is a list"),
    "length": (_set("completion_lengths", lambda t: t + 5), "completion_lengths holds a length outside 0..4"),
    "negative row": (_set("prompt_rows", lambda t: t - 2000), "prompt_rows holds a negative index"),
    "finished": (_set("finished", lambda t: t + 2), "finished holds a value other than 0 and 1"),
    "finished empty": (
        lambda b: (b["completion_lengths"].__setitem__(0, 0), b["finished"].__setitem__(0, 1)),
        "finished with the end token but has no tokens",
    ),
    "token": (_set("prompts", lambda t: t - 1000), "prompts holds a negative token id"),
}


@pytest.mark.parametrize("breakage", list(BREAKAGES))
def test_each_way_a_batch_breaks_the_format_is_named(breakage):
    batch = make_batch()
    change, expected = BREAKAGES[breakage]
    change(batch)
    problems = check_rollout_tensors(batch, METADATA)
    assert any(expected in problem for problem in problems), problems


def test_padding_past_a_rows_length_is_not_checked():
    batch = make_batch()
    batch["prompt_lengths"][:] = 1
    batch["prompts"][:, 1:] = -1  # whatever the engine pads with
    assert check_rollout_tensors(batch, METADATA) == []


def test_a_group_that_is_not_whole_is_named():
    batch = make_batch(num_prompts=2, group_size=3)
    for name in ("prompt_sources", "prompt_rows", "prompt_lengths", "prompts"):
        batch[name] = torch.cat([batch[name], batch[name][:2]])[:4]  # 4 prompts for 6 completions
    problems = check_rollout_tensors(batch)
    assert any("not a whole group per prompt" in problem for problem in problems), problems


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"group_size": "2"}, "metadata group_size '2'"),
        ({"group_size": "three"}, "metadata group_size 'three'"),
        ({"policy_step": "-1"}, "metadata policy_step '-1'"),
        ({"reward_functions": "exact_match"}, "does not name the 2 rows"),
        ({"reward_functions": "exact_match,"}, "does not name the 2 rows"),
        ({"policy_step": 3}, "is not a string"),
    ],
)
def test_metadata_that_does_not_fit_the_tensors_is_named(change, expected):
    problems = check_rollout_tensors(make_batch(), {**METADATA, **change})
    assert any(expected in problem for problem in problems), problems


def test_metadata_without_a_required_key_is_named():
    problems = check_rollout_tensors(make_batch(), {"group_size": "3"})
    assert problems == ["no metadata 'reward_functions'", "no metadata 'policy_step'"]
