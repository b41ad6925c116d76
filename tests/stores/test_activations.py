"""Activation caches: bitwise round trips, what a killed writer leaves, damage caught, bad input refused."""

from __future__ import annotations

import errno
import itertools
import os
import sys
import uuid

import fsspec
import numpy as np
import pytest
import torch
import zarr
from hypothesis import given, settings
from hypothesis import strategies as st

from rewind.stores import activations, cachefiles
from rewind.stores.activations import (
    ActivationCache,
    CacheError,
    CacheIncomplete,
    CacheSpec,
    cache_status,
)
from rewind.stores.fsio import filesystem

# Bit patterns a float round trip could lose: NaN payloads (quiet and signalling, both signs), -0.0,
# subnormals, infinities.
BF16_PATTERNS = [0x7FC1, 0xFFC0, 0x7F81, 0xFF81, 0x8000, 0x0000, 0x0001, 0x807F, 0x7F80, 0xFF80, 0x3F80]
F32_PATTERNS = [0x7FC00001, 0xFFC00000, 0x7F800001, 0xFF800123, 0x80000000, 0x00000001, 0x807FFFFF, 0x7F800000]
_memory_runs = itertools.count()


def source(spec: CacheSpec, seed: int = 0) -> torch.Tensor:
    """Random values of the spec's shape and dtype, with every special bit pattern in the first rows."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(spec.num_rows, spec.seq_len, spec.width, generator=generator)
    if spec.dtype == "bfloat16":
        values, patterns = values.to(torch.bfloat16), np.array(BF16_PATTERNS, dtype=np.uint16).view(np.int16)
    else:
        patterns = np.array(F32_PATTERNS, dtype=np.uint32).view(np.int32)
    flat = values.view(torch.int16 if spec.dtype == "bfloat16" else torch.int32).view(-1)
    count = min(len(patterns), flat.numel())
    flat[:count] = torch.from_numpy(patterns[:count])
    return values


def assert_bitwise(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    bits = torch.int16 if got.dtype == torch.bfloat16 else torch.int32
    assert torch.equal(got.view(bits), expected.view(bits))


def write_all(cache: ActivationCache, values: torch.Tensor, chunks=None, flush: bool = True) -> None:
    """Write these chunks (all by default), then flush their records unless told not to."""
    for k in range(cache.num_chunks) if chunks is None else chunks:
        start, stop = cache.chunk_rows(k)
        cache.write_chunk(k, values[start:stop])
    if flush:
        cache.flush()


@pytest.fixture
def url(run_url, no_syncs) -> str:
    return f"{run_url}/cache/trunk-3.zarr"


SPEC = CacheSpec(num_rows=10, seq_len=3, width=5, dtype="bfloat16", rows_per_chunk=4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_bit_pattern_round_trips(url, dtype):
    spec = CacheSpec(num_rows=11, seq_len=2, width=6, dtype=dtype, rows_per_chunk=4)
    values = source(spec)
    cache = ActivationCache.create(url, spec)
    assert (cache.num_chunks, [cache.chunk_rows(k) for k in range(3)]) == (3, [(0, 4), (4, 8), (8, 11)])
    write_all(cache, values)
    cache.mark_complete()
    reopened = ActivationCache.open(url)
    assert reopened.spec == spec and reopened.is_complete() and cache_status(url) == "complete"
    assert_bitwise(reopened.read_rows(0, 11), values)
    for start, stop in [(0, 1), (3, 9), (8, 11), (10, 11), (5, 5)]:
        assert_bitwise(reopened.read_rows(start, stop), values[start:stop])
    assert reopened.num_bytes() > values.numel() * values.element_size()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_zarr_itself_reads_the_cache_and_its_checksum_agrees(url, dtype):
    # Chunks are written directly, not through zarr: they must be the bytes zarr would have written
    # (the last chunk, rows 8-9 of 4-row chunks, padded to full size), crc32c trailer included.
    spec = CacheSpec(**{**SPEC.__dict__, "dtype": dtype})
    values = source(spec)
    cache = ActivationCache.create(url, spec)
    write_all(cache, values, chunks=[2, 0, 1])
    cache.mark_complete()
    stored = zarr.open_array(cachefiles.zarr_store(filesystem(url)), mode="r")
    assert stored.metadata.zarr_format == 3
    assert stored.dtype == np.dtype("uint16" if dtype == "bfloat16" else "float32")
    bits = torch.uint16 if dtype == "bfloat16" else torch.int32
    expected = values.view(bits).numpy()
    assert np.array_equal(stored[:].view(expected.dtype), expected)
    for k in range(3):  # zarr's own chunk encoding, byte for byte
        chunk_values = np.zeros((4, 3, 5), dtype=stored.dtype)
        chunk_values[: min(4, 10 - 4 * k)] = stored[4 * k : 4 * k + 4]
        written = zarr.create_array(
            zarr.storage.MemoryStore(),
            shape=(4, 3, 5),
            chunks=(4, 3, 5),
            dtype=stored.dtype,
            filters=None,
            serializer=stored.serializer,
            compressors=stored.compressors,
            fill_value=0,
            chunk_key_encoding={"name": "default", "separator": "."},
            zarr_format=3,
            config={"write_empty_chunks": True},
        )
        written[:] = chunk_values
        zarr_bytes = written.store._store_dict["c.0.0.0"].to_bytes()
        assert chunk_file(url, k).read_bytes() == zarr_bytes, k
    flip_a_byte(url, 1)
    with pytest.raises(ValueError, match="checksum"):  # zarr's own crc32c codec sees what we see
        stored[4:8]


def test_a_killed_writer_leaves_exactly_the_missing_chunks(url):
    values = source(SPEC)
    cache = ActivationCache.create(url, SPEC)
    write_all(cache, values, chunks=[2, 0])  # flushed
    write_all(cache, values, chunks=[1], flush=False)  # its record still queued
    del cache  # killed: no mark_complete, no flush
    resumed = ActivationCache.create(url, SPEC)
    assert resumed.missing_chunks() == [1] and not resumed.is_complete()
    assert cache_status(url) == "partial (2 of 3 chunks)"
    assert_bitwise(resumed.read_rows(0, 4), values[:4])
    assert_bitwise(resumed.read_rows(8, 10), values[8:])
    with pytest.raises(CacheIncomplete, match=r"rows \[3, 5\) need chunks .*\(1\)"):
        resumed.read_rows(3, 5)
    with pytest.raises(CacheError, match="cannot mark complete: 1 of 3 chunks"):
        resumed.mark_complete()
    write_all(resumed, values, chunks=[1])
    resumed.mark_complete()
    assert_bitwise(ActivationCache.open(url).read_rows(0, 10), values)


def test_a_kill_loses_at_most_the_queued_records(url, monkeypatch):
    monkeypatch.setattr(activations, "GROUP_CHUNKS", 2)
    spec = CacheSpec(num_rows=10, seq_len=3, width=5, dtype="float32", rows_per_chunk=2)
    values = source(spec)
    cache = ActivationCache.create(url, spec)
    write_all(cache, values, chunks=[4, 0, 3], flush=False)  # 4 and 0 make a group: flushed
    assert cache_status(url) == "partial (2 of 5 chunks)"
    other = ActivationCache.open(url)  # another process: 3's record is not written yet
    assert other.missing_chunks() == [1, 2, 3]
    with pytest.raises(CacheIncomplete, match=r"\(3\)"):
        other.read_rows(6, 8)
    del cache  # killed: chunk 3 is whole on disk, but nothing vouches for it
    assert chunk_file(url, 3).exists()
    resumed = ActivationCache.create(url, spec)
    assert resumed.missing_chunks() == [1, 2, 3] and not resumed.is_complete()
    write_all(resumed, values, chunks=resumed.missing_chunks(), flush=False)
    resumed.mark_complete()  # flushes what is queued first
    assert cache_status(url) == "complete"
    assert_bitwise(ActivationCache.open(url).read_rows(0, 10), values)


def test_the_writer_reads_and_counts_its_own_queued_chunks(url):
    values = source(SPEC)
    cache = ActivationCache.create(url, SPEC)
    write_all(cache, values, chunks=[1], flush=False)
    assert_bitwise(cache.read_rows(4, 8), values[4:8])  # vouched for (flushed) first
    assert ActivationCache.open(url).missing_chunks() == [0, 2]
    write_all(cache, values, chunks=[0, 2], flush=False)
    assert cache.missing_chunks() == []  # after writing its own records


def test_a_chunk_rewritten_before_its_group_is_flushed_gets_one_record_for_the_new_bytes(url):
    values = source(SPEC)
    cache = ActivationCache.create(url, SPEC)
    write_all(cache, values.neg(), chunks=[0, 1, 2], flush=False)
    write_all(cache, values, chunks=[1], flush=False)
    cache.mark_complete()
    reopened = ActivationCache.open(url)
    assert_bitwise(reopened.read_rows(0, 4), values.neg()[:4])
    assert_bitwise(reopened.read_rows(4, 8), values[4:8])
    assert sorted(filesystem(url).join("done").list_names()) == ["0.json", "1.json", "2.json"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="names synced files through /proc/self/fd")
def test_records_follow_one_directory_sync_after_their_chunks_syncs(tmp_path, monkeypatch):
    """The durability order, group by group: every chunk of a group synced, then the cache's directory
    synced once (the chunks' names), and only then their records written."""
    url = str(tmp_path / "t.zarr")
    monkeypatch.setattr(activations, "GROUP_CHUNKS", 2)
    values = source(SPEC)
    cache = ActivationCache.create(url, SPEC)
    trace = []
    synced = lambda fd: trace.append(("sync", os.readlink(f"/proc/self/fd/{fd}")))  # noqa: E731
    monkeypatch.setattr(activations.fsio, "sync_fd", synced)
    monkeypatch.setattr(activations.fsio, "fsync_dir", lambda path: trace.append(("dir", path)))
    write_records = activations.write_records
    monkeypatch.setattr(
        activations,
        "write_records",
        lambda where, records: (trace.append(("records", sorted(records))), write_records(where, records)),
    )
    write_all(cache, values, chunks=[2, 0], flush=False)  # a group: flushed
    write_all(cache, values, chunks=[1], flush=False)
    assert trace[-1][0] == "records"  # nothing for chunk 1 yet
    cache.mark_complete()
    root, done = os.path.realpath(url), os.path.realpath(url) + "/done"
    group = lambda *ks: {("sync", f"{root}/c.{k}.0.0") for k in ks}  # noqa: E731
    assert set(trace[:2]) == group(2, 0)  # the syncs went out together: in either order
    assert trace[2:4] == [("dir", root), ("records", [f"{done}/0.json", f"{done}/2.json"])]
    assert trace[4:7] == [("sync", f"{root}/c.1.0.0"), ("dir", root), ("records", [f"{done}/1.json"])]
    assert [kind for kind, _ in trace[7:]] == ["sync", "dir"]  # the manifest, written atomically
    assert trace[-1] == ("dir", root) and cache.is_complete()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts open files through /proc/self/fd")
def test_a_failed_sync_leaves_its_group_missing_and_no_file_open(tmp_path, monkeypatch):
    url = str(tmp_path / "t.zarr")
    values = source(SPEC)
    cache = ActivationCache.create(url, SPEC)
    open_before = len(os.listdir("/proc/self/fd"))
    write_all(cache, values, chunks=[0, 1], flush=False)
    assert len(os.listdir("/proc/self/fd")) == open_before + 2  # held for the group's sync

    def fails(fd):
        raise OSError(errno.EIO, "simulated I/O error")

    monkeypatch.setattr(activations.fsio, "sync_fd", fails)
    with pytest.raises(OSError, match="simulated I/O error"):
        cache.flush()
    assert len(os.listdir("/proc/self/fd")) == open_before
    monkeypatch.undo()
    assert ActivationCache.open(url).missing_chunks() == [0, 1, 2]
    assert cache.missing_chunks() == [0, 1, 2]  # nothing left queued to vouch for later


def test_a_write_that_fails_half_way_leaves_the_chunk_missing_and_nothing_beside_it(url, monkeypatch):
    values = source(SPEC)
    cache = ActivationCache.create(url, SPEC)
    write_all(cache, values)
    cache.mark_complete()

    def disk_full(fd, data):
        raise OSError(errno.ENOSPC, "simulated full disk")

    def put_fails(path, data):
        raise OSError(errno.ENOSPC, "simulated full disk")

    monkeypatch.setattr(activations.fsio, "write_all", disk_full)
    monkeypatch.setattr(cache.location.fs, "pipe_file", put_fails)  # an object store's put
    with pytest.raises(OSError, match="simulated full disk"):
        write_all(cache, values, chunks=[1])
    monkeypatch.undo()
    names = filesystem(url).list_names()
    assert not [n for n in names if n.endswith(".partial")]
    assert ActivationCache.open(url).missing_chunks() == [1] and not cache.is_complete()


def test_a_chunk_written_without_its_record_is_missing(url):
    values = source(SPEC)
    cache = ActivationCache.create(url, SPEC)
    write_all(cache, values)
    # Killed between the chunk's bytes and its record: the data is all there, the record is not.
    filesystem(url).join("done", "1.json").remove(missing_ok=False)
    reopened = ActivationCache.open(url)
    assert reopened.missing_chunks() == [1]
    with pytest.raises(CacheIncomplete):
        reopened.read_rows(0, 10)
    write_all(reopened, values, chunks=[1])
    reopened.mark_complete()
    assert_bitwise(reopened.read_rows(0, 10), values)


def test_a_garbled_record_counts_as_missing_and_a_garbled_array_starts_over(url):
    values = source(SPEC)
    write_all(ActivationCache.create(url, SPEC), values)
    filesystem(url).join("done", "2.json").write_atomic(b'{"chunk": 2, "start"')
    filesystem(url).join("done", "0.json").write_atomic(filesystem(url).join("done", "1.json").read_bytes())
    assert ActivationCache.open(url).missing_chunks() == [0, 2]  # chunk 1's record vouches for chunk 1 only
    filesystem(url).join("zarr.json").write_atomic(b"{not json")
    with pytest.raises(CacheError, match="not a readable zarr v3 array"):
        ActivationCache.open(url)
    assert cache_status(url).startswith("unreadable (not a readable zarr v3 array: ")
    assert ActivationCache.create(url, SPEC).missing_chunks() == [0, 1, 2]


def test_file_urls_and_plain_paths_are_the_same_cache(tmp_path, no_syncs):
    path = tmp_path / "cache" / "t.zarr"
    values = source(SPEC)
    write_all(ActivationCache.create(f"file://{path}", SPEC), values)
    assert_bitwise(ActivationCache.open(str(path)).read_rows(0, 10), values)


def test_create_resumes_the_same_spec_and_starts_a_different_one_over(url):
    values = source(SPEC)
    write_all(ActivationCache.create(url, SPEC), values, chunks=[0, 1])
    assert ActivationCache.create(url, SPEC).missing_chunks() == [2]
    # A chunk write killed half way (written beside the chunk, then renamed) is no foreign file.
    filesystem(url).join(f"c.2.0.{uuid.uuid4().hex}.partial").write_atomic(b"torn")
    other = CacheSpec(num_rows=10, seq_len=3, width=5, dtype="float32", rows_per_chunk=4)
    fresh = ActivationCache.create(url, other)
    assert fresh.spec == other and fresh.missing_chunks() == [0, 1, 2]
    assert ActivationCache.open(url).spec == other
    with pytest.raises(CacheIncomplete):
        fresh.read_rows(0, 1)


def test_a_reader_sees_chunks_written_since_it_opened(url):
    values = source(SPEC)
    writer = ActivationCache.create(url, SPEC)
    reader = ActivationCache.open(url)
    write_all(writer, values, chunks=[1])
    assert_bitwise(reader.read_rows(4, 8), values[4:8])


def test_rewriting_a_chunk_unmarks_the_cache_until_marked_again(url):
    values = source(SPEC)
    cache = ActivationCache.create(url, SPEC)
    write_all(cache, values)
    cache.mark_complete()
    write_all(cache, values, chunks=[2])
    assert not cache.is_complete() and cache_status(url) == "partial (3 of 3 chunks)"
    cache.mark_complete()
    assert cache.is_complete()


def chunk_file(url: str, chunk: int):
    return filesystem(url).join(f"c.{chunk}.0.0")


def flip_a_byte(url: str, chunk: int) -> None:
    where = chunk_file(url, chunk)
    data = bytearray(where.read_bytes())
    data[len(data) // 2] ^= 0x10
    where.write_atomic(data)


def truncate(url: str, chunk: int) -> None:
    where = chunk_file(url, chunk)
    where.write_atomic(where.read_bytes()[:-7])


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (flip_a_byte, "chunk 1 \\(rows 4-7\\) is damaged: its bytes fail their crc32c check"),
        (truncate, "chunk 1 \\(rows 4-7\\) is damaged: .* bytes where .* belong"),
        (lambda url, chunk: chunk_file(url, chunk).remove(), "chunk 1 \\(rows 4-7\\) is missing"),
    ],
)
def test_damaged_chunks_are_errors_naming_the_chunk_never_zeros(url, damage, message):
    values = source(SPEC)
    cache = ActivationCache.create(url, SPEC)
    write_all(cache, values)
    cache.mark_complete()
    damage(url, 1)
    reopened = ActivationCache.open(url)
    assert_bitwise(reopened.read_rows(0, 4), values[:4])  # the other chunks still read
    for start, stop in [(2, 6), (4, 8)]:  # part of the chunk, and the whole chunk read in place
        with pytest.raises(CacheError, match=message) as caught:
            reopened.read_rows(start, stop)
        assert "\n" not in str(caught.value)


def test_a_record_never_vouches_for_other_bytes(url):
    values = source(SPEC)
    cache = ActivationCache.create(url, SPEC)
    write_all(cache, values)
    # The chunk rewritten behind the record's back, with a valid crc32c of its own.
    stored = zarr.open_array(cachefiles.zarr_store(filesystem(url)), mode="r+")
    stored[4:8] = values[4:8].view(torch.uint16).numpy() ^ np.uint16(1)
    with pytest.raises(CacheError, match=r"chunk 1 .* holds other bytes than its completion record vouches for"):
        ActivationCache.open(url).read_rows(4, 8)


def test_an_all_zero_chunk_is_really_written(url):
    spec = CacheSpec(num_rows=6, seq_len=2, width=3, dtype="float32", rows_per_chunk=3)
    values = torch.zeros(6, 2, 3)
    cache = ActivationCache.create(url, spec)
    write_all(cache, values)
    assert chunk_file(url, 0).exists() and chunk_file(url, 1).exists()
    cache.mark_complete()
    assert_bitwise(ActivationCache.open(url).read_rows(0, 6), values)


def test_absent_foreign_and_deleted(url, tmp_path):
    assert cache_status(url) == "absent"
    with pytest.raises(CacheError, match="no activation cache there"):
        ActivationCache.open(url)
    cache = ActivationCache.create(url, SPEC)
    cache.delete()
    assert cache_status(url) == "absent" and not filesystem(url).exists()
    with pytest.raises(CacheError, match="was deleted"):
        cache.write_chunk(0, source(SPEC)[:4])
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    with pytest.raises(CacheError, match=r"holds files an activation cache does not \(keep.txt\)"):
        ActivationCache.create(str(foreign), SPEC)
    assert (foreign / "keep.txt").read_text() == "mine"
    zarr.create_array(str(tmp_path / "plain.zarr"), shape=(2,), dtype="float32")
    with pytest.raises(CacheError, match="not a rewind activation cache"):
        ActivationCache.open(str(tmp_path / "plain.zarr"))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda c: c.write_chunk(0, torch.zeros(4, 3, 5)), "values are torch.float32, this cache holds torch.bfloat16"),
        (lambda c: c.write_chunk(2, torch.zeros(4, 3, 5, dtype=torch.bfloat16)), r"shape \(4, 3, 5\), expected \(2, 3, 5\)"),
        (lambda c: c.write_chunk(0, np.zeros((4, 3, 5))), "must be a torch.Tensor"),
        (lambda c: c.write_chunk(3, torch.zeros(4, 3, 5, dtype=torch.bfloat16)), r"chunk 3 out of range: .* 3 chunks \(0..2\)"),
        (lambda c: c.write_chunk(-1, torch.zeros(4, 3, 5, dtype=torch.bfloat16)), "chunk -1 out of range"),
        (lambda c: c.chunk_rows(True), "chunk True out of range"),
        (lambda c: c.read_rows(-1, 2), r"start row -1 out of range: this cache holds rows \[0, 10\)"),
        (lambda c: c.read_rows(0, 11), r"stop row 11 out of range"),
        (lambda c: c.read_rows(5, 4), r"stop row 4 out of range: must be in \[start=5, 10\]"),
        (lambda c: c.read_rows(0.0, 4), "start row 0.0 out of range"),
    ],
)
def test_bad_input_is_a_clear_error(url, call, message):
    cache = ActivationCache.create(url, SPEC)
    with pytest.raises(CacheError, match=message):
        call(cache)
    assert cache.missing_chunks() == [0, 1, 2]  # nothing was written


@pytest.mark.parametrize(
    "fields",
    [
        {"num_rows": 0},
        {"seq_len": True},
        {"width": 2.0},
        {"rows_per_chunk": -1},
        {"dtype": "float16"},
    ],
)
def test_bad_specs_are_refused(fields):
    with pytest.raises(CacheError, match="cache spec: "):
        CacheSpec(**{**SPEC.__dict__, **fields})


@st.composite
def caches(draw):
    spec = CacheSpec(
        num_rows=draw(st.integers(1, 20)),
        seq_len=draw(st.integers(1, 3)),
        width=draw(st.integers(1, 4)),
        dtype=draw(st.sampled_from(["float32", "bfloat16"])),
        rows_per_chunk=draw(st.integers(1, 7)),
    )
    itemsize = 4 if spec.dtype == "float32" else 2
    numel = spec.num_rows * spec.seq_len * spec.width
    data = draw(st.binary(min_size=numel * itemsize, max_size=numel * itemsize))  # any bit pattern
    values = torch.frombuffer(bytearray(data), dtype=DTYPE_OF[spec.dtype]).reshape(
        spec.num_rows, spec.seq_len, spec.width
    )
    num_chunks = -(-spec.num_rows // spec.rows_per_chunk)
    order = draw(st.permutations(range(num_chunks)))
    ranges = draw(
        st.lists(
            st.tuples(st.integers(0, spec.num_rows), st.integers(0, spec.num_rows)).map(sorted),
            min_size=1,
            max_size=6,
        )
    )
    return spec, values, order, ranges


DTYPE_OF = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@settings(max_examples=40, deadline=None)
@given(case=caches())
def test_any_write_order_reads_back_any_range_bitwise(case):
    spec, values, order, ranges = case
    root = f"/rewind-cache-tests/hypothesis-{next(_memory_runs)}-{uuid.uuid4().hex}"
    try:
        cache = ActivationCache.create(f"memory://{root}/t.zarr", spec)
        write_all(cache, values, chunks=order)
        cache.mark_complete()
        for start, stop in ranges:
            assert_bitwise(cache.read_rows(start, stop), values[start:stop])
        reopened = ActivationCache.open(f"memory://{root}/t.zarr")
        assert_bitwise(reopened.read_rows(0, spec.num_rows), values)
    finally:
        fs = fsspec.filesystem("memory")
        if fs.exists(root):
            fs.rm(root, recursive=True)
