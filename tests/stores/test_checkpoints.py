"""Contract of the checkpoint store: bit-exact round trips, hash-pinned files, crash-safe writes."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import pickle
import re
import uuid

import fsspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rewind.stores import checkpoints, fsio, manifest
from rewind.stores.checkpoints import (
    FORMAT_WITH_LOG_SEQ,
    MANIFEST,
    WRITTEN,
    CheckpointCorrupt,
    CheckpointError,
    CheckpointNotFound,
    CheckpointStore,
    group_file,
)


@pytest.fixture(params=["local", "memory"])
def run_dir(request, tmp_path):
    """A fresh run directory on the local filesystem and on memory:// (object-store semantics)."""
    if request.param == "local":
        yield str(tmp_path / "run")
        return
    root = f"/rewind-checkpoint-tests/{uuid.uuid4().hex}"
    yield f"memory://{root}/run"
    fs = fsspec.filesystem("memory")  # one global store: leave nothing behind
    if fs.exists(root):
        fs.rm(root, recursive=True)


def sample_groups() -> dict[str, dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return {
        "model": {
            "embed.weight": torch.randn(5, 3, generator=generator),
            "norm.gain": torch.randn(3, generator=generator).to(torch.bfloat16),
            "head.half": torch.randn(2, 2, generator=generator).to(torch.float16),
            "counter": torch.tensor(7, dtype=torch.int64),  # 0-dim
            "empty": torch.empty(0, 4),
        },
        "optimizer": {
            "state.embed.weight.step": torch.tensor(5.0),
            "state.embed.weight.exp_avg": torch.randn(5, 3, generator=generator),
        },
        "reference": {"embed.weight": torch.randn(5, 3, generator=generator)},
        "adapters": {"lora.a": torch.randn(3, 1, generator=generator), "mask": torch.tensor([True, False])},
    }


def raw_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""


def assert_bit_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype, key
        assert got[key].shape == tensor.shape, key
        assert raw_bytes(got[key]) == raw_bytes(tensor), key


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read(store: CheckpointStore, name: str, file: str) -> bytes:
    return store._fs.cat_file(f"{store.root}/{name}/{file}")


def test_round_trip_is_bit_identical_for_every_dtype_and_shape(run_dir):
    store = CheckpointStore(run_dir)
    groups = sample_groups()
    written = store.write(12, groups, {"optimizer": {"betas": (0.9, 0.95), "lr": 3e-4}, "note": None})
    loaded = store.load(written.name, written.files)
    assert sorted(loaded) == sorted(groups)
    for group, tensors in groups.items():
        assert_bit_identical(loaded[group], tensors)
    # Tuples come back as lists: the manifest is JSON.
    assert store.load_manifest(written.name).meta == {
        "optimizer": {"betas": [0.9, 0.95], "lr": 3e-4},
        "note": None,
    }


def test_layout_name_and_hashes_are_what_the_event_will_carry(run_dir):
    store = CheckpointStore(run_dir)
    written = store.write(42, sample_groups(), {})
    assert re.fullmatch(r"00000042-[0-9a-f]{8}", written.name)
    manifest_bytes = read(store, written.name, MANIFEST)
    assert written.manifest_sha256 == sha256(manifest_bytes)
    assert written.name.endswith(written.manifest_sha256[:8])
    assert sorted(written.files) == [
        f"{g}.safetensors" for g in ("adapters", "model", "optimizer", "reference")
    ]
    for file, digest in written.files.items():
        assert sha256(read(store, written.name, file)) == digest
    assert sorted(store._fs.ls(f"{store.root}/{written.name}", detail=False)) == sorted(
        f"{store.root}/{written.name}/{file}" for file in [*written.files, MANIFEST]
    )
    assert store.names_on_disk() == [written.name]  # no temporaries left behind


def test_manifest_records_each_tensors_shape_dtype_and_raw_bytes_hash(run_dir):
    store = CheckpointStore(run_dir)
    groups = sample_groups()
    manifest = store.load_manifest(store.write(1, groups).name)
    assert manifest.step == 1
    assert manifest.format_version == checkpoints.FORMAT_VERSION
    entry = next(e for e in manifest.files if e.name == "model.safetensors")
    by_name = {t.name: t for t in entry.tensors}
    assert by_name["norm.gain"].dtype == "bfloat16"
    assert by_name["counter"].shape == [] and by_name["empty"].shape == [0, 4]
    for key, tensor in groups["model"].items():
        assert by_name[key].sha256 == sha256(raw_bytes(tensor)), key
    # Independent of our own byte extraction: numpy's view of a float32 tensor.
    assert by_name["embed.weight"].sha256 == sha256(groups["model"]["embed.weight"].numpy().tobytes())
    # The manifest holds nothing that varies between writes.
    assert not re.search(r"time|uuid|host|pid", read(store, store.write(1, groups).name, MANIFEST).decode())


@pytest.mark.parametrize(
    ("version", "digest"),
    [
        (FORMAT_WITH_LOG_SEQ, "9807993f6ca8e19abc29564f035408132eebf397e853b3e08d27374a951b54db"),
        (checkpoints.FORMAT_VERSION, "4e0497bcc728190c2c0ad92002ab773510c00ea05d08e13ea97cfbe105a38687"),
    ],
)
def test_the_bytes_and_hence_the_names_are_pinned(tmp_path, version, digest):
    """Names are content hashes: a changed byte in a safetensors file or in the manifest's JSON renames
    every checkpoint ever written, and old logs would no longer name what a rewrite produces (a fork
    copies its parent's checkpoints in the parent's format, and checks the name)."""
    groups = {
        "model": {
            "w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
            "g": torch.arange(3).to(torch.bfloat16),
            "n": torch.tensor(7),
        },
        "optimizer": {"m": torch.full((2,), -0.5, dtype=torch.float64), "mask": torch.tensor([True, False])},
    }
    meta = {"lr": 0.5, "betas": (0.9, 0.95)}
    written = CheckpointStore(tmp_path).write(12, groups, meta, format_version=version)
    assert written.name == f"00000012-{digest[:8]}"
    assert written.manifest_sha256 == digest
    assert written.files == {
        "model.safetensors": "064b67ec808e9fc4d3a37e0f1ee5f6a88edcc2d58f3bb46018e71a464a677159",
        "optimizer.safetensors": "e87cc892692c688061717916aecd2c29ec00cf19f0dd4ebbe50e37d5dd54d80b",
    }
    # group_file, which replay checks live tensors with, gives what the store records.
    assert group_file("model", groups["model"]) == ("model.safetensors", written.files["model.safetensors"])


def test_the_manifest_module_is_the_stores_public_api_too():
    """The store re-exports what moved to stores/manifest.py, as the same objects; the CLI reports its
    errors as damage (one line, exit 1), not a traceback."""
    for name in ("FORMAT_VERSION", "MANIFEST", "SUFFIX", "SUPPORTED_DTYPES", "TensorEntry", "FileEntry"):
        assert getattr(checkpoints, name) is getattr(manifest, name), name
    for name in ("Manifest", "CheckpointWritten", "CheckpointError", "CheckpointCorrupt", "group_file"):
        assert getattr(checkpoints, name) is getattr(manifest, name), name
    from rewind.tools.cli import _is_damage

    for error in (CheckpointError("x"), CheckpointCorrupt("c", "f", "p"), CheckpointNotFound("x")):
        assert _is_damage(error), error
    with pytest.raises(checkpoints.CheckpointError, match="model/w is a list"):
        manifest.checked_tensors("model", {"w": [1.0]})


def test_same_content_gives_the_same_name_and_bytes_anywhere(tmp_path):
    groups = sample_groups()
    reordered = {g: dict(reversed(list(t.items()))) for g, t in reversed(list(groups.items()))}
    first = CheckpointStore(tmp_path / "a").write(9, groups, {"x": 1, "y": [1.5, "s"]})
    second = CheckpointStore(tmp_path / "b").write(9, reordered, {"y": [1.5, "s"], "x": 1})
    assert first == second
    assert read(CheckpointStore(tmp_path / "a"), first.name, MANIFEST) == read(
        CheckpointStore(tmp_path / "b"), second.name, MANIFEST
    )
    store = CheckpointStore(tmp_path / "c")
    assert store.write(9, groups, {"x": 2, "y": [1.5, "s"]}).name != first.name
    assert store.write(10, groups, {"x": 1, "y": [1.5, "s"]}).name != first.name
    changed = sample_groups()
    changed["model"]["counter"] = torch.tensor(8)
    assert store.write(9, changed, {"x": 1, "y": [1.5, "s"]}).name != first.name


def test_format_2_names_the_state_and_keeps_the_log_position_beside_the_manifest(run_dir, tmp_path):
    """The same state written at two log positions (a straight run, a resumed one) gets one name and one
    manifest; each write's log position is in WRITTEN, where the store reads it back."""
    groups, meta = sample_groups(), {"control": {"step": 9}}
    store, elsewhere = CheckpointStore(run_dir), CheckpointStore(tmp_path / "resumed")
    straight = store.write(9, groups, meta, log_seq=40)
    resumed = elsewhere.write(9, groups, meta, log_seq=44)
    assert resumed == straight
    assert read(elsewhere, resumed.name, MANIFEST) == read(store, straight.name, MANIFEST)
    manifest = store.load_manifest(straight.name)
    assert manifest.format_version == checkpoints.FORMAT_VERSION and manifest.meta == meta
    assert json.loads(read(store, straight.name, WRITTEN)) == {"log_seq": 40}
    assert store.log_seq(straight.name, manifest) == 40
    assert elsewhere.log_seq(resumed.name, elsewhere.load_manifest(resumed.name)) == 44
    assert store.verify(straight.name, straight.files) == []
    # Without a log position (a fork's copy): no WRITTEN, and nothing dates the checkpoint.
    copied = CheckpointStore(tmp_path / "copy").write(9, groups, meta)
    assert copied == straight and CheckpointStore(tmp_path / "copy").log_seq(copied.name, manifest) is None


def test_format_1_keeps_the_log_position_in_its_manifest_and_so_in_its_name(tmp_path):
    """What runs started before "content_named_checkpoints" write, for life: as they always did."""
    store = CheckpointStore(tmp_path)
    first = store.write(9, sample_groups(), {"reference": ""}, log_seq=40, format_version=FORMAT_WITH_LOG_SEQ)
    later = store.write(9, sample_groups(), {"reference": ""}, log_seq=44, format_version=FORMAT_WITH_LOG_SEQ)
    assert first.name != later.name
    manifest = store.load_manifest(first.name)
    assert manifest.format_version == FORMAT_WITH_LOG_SEQ and manifest.meta == {
        "reference": "",
        "log_seq": 40,
    }
    assert store.log_seq(first.name, manifest) == 40
    assert not store._fs.exists(f"{store.root}/{first.name}/{WRITTEN}")


@pytest.mark.parametrize(
    "content", [b"", b"{not json", b'{"log_seq": "40"}', b'{"log_seq": -7}', b"x" * 5000]
)
def test_a_damaged_log_position_dates_nothing_and_is_not_damage_to_the_checkpoint(tmp_path, content):
    store = CheckpointStore(tmp_path)
    written = store.write(3, sample_groups(), log_seq=12)
    path = tmp_path / "checkpoints" / written.name / WRITTEN
    path.write_bytes(content)
    assert store.log_seq(written.name, store.load_manifest(written.name)) is None
    assert store.verify(written.name, written.files) == []
    path.unlink()
    assert store.log_seq(written.name, store.load_manifest(written.name)) is None


def test_a_format_this_rewind_does_not_write_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="format 3"):
        CheckpointStore(tmp_path).write(1, sample_groups(), format_version=3)
    assert CheckpointStore(tmp_path).names_on_disk() == []


def test_writing_the_same_checkpoint_twice_keeps_one_copy(run_dir):
    store = CheckpointStore(run_dir)
    first = store.write(3, sample_groups())
    assert store.write(3, sample_groups()) == first
    assert store.names_on_disk() == [first.name]
    assert store.verify(first.name, first.files) == []


def test_a_damaged_copy_under_the_same_name_is_replaced(run_dir):
    store = CheckpointStore(run_dir)
    written = store.write(3, sample_groups())
    store._fs.pipe_file(f"{store.root}/{written.name}/model.safetensors", b"garbage")
    assert store.write(3, sample_groups()) == written
    assert store.verify(written.name, written.files) == []


def test_a_flipped_byte_is_caught_with_the_checkpoint_and_file_named(run_dir):
    store = CheckpointStore(run_dir)
    written = store.write(5, sample_groups())
    path = f"{store.root}/{written.name}/optimizer.safetensors"
    data = bytearray(store._fs.cat_file(path))
    data[-1] ^= 0x01
    store._fs.pipe_file(path, bytes(data))
    with pytest.raises(CheckpointCorrupt, match=rf"{written.name}.*optimizer\.safetensors") as caught:
        store.load(written.name, written.files)
    assert (caught.value.checkpoint, caught.value.file) == (written.name, "optimizer.safetensors")
    # Groups that are intact still load, and verify names exactly the one damaged file.
    assert "model" in store.load(written.name, groups=["model"])
    problems = store.verify(written.name, written.files)
    assert len(problems) == 1 and "optimizer.safetensors" in problems[0] and "sha256" in problems[0]


def test_the_logged_hashes_are_checked_too(run_dir):
    store = CheckpointStore(run_dir)
    written = store.write(5, {"model": {"w": torch.ones(2)}, "optimizer": {"s": torch.zeros(1)}})
    wrong = {**written.files, "model.safetensors": "0" * 64}
    with pytest.raises(CheckpointCorrupt, match=r"model\.safetensors.*logged"):
        store.load(written.name, wrong)
    with pytest.raises(CheckpointCorrupt, match=r"adapters\.safetensors: logged but not in the manifest"):
        store.load(written.name, {**written.files, "adapters.safetensors": "0" * 64})
    with pytest.raises(CheckpointCorrupt, match=r"optimizer\.safetensors.*not named by the log"):
        store.load(written.name, {"model.safetensors": written.files["model.safetensors"]})
    assert len(store.verify(written.name, wrong)) == 1
    assert store.verify(written.name, written.files) == []


def test_an_edited_manifest_no_longer_matches_the_name(run_dir):
    store = CheckpointStore(run_dir)
    written = store.write(5, {"model": {"w": torch.ones(2)}}, {"lr": 0.1})
    path = f"{store.root}/{written.name}/{MANIFEST}"
    store._fs.pipe_file(path, store._fs.cat_file(path).replace(b"0.1", b"0.2"))
    with pytest.raises(CheckpointCorrupt, match=rf"{written.name}.*{MANIFEST}.*does not match the name"):
        store.load_manifest(written.name)
    assert len(store.verify(written.name)) == 1


def test_missing_checkpoints_and_files_are_reported(run_dir):
    store = CheckpointStore(run_dir)
    with pytest.raises(CheckpointNotFound, match="00000001-deadbeef"):
        store.load("00000001-deadbeef")
    problems = store.verify("00000001-deadbeef")
    assert len(problems) == 1 and "00000001-deadbeef not found" in problems[0]
    written = store.write(2, {"model": {"w": torch.ones(2)}, "reference": {"w": torch.ones(2)}})
    store._fs.rm_file(f"{store.root}/{written.name}/reference.safetensors")
    with pytest.raises(CheckpointCorrupt, match=r"reference\.safetensors: missing"):
        store.load(written.name)
    assert store.verify(written.name) == [
        f"checkpoint {written.name} is corrupt: reference.safetensors: missing"
    ]
    with pytest.raises(CheckpointError, match="no 'adapters' group"):
        store.load(written.name, groups=["adapters"])


@pytest.mark.parametrize("name", ["../escape", "/etc", "00000001-DEADBEEF", "1-deadbeef", ""])
def test_only_checkpoint_shaped_names_reach_the_filesystem(tmp_path, name):
    store = CheckpointStore(tmp_path)
    with pytest.raises(CheckpointError, match="not a checkpoint name"):
        store.load(name)
    with pytest.raises(CheckpointError, match="not a checkpoint name"):
        store.delete(name)
    assert store.verify(name) and "not a checkpoint name" in store.verify(name)[0]


@pytest.mark.parametrize(
    ("groups", "meta", "message"),
    [
        ({"weights": {"w": torch.ones(1)}}, {}, "groups must be some of"),
        ({}, {}, "groups must be some of"),
        ({"model": {"w": torch.ones(4, 2).t()}}, {}, "model/w is not contiguous"),
        ({"model": {"w": torch.ones(2, device="meta")}}, {}, "model/w must be a dense CPU tensor"),
        ({"model": {"w": torch.ones(2, dtype=torch.complex64)}}, {}, "model/w has dtype torch.complex64"),
        ({"model": {"w": [1.0]}}, {}, "model/w is a list, not a tensor"),
        ({"model": {"w": torch.ones(2)}}, {"lr": float("nan")}, "does not survive JSON"),
        ({"model": {"w": torch.ones(2)}}, {"by_index": {0: 1}}, "does not survive JSON"),
        ({"model": {"w": torch.ones(2)}}, {"t": torch.ones(1)}, "meta is not JSON"),
    ],
)
def test_bad_input_is_refused_before_anything_is_written(run_dir, groups, meta, message):
    store = CheckpointStore(run_dir)
    with pytest.raises(CheckpointError, match=message):
        store.write(1, groups, meta)
    assert store.names_on_disk() == []


def test_tensors_sharing_storage_are_refused(tmp_path):
    weight = torch.ones(3)
    store = CheckpointStore(tmp_path)
    with pytest.raises(CheckpointError, match="cannot save group model"):
        store.write(1, {"model": {"a": weight, "b": weight}})
    assert store.names_on_disk() == []  # the temporary directory was cleaned up, not left to orphans


def test_negative_step_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="non-negative"):
        CheckpointStore(tmp_path).write(-1, {"model": {"w": torch.ones(1)}})


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names synced fds through /proc")
def test_local_write_syncs_every_file_then_renames_then_syncs_the_directory(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path / "run")
    calls: list[tuple[str, str]] = []
    real_sync, real_rename = fsio.sync_fd, os.rename

    def sync_fd(fd):
        calls.append(("sync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        real_sync(fd)

    def rename(src, dst):
        calls.append(("rename", os.path.basename(dst)))
        real_rename(src, dst)

    monkeypatch.setattr(fsio, "sync_fd", sync_fd)  # (checkpoint files are written by fsio.write_new_file)
    monkeypatch.setattr(checkpoints, "fsync_dir", lambda path: calls.append(("dir", os.path.basename(path))))
    monkeypatch.setattr(checkpoints.os, "rename", rename)
    written = store.write(7, {"model": {"w": torch.ones(2)}, "optimizer": {"m": torch.zeros(2)}}, log_seq=3)
    monkeypatch.undo()
    assert calls[:3] == [("dir", "run"), ("sync", "model.safetensors"), ("sync", "optimizer.safetensors")]
    assert calls[3:5] == [("sync", WRITTEN), ("sync", MANIFEST)]
    assert calls[5][0] == "dir" and calls[5][1].startswith(".tmp-00000007-")
    assert calls[6:] == [("rename", written.name), ("dir", "checkpoints")]


def test_a_crash_before_the_rename_leaves_only_an_orphan(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path)
    kept = store.write(1, {"model": {"w": torch.ones(2)}})
    uncommitted = store.write(2, {"model": {"w": torch.full((2,), 2.0)}})

    def die(src, dst):
        raise KeyboardInterrupt  # the process is killed between the last fsync and the rename

    monkeypatch.setattr(checkpoints.os, "rename", die)
    with pytest.raises(KeyboardInterrupt):
        store.write(3, {"model": {"w": torch.full((2,), 3.0)}})
    monkeypatch.undo()
    orphans = store.orphans([kept.name])
    assert len(orphans) == 2 and orphans[0].startswith(".tmp-00000003-") and orphans[1] == uncommitted.name
    # The temporary goes; the complete checkpoint the log does not name is kept, out of the way.
    assert store.set_aside_orphans([kept.name]) == ([orphans[0]], [uncommitted.name])
    assert store.names_on_disk() == [kept.name]
    assert store.verify(kept.name, kept.files) == []
    aside = tmp_path / "checkpoints" / checkpoints.ORPHANED_DIR / uncommitted.name
    assert sorted(p.name for p in aside.iterdir()) == ["manifest.json", "model.safetensors"]
    # Set aside again under the same name (the step re-written, then orphaned again): both are kept.
    assert store.write(2, {"model": {"w": torch.full((2,), 2.0)}}).name == uncommitted.name
    assert store.set_aside_orphans([kept.name]) == ([], [uncommitted.name])
    assert aside.is_dir() and aside.with_name(f"{uncommitted.name}.1").is_dir()


def test_object_stores_get_the_manifest_last_and_an_incomplete_write_is_an_orphan(monkeypatch):
    root = f"/rewind-checkpoint-tests/{uuid.uuid4().hex}"
    store = CheckpointStore(f"memory://{root}/run")
    written_paths: list[str] = []
    real_pipe = store._fs.pipe_file
    monkeypatch.setattr(
        store._fs, "pipe_file", lambda path, data: (written_paths.append(path), real_pipe(path, data))
    )
    written = store.write(4, {"model": {"w": torch.ones(2)}, "optimizer": {"m": torch.zeros(2)}}, log_seq=9)
    assert [p.rsplit("/", 1)[-1] for p in written_paths] == [
        "model.safetensors",
        "optimizer.safetensors",
        WRITTEN,
        MANIFEST,
    ]
    assert all(f"/{written.name}/" in p for p in written_paths)  # straight under the final name

    store._fs.rm_file(f"{store.root}/{written.name}/{MANIFEST}")  # as if killed before the manifest
    with pytest.raises(CheckpointCorrupt, match=rf"{MANIFEST}: missing"):
        store.load(written.name)
    assert store.orphans([]) == [written.name]
    assert store.set_aside_orphans([]) == ([], [written.name])
    assert store.names_on_disk() == []
    assert store._fs.exists(f"{store.root}/{checkpoints.ORPHANED_DIR}/{written.name}/model.safetensors")
    store._fs.rm(root, recursive=True)


def test_delete_removes_and_tolerates_an_already_deleted_checkpoint(run_dir):
    store = CheckpointStore(run_dir)
    first = store.write(1, {"model": {"w": torch.ones(2)}})
    second = store.write(2, {"model": {"w": torch.zeros(2)}})
    store.delete(first.name)
    store.delete(first.name)
    assert store.names_on_disk() == [second.name]
    with pytest.raises(CheckpointNotFound):
        store.load(first.name)
    assert store.orphans([second.name]) == []


def test_loading_never_unpickles(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path)
    written = store.write(1, sample_groups())

    def forbidden(*args, **kwargs):
        raise AssertionError("unpickling is forbidden")

    monkeypatch.setattr(torch, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    assert_bit_identical(store.load(written.name, written.files)["model"], sample_groups()["model"])


def test_the_manifest_is_plain_json(tmp_path):
    store = CheckpointStore(tmp_path)
    written = store.write(1, {"model": {"w": torch.ones(2)}}, {"lr": 0.5})
    parsed = json.loads(read(store, written.name, MANIFEST))
    assert parsed["step"] == 1 and parsed["meta"] == {"lr": 0.5}
    assert parsed["files"][0]["tensors"][0] == {
        "name": "w",
        "dtype": "float32",
        "shape": [2],
        "sha256": sha256(torch.ones(2).numpy().tobytes()),
    }


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.float64, torch.uint8, torch.bool]
_memory_runs = itertools.count()


@st.composite
def tensor_dicts(draw):
    tensors = {}
    for index in range(draw(st.integers(1, 4))):
        dtype = draw(st.sampled_from(_DTYPES))
        shape = draw(st.lists(st.integers(0, 3), max_size=3))
        numel = 1
        for size in shape:
            numel *= size
        itemsize = torch.empty((), dtype=dtype).element_size()
        # Arbitrary bytes: NaN payloads, negative zeros, subnormals all have to survive.
        data = draw(st.binary(min_size=numel * itemsize, max_size=numel * itemsize))
        if dtype == torch.bool:
            data = bytes(b & 1 for b in data)  # other byte values are not valid bools
        tensor = torch.frombuffer(bytearray(data), dtype=dtype) if data else torch.empty(0, dtype=dtype)
        tensors[f"t{index}.{draw(st.text('abc._', max_size=4))}"] = tensor.reshape(shape).clone()
    return tensors


@settings(max_examples=40, deadline=None)
@given(tensors=tensor_dicts(), step=st.integers(0, 10**9))
def test_any_tensors_round_trip_bit_for_bit_under_a_deterministic_name(tensors, step):
    root = f"/rewind-checkpoint-tests/hypothesis-{next(_memory_runs)}-{uuid.uuid4().hex}"
    try:
        store = CheckpointStore(f"memory://{root}")
        written = store.write(step, {"model": tensors})
        assert written.name.startswith(f"{step:08d}-")
        assert_bit_identical(store.load(written.name, written.files)["model"], tensors)
        assert CheckpointStore(f"memory://{root}/other").write(step, {"model": tensors}) == written
    finally:
        fs = fsspec.filesystem("memory")
        if fs.exists(root):
            fs.rm(root, recursive=True)
