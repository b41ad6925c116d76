"""`rewind bench cache`, the store half: an activation cache's write and read speed against np.memmap.

The baseline is the least a cache could cost: the same bytes in one raw file through `np.memmap`, no
checksums, no completion records, no durability beyond one flush at the end. Both sides do the same
work on the same float32 activations (256 MB, 16 MB with `quick`):

- write: make the store, write it chunk by chunk in order, and make it durable (the cache: chunk
  bytes synced in groups of `activations.GROUP_CHUNKS`, the syncs of a group issued together, one
  directory sync per group before its records, then the manifest; the memmap: one flush, which syncs
  the file). `write_ratio`.
- read: open the store and read every row in training-batch ranges, in order, each into a fresh
  tensor that is dropped before the next read, as training does (the memmap's rows are copied out,
  as the cache's are). `read_ratio`.

Both read from the page cache, just written: the ratio is the cache's own cost (checksums, copies,
Python), not the disk's. The writes are the disk's too: a few grouped syncs against one, so
`write_ratio` still moves with the sync latency of the disk under it (on a shared virtual disk, from
run to run). Before grouping (a sync of each chunk and of its directory, through zarr's write path) it
was 0.2-0.5 on the machine these figures were first taken on. Ratios are cache / memmap throughput,
goal >= 0.5. Best of `repeats`, the two sides interleaved.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from rewind.stores import activations
from rewind.stores.activations import ActivationCache, CacheSpec
from rewind.tools.bench.log import best_times

SEQ_LEN = 128
WIDTH = 256
BATCH_ROWS = 8  # a training batch
ROWS_PER_CHUNK = BATCH_ROWS  # one chunk per step, as the engine lays caches out (1 MiB chunks here)


def _bench_spec(quick: bool) -> CacheSpec:
    row_bytes = SEQ_LEN * WIDTH * 4
    num_rows = (16 << 20 if quick else 256 << 20) // row_bytes
    return CacheSpec(num_rows, SEQ_LEN, WIDTH, "float32", ROWS_PER_CHUNK)


def _write_cache(url: str, spec: CacheSpec, values: torch.Tensor) -> None:
    cache = ActivationCache.create(url, spec)
    for chunk in range(cache.num_chunks):
        start, stop = cache.chunk_rows(chunk)
        cache.write_chunk(chunk, values[start:stop])
    cache.mark_complete()


def _write_memmap(path: str, spec: CacheSpec, values: np.ndarray) -> None:
    mapped = np.memmap(path, dtype=np.float32, mode="w+", shape=values.shape)
    for start in range(0, spec.num_rows, spec.rows_per_chunk):
        stop = min(start + spec.rows_per_chunk, spec.num_rows)
        mapped[start:stop] = values[start:stop]
    mapped.flush()
    del mapped


def _batches(spec: CacheSpec) -> list[tuple[int, int]]:
    return [(a, min(a + BATCH_ROWS, spec.num_rows)) for a in range(0, spec.num_rows, BATCH_ROWS)]


def _cache_reader(url: str, spec: CacheSpec) -> Iterator[torch.Tensor]:
    cache = ActivationCache.open(url)
    for start, stop in _batches(spec):
        yield cache.read_rows(start, stop)


def _memmap_reader(path: str, spec: CacheSpec) -> Iterator[torch.Tensor]:
    mapped = np.memmap(path, dtype=np.float32, mode="r", shape=(spec.num_rows, spec.seq_len, spec.width))
    for start, stop in _batches(spec):
        yield torch.from_numpy(np.array(mapped[start:stop]))


def _consume(batches: Iterator[torch.Tensor]) -> None:
    """Each batch dropped before the next is read, as training does: keeping them all would time the
    allocator's page faults on hundreds of fresh megabytes, not the stores."""
    for _ in batches:
        pass


def _timed(work: Callable[[], Any]) -> Callable[[], float]:
    def run() -> float:
        start = time.perf_counter()
        work()
        return time.perf_counter() - start

    return run


def _fresh(path: str, work: Callable[[], Any]) -> Callable[[], Any]:
    """`work` on a store that does not exist yet: a write measures making it, never overwriting."""

    def run() -> Any:
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.unlink(path)
        return work()

    return run


def run_cache_bench(quick: bool = False, tmpdir: str | None = None, repeats: int | None = None) -> dict:
    """Measure an activation cache against np.memmap; `tmpdir` picks the filesystem."""
    spec = _bench_spec(quick)
    repeats = repeats or (3 if quick else 5)
    values = torch.randn(spec.num_rows, spec.seq_len, spec.width, generator=torch.Generator().manual_seed(0))
    array = values.numpy()
    megabytes = values.numel() * values.element_size() / 1e6
    with tempfile.TemporaryDirectory(dir=tmpdir, prefix="rewind-bench-cache-") as root:
        url, path = os.path.join(root, "cache.zarr"), os.path.join(root, "memmap.f32")
        writes = best_times(
            {
                "cache": _timed(_fresh(url, lambda: _write_cache(url, spec, values))),
                "memmap": _timed(_fresh(path, lambda: _write_memmap(path, spec, array))),
            },
            repeats,
        )
        # Both sides must read the same rows back, and those must be what was written.
        for side in (_cache_reader(url, spec), _memmap_reader(path, spec)):
            if not torch.equal(torch.cat(list(side)), values):
                raise RuntimeError("bench: a store did not read back what was written")
        stored_bytes = ActivationCache.open(url).num_bytes()
        reads = best_times(
            {
                "cache": _timed(lambda: _consume(_cache_reader(url, spec))),
                "memmap": _timed(lambda: _consume(_memmap_reader(path, spec))),
            },
            repeats * 2,
        )
    figures: dict[str, Any] = {
        "cache_rows": spec.num_rows,
        "cache_megabytes": megabytes,
        "cache_rows_per_chunk": spec.rows_per_chunk,
        "cache_batch_rows": BATCH_ROWS,
        "cache_sync_group_chunks": activations.GROUP_CHUNKS,
        "cache_stored_overhead": stored_bytes / (megabytes * 1e6) - 1,
    }
    for kind, times in (("write", writes), ("read", reads)):
        figures[f"cache_{kind}_MBps"] = megabytes / times["cache"]
        figures[f"memmap_{kind}_MBps"] = megabytes / times["memmap"]
        figures[f"{kind}_ratio"] = times["memmap"] / times["cache"]
    figures["goal_ratio"] = ">= 0.5"
    return figures
