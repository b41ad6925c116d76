"""Token streams and validation carving (rewind.engine.data.tokens), the keyed permutation under them
(rewind.engine.data.permutation), and the epoch arithmetic of cursors (rewind.engine.data.cursors).

- RowSplit: exact counts, train and validation disjoint and together every row, "random" is not the
  tail, and the same number of rows is carved the same way every time (no run seed goes in);
- streams: a local file's windows are a plain np.memmap gather, an fsspec `memory://` file gives the
  same rows through ranged reads, and broken files are one line naming them;
- epochs: `on_epoch_end` "repeat" reads every epoch in the first one's order, "reshuffle" does not,
  and `epochs_started` names exactly the epochs a cursor move begins.
"""

from __future__ import annotations

import os
import uuid
from unittest import mock

import fsspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rewind.engine.data import cursors, permutation, tokens
from rewind.engine.data.cursors import epochs_started, sample_indices
from rewind.engine.data.permutation import permute, permute_int, round_keys
from rewind.engine.data.tokens import (
    SPLIT_SEED,
    LocalTokenStream,
    RemoteTokenStream,
    RowSplit,
    TokenFileError,
    open_stream,
)

# --- RowSplit ---------------------------------------------------------------------------------------


def carved(split: RowSplit) -> tuple[np.ndarray, np.ndarray]:
    """(train rows, validation rows) of the source, in split order."""
    train = split.rows("train", np.arange(split.count("train"), dtype=np.int64))
    validation = split.rows("validation", np.arange(split.count("validation"), dtype=np.int64))
    return train, validation


@settings(max_examples=150, deadline=None)
@given(
    num_rows=st.integers(1, 5000),
    fraction=st.floats(0.001, 0.999, allow_nan=False),
    mode=st.sampled_from(["tail", "random"]),
)
def test_a_split_counts_exactly_and_partitions_the_rows(num_rows, fraction, mode):
    split = RowSplit(num_rows, mode, fraction)
    want_validation = int(num_rows * fraction)
    assert split.count("validation") == split.num_validation == want_validation
    assert split.count("train") == split.num_train == num_rows - want_validation
    train, validation = carved(split)
    assert train.dtype == validation.dtype == np.int64
    assert len(set(train.tolist())) == len(train) and len(set(validation.tolist())) == len(validation)
    assert not set(train.tolist()) & set(validation.tolist())
    assert sorted([*train.tolist(), *validation.tolist()]) == list(range(num_rows))
    if mode == "tail":
        assert validation.tolist() == list(range(num_rows - want_validation, num_rows))


@settings(max_examples=40, deadline=None)
@given(num_rows=st.integers(2, 3000), fraction=st.floats(0.01, 0.99))
def test_the_same_rows_are_carved_the_same_way_every_time(num_rows, fraction):
    first = carved(RowSplit(num_rows, "random", fraction))
    permutation.round_keys.cache_clear()  # recomputed from the fixed key, not remembered
    again = carved(RowSplit(num_rows, "random", fraction))
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    # The key is the module's constant, never a run's seed: the keys are those of SPLIT_SEED.
    assert RowSplit(num_rows, "random", fraction)._keys == round_keys(SPLIT_SEED, "validation rows", num_rows)


@pytest.mark.parametrize("num_rows, fraction", [(20, 0.1), (100, 0.05), (1000, 0.3), (4097, 0.01)])
def test_random_validation_rows_are_not_the_tail(num_rows, fraction):
    _, random_rows = carved(RowSplit(num_rows, "random", fraction))
    _, tail_rows = carved(RowSplit(num_rows, "tail", fraction))
    assert len(random_rows) == len(tail_rows) >= 2
    assert set(random_rows.tolist()) != set(tail_rows.tolist())
    # Spread through the file, not bunched at one end: some validation row lies in each half.
    assert (random_rows < num_rows // 2).any() and (random_rows >= num_rows // 2).any()


def test_a_validation_file_gives_every_row_of_each_source():
    split = RowSplit(7, "file", 0.5, num_validation_rows=3)
    assert (split.count("train"), split.count("validation")) == (7, 3)
    assert split.rows("train", np.arange(7)).tolist() == list(range(7))
    assert split.rows("validation", np.arange(3)).tolist() == [0, 1, 2]


@settings(max_examples=60, deadline=None)
@given(num_samples=st.integers(2, 3000), seed=st.integers(0, 2**32))
def test_the_permutation_is_a_bijection_and_both_paths_agree(num_samples, seed):
    keys = round_keys(seed, "test", num_samples)
    image = permute(np.arange(num_samples, dtype=np.int64), num_samples, keys)
    assert sorted(image.tolist()) == list(range(num_samples))
    for position in (0, num_samples // 2, num_samples - 1):
        assert permute_int(position, num_samples, keys) == image[position]


# --- token streams ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_local_windows_are_a_plain_memmap_gather(tmp_path, dtype):
    values = np.random.default_rng(7).integers(0, 60000, size=5 * 17 * 11 + 9).astype(dtype)
    path = tmp_path / "tokens.bin"
    values.tofile(path)
    stream = open_stream(str(path), dtype)
    assert isinstance(stream, LocalTokenStream) and stream.num_tokens == len(values)
    width = 17
    rows = np.array([54, 0, 3, 3, 20, 1])
    bare = np.memmap(path, dtype=dtype, mode="r")
    expected = np.stack([np.asarray(bare[r * width : (r + 1) * width], dtype=np.int64) for r in rows])
    got = stream.windows(rows, width)
    assert got.dtype == np.int64 and np.array_equal(got, expected)
    assert stream.max_token() == int(values.max())
    # The trailing partial window is never served: 5 * 11 = 55 whole windows, the last is row 54.
    assert stream.num_tokens // width == 55


@pytest.fixture
def memory_file():
    fs = fsspec.filesystem("memory")
    path = f"/rewind-test-{uuid.uuid4().hex}/tokens.bin"
    yield fs, path
    fs.rm(path.rsplit("/", 1)[0], recursive=True)


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_a_remote_stream_gives_the_same_rows_as_a_local_one(tmp_path, memory_file, dtype):
    fs, path = memory_file
    values = np.random.default_rng(3).integers(0, 1000, size=17 * 40 + 5).astype(dtype)
    fs.pipe(path, values.tobytes())
    values.tofile(tmp_path / "tokens.bin")
    remote = open_stream(f"memory://{path}", dtype)
    local = open_stream(str(tmp_path / "tokens.bin"), dtype)
    assert isinstance(remote, RemoteTokenStream) and remote.num_tokens == local.num_tokens
    rows = np.array([39, 0, 5, 5, 12])
    assert np.array_equal(remote.windows(rows, 17), local.windows(rows, 17))
    assert remote.max_token() == local.max_token() == int(values.max())


def test_broken_token_files_are_one_line_naming_the_file(tmp_path, memory_file):
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x02\x03")
    with pytest.raises(TokenFileError, match=r"odd\.bin: size 3 bytes is not a multiple of 2 \(uint16\)"):
        open_stream(str(odd), "uint16")
    with pytest.raises(TokenFileError, match=r"missing\.bin: file not found"):
        open_stream(str(tmp_path / "missing.bin"), "uint16")
    with pytest.raises(TokenFileError, match="is a directory"):
        open_stream(str(tmp_path), "uint16")
    fs, path = memory_file
    with pytest.raises(TokenFileError, match="file not found"):
        open_stream(f"memory://{path}", "uint16")
    fs.pipe(path, b"\x00" * 6)
    with pytest.raises(TokenFileError, match="not a multiple of 4"):
        open_stream(f"memory://{path}", "uint32")
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    assert open_stream(str(empty), "uint16").num_tokens == 0  # "too small" is the dataset's to say


# --- epochs -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_samples", [2, 9, 100])
def test_repeat_reads_every_epoch_in_the_first_ones_order_and_reshuffle_does_not(num_samples):
    for count in (num_samples, 3 * num_samples):  # the scalar path (<= 64) and the vector path
        repeat = sample_indices(5, "corpus", num_samples, 0, count, reshuffle=False)
        assert np.array_equal(repeat, np.tile(repeat[:num_samples], count // num_samples))
    epochs = sample_indices(5, "corpus", 100, 0, 300, reshuffle=True).reshape(3, 100)
    assert all(sorted(e.tolist()) == list(range(100)) for e in epochs)  # each epoch reads every row once
    assert not np.array_equal(epochs[0], epochs[1]) and not np.array_equal(epochs[1], epochs[2])
    # Epoch 0 is the same either way: the policy only decides what comes after it.
    assert np.array_equal(epochs[0], sample_indices(5, "corpus", 100, 0, 100, reshuffle=False))


def defined_row(seed: int, name: str, num_samples: int, position: int, reshuffle: bool) -> int:
    """The row a cursor position reads, by the definition in rewind.engine.data.cursors' docstring."""
    epoch, within = divmod(position, num_samples)
    return permute_int(within, num_samples, round_keys(seed, "shuffle", name, epoch if reshuffle else 0))


@settings(max_examples=50, deadline=None)
@given(
    num_samples=st.integers(2, 50),
    start=st.integers(0, 300),
    count=st.integers(0, 140),
    reshuffle=st.booleans(),
    cached=st.booleans(),
)
def test_a_draw_reads_the_rows_the_definition_names(num_samples, start, count, reshuffle, cached):
    # Both ways of computing it: each epoch's order as a cached array, and the per-position walk.
    with mock.patch.object(cursors, "CACHED_ORDER_MAX_SAMPLES", 1 << 18 if cached else 0):
        whole = sample_indices(1, "d", num_samples, start, count, reshuffle=reshuffle)
    want = [defined_row(1, "d", num_samples, p, reshuffle) for p in range(start, start + count)]
    assert whole.tolist() == want


@settings(max_examples=40, deadline=None)
@given(num_rows=st.integers(2, 2000), fraction=st.floats(0.01, 0.99), cached=st.booleans())
def test_random_carving_is_the_keyed_permutation_either_way(num_rows, fraction, cached):
    with mock.patch.object(tokens, "CACHED_ORDER_MAX_ROWS", 1 << 18 if cached else 0):
        split = RowSplit(num_rows, "random", fraction)
        train, validation = carved(split)
    keys = round_keys(SPLIT_SEED, "validation rows", num_rows)
    # Validation row i is pi(i), train row j is pi(num_validation + j).
    assert validation.tolist() == [permute_int(i, num_rows, keys) for i in range(split.num_validation)]
    assert train.tolist() == [
        permute_int(split.num_validation + j, num_rows, keys) for j in range(split.num_train)
    ]


class _Sized:
    def __init__(self, n: int):
        self.n = n

    def num_samples(self, split: str) -> int:
        assert split == "train"
        return self.n


@pytest.mark.parametrize(
    "before, after, n, want",
    [
        ({}, {"a": 4}, 9, []),  # positions 0..3: still epoch 0
        ({"a": 8}, {"a": 12}, 9, [("a", 1)]),  # position 9 is read
        ({"a": 9}, {"a": 13}, 9, [("a", 1)]),  # the step before read all 9: this one begins epoch 1
        ({"a": 10}, {"a": 14}, 9, []),  # epoch 1 began with the step before
        ({"a": 5}, {"a": 9}, 9, []),  # positions 5..8: epoch 1 begins with the next position
        ({"a": 2}, {"a": 12}, 3, [("a", 1), ("a", 2), ("a", 3)]),  # a split smaller than the batch
        ({"a": 0, "b": 7}, {"a": 3, "b": 8}, 4, []),  # position 7 is the last of epoch 1
        ({"b": 7}, {"a": 5, "b": 9}, 4, [("a", 1), ("b", 2)]),  # a dataset first read this step
    ],
)
def test_epochs_started_names_the_epochs_a_step_begins(before, after, n, want):
    datasets = {"a": _Sized(n), "b": _Sized(n)}
    got = epochs_started(before, after, datasets)
    assert got == want
    # The same answer as reading the positions one by one.
    slow = []
    for name in sorted(after):
        for position in range(before.get(name, 0), after[name]):
            if position and position % n == 0:
                slow.append((name, position // n))
    assert got == slow


# --- a file that changes under its reader --------------------------------------------------------------


def _opened(tmp_path, num_tokens: int = 17 * 40) -> tuple[tokens.LocalTokenStream, object]:
    path = tmp_path / "tokens.bin"
    np.arange(num_tokens, dtype=np.uint16).tofile(path)
    return open_stream(str(path), "uint16"), path


def _rewrite_in_place(path, keep_times: bool) -> None:
    info = os.stat(path)
    with open(path, "r+b") as handle:  # the same inode, the same size, other tokens
        handle.write(np.full(8, 7, dtype=np.uint16).tobytes())
    if keep_times:
        os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns))


@pytest.mark.parametrize("keep_times", [False, True], ids=["rewritten", "rewritten-times-restored"])
def test_a_token_file_rewritten_in_place_is_a_change(tmp_path, keep_times):
    stream, path = _opened(tmp_path)
    assert stream.change() == ""
    _rewrite_in_place(path, keep_times)
    assert str(path) in stream.change() and "changed since the run opened it" in stream.change()


def test_a_token_file_replaced_or_removed_is_a_change(tmp_path):
    stream, path = _opened(tmp_path)
    replacement = tmp_path / "new.bin"
    np.arange(17 * 40, dtype=np.uint16).tofile(replacement)  # the same bytes, another file
    os.replace(replacement, path)
    assert "changed since the run opened it" in stream.change()
    os.unlink(path)
    assert "No such file" in stream.change()


def test_a_large_token_file_edited_between_the_sampled_blocks_is_seen_by_its_times(tmp_path):
    from rewind.stores.datafiles import FINGERPRINT_BLOCK, NUM_FINGERPRINT_BLOCKS

    num_tokens = 4 * NUM_FINGERPRINT_BLOCKS * FINGERPRINT_BLOCK // 2  # 4x what the fingerprint samples
    stream, path = _opened(tmp_path, num_tokens)
    with open(path, "r+b") as handle:
        handle.seek(FINGERPRINT_BLOCK + 100)  # between the first two sampled blocks
        handle.write(b"\xff\xff")
    assert "changed since the run opened it" in stream.change()


@pytest.mark.parametrize("cut_to", [0, 17 * 2 * 10 + 1])
def test_a_token_file_cut_short_under_its_reader_is_one_error_naming_it_not_a_sigbus(tmp_path, cut_to):
    stream, path = _opened(tmp_path)
    assert stream.windows(np.array([39]), 17).shape == (1, 17)  # mapped, pages read
    os.truncate(path, cut_to)
    with pytest.raises(TokenFileError, match=rf"tokens\.bin: cut to {cut_to:,} bytes while the run read it"):
        stream.windows(np.array([39]), 17)  # its page is past the end: read through the map, a SIGBUS
    with pytest.raises(TokenFileError, match="cut to"):
        stream.max_token()
    assert "changed since the run opened it" in stream.change()


def test_a_token_file_that_is_not_a_regular_file_is_refused_without_reading_it(tmp_path):
    fifo = tmp_path / "fifo.bin"
    os.mkfifo(fifo)
    with pytest.raises(TokenFileError, match=r"fifo\.bin: not a regular file"):
        open_stream(str(fifo), "uint16")  # (opening it for reading would wait for a writer forever)
    with pytest.raises(TokenFileError, match="not a regular file"):
        open_stream("/dev/zero", "uint16")


def test_a_remote_token_file_rewritten_or_cut_is_a_change_and_an_error(memory_file):
    fs, path = memory_file
    fs.pipe(path, np.arange(17 * 10, dtype=np.uint16).tobytes())
    stream = open_stream(f"memory://{path}", "uint16")
    assert stream.change() == ""
    fs.pipe(path, np.arange(17 * 2, dtype=np.uint16).tobytes())
    assert "changed since the run opened it" in stream.change()
    with pytest.raises(TokenFileError, match="could not be read whole"):
        stream.windows(np.array([9]), 17)
