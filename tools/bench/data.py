"""`rewind bench data`: the data path against bare baselines measured in the same process.

(a) read_ratio: batches drawn through the engine (`open_user_dataset` on a token file, then
    `cursors.draw`: the shuffled cursor, the window gather, the int64 rows and the loss mask) against a
    bare `np.memmap` gather of the same windows from the same file (indices computed beforehand).
(b) prepare_ratio: `dataprep.prepare` (read the files, tokenise in batches, join with the separator,
    write and hash the token file, the manifest) against the tokenizer's own `encode_batch_fast` over
    the same documents already in memory, on the Python standard library's .py files with a BPE
    trained on them.
Ratios are baseline time / rewind time (1.0 = no overhead); each time is the best of several repeats.
"""

from __future__ import annotations

import glob
import os
import shutil
import sysconfig
import tempfile
import time
from collections.abc import Callable

import numpy as np

BLOCK_SIZE = 1024
BATCH_ROWS = 32
VOCAB_SIZE = 50_000  # ids drawn below it: a GPT-2-sized vocabulary in a uint16 file


def _best(*fns: Callable[[], object], repeats: int) -> list[float]:
    """The best time of each of `fns` over `repeats` rounds, run in turn within each round, so that a
    busy spell of a shared machine slows all of them rather than one."""
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            started = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - started)
    return best


def bench_read(num_tokens: int, num_batches: int, repeats: int, work_dir: str) -> dict:
    import torch

    from rewind.engine.data.cursors import draw, sample_indices
    from rewind.states.config import DataSource

    try:
        from rewind.engine.data.userdata import open_user_dataset
    except ImportError:  # before user datasets had a module of their own
        from rewind.engine.data.datasets import open_user_dataset  # type: ignore[attr-defined,no-redef]

    path = os.path.join(work_dir, "tokens.bin")
    rng = np.random.Generator(np.random.PCG64(0))  # synthetic content only: no run's randomness
    chunk = 1 << 22
    with open(path, "wb") as handle:
        for start in range(0, num_tokens, chunk):
            handle.write(rng.integers(0, VOCAB_SIZE, min(chunk, num_tokens - start), dtype=np.uint16).tobytes())
    source = DataSource(kind="tokens", path=path, dtype="uint16")
    started = time.perf_counter()
    dataset = open_user_dataset("bench", source, BLOCK_SIZE, VOCAB_SIZE)
    open_s = time.perf_counter() - started
    num_train = dataset.num_samples("train")
    seed, window = 1234, BLOCK_SIZE + 1
    starts = [b * BATCH_ROWS for b in range(num_batches)]

    def engine() -> None:
        for start in starts:
            draw(seed, dataset, "train", start, BATCH_ROWS)

    # The bare path is handed the file's window numbers (the cursor's shuffle and the train/validation
    # carving, computed beforehand): it gathers, converts to int64 and makes the tensors, nothing else.
    split = getattr(dataset, "rows", None)  # engine.tokens.RowSplit: train row -> window of the file

    def window_numbers() -> list[np.ndarray]:
        numbers = []
        for start in starts:
            rows = sample_indices(seed, "bench", num_train, start, BATCH_ROWS)
            numbers.append(split.rows("train", rows) if split is not None else rows)
        return numbers

    windows_read = window_numbers()
    memmap = np.memmap(path, dtype=np.uint16, mode="r")
    windows = memmap[: (len(memmap) // window) * window].reshape(-1, window)

    def bare() -> None:
        for rows in windows_read:
            tokens = torch.from_numpy(windows[rows].astype(np.int64))
            torch.ones((len(rows), BLOCK_SIZE), dtype=torch.bool)
            del tokens

    # Same windows, or the comparison means nothing.
    for start, rows in zip(starts, windows_read, strict=True):
        engine_tokens, _ = draw(seed, dataset, "train", start, BATCH_ROWS)
        if not np.array_equal(engine_tokens.numpy(), windows[rows].astype(np.int64)):
            raise RuntimeError("bench data: the bare gather does not read the engine's windows")
    engine(), bare()  # warm the page cache and the cursor's key cache alike
    engine_s, bare_s, index_s = _best(engine, bare, window_numbers, repeats=repeats)
    num_read = num_batches * BATCH_ROWS * window
    return {
        "read_file_tokens": num_tokens,
        "read_batches": f"{num_batches} x {BATCH_ROWS} rows of {window} tokens",
        "read_open_s": open_s,
        "read_engine_s": engine_s,
        "read_bare_s": bare_s,
        "read_index_s": index_s,  # of read_engine_s: which windows (the cursor's shuffle, the split's carving)
        "read_engine_tokens_per_s": num_read / engine_s,
        "read_bare_tokens_per_s": num_read / bare_s,
        "read_ratio": bare_s / engine_s,
    }


def stdlib_files(max_bytes: int) -> list[str]:
    """The standard library's .py files (top level first, then the packages), up to `max_bytes`."""
    root = sysconfig.get_paths()["stdlib"]
    paths = sorted(glob.glob(os.path.join(root, "*.py"))) + sorted(glob.glob(os.path.join(root, "*", "**", "*.py"),
                                                                             recursive=True))
    chosen, total = [], 0
    for path in paths:
        if "site-packages" in path or "test" in path.split(os.sep):
            continue
        try:
            with open(path, encoding="utf-8") as handle:
                handle.read()
        except (OSError, UnicodeDecodeError):
            continue  # a latin-1 test fixture: prepare would refuse it, rightly
        size = os.path.getsize(path)
        if total + size > max_bytes:
            break
        chosen.append(path)
        total += size
    return chosen


def bench_prepare(max_bytes: int, vocab_size: int, repeats: int, work_dir: str) -> dict:
    from rewind.engine.data.dataprep import prepare
    from rewind.engine.data.tokenizer import train_bpe

    paths = stdlib_files(max_bytes)
    documents = []
    for path in paths:
        with open(path, encoding="utf-8") as handle:
            documents.append(handle.read())
    started = time.perf_counter()
    tokenizer = train_bpe(documents, vocab_size)
    train_s = time.perf_counter() - started
    out_dir = os.path.join(work_dir, "prepared")

    def rewind_prepare() -> None:
        shutil.rmtree(out_dir, ignore_errors=True)
        prepare(paths, out_dir, tokenizer, kind="text")

    def own() -> None:
        encodings = tokenizer.inner.encode_batch_fast(documents, add_special_tokens=False)
        [encoding.ids for encoding in encodings]

    own(), rewind_prepare()  # warm the page cache and the tokenizer's thread pool alike
    num_tokens = sum(len(ids) for ids in tokenizer.encode_batch(documents))
    prepare_s, own_s = _best(rewind_prepare, own, repeats=repeats)
    return {
        "prepare_documents": len(documents),
        "prepare_bytes": sum(len(d.encode("utf-8")) for d in documents),
        "prepare_tokens": num_tokens,
        "prepare_vocab_size": tokenizer.vocab_size,
        "tokenizer_train_s": train_s,
        "prepare_s": prepare_s,
        "encode_batch_s": own_s,
        "prepare_tokens_per_s": num_tokens / prepare_s,
        "encode_batch_tokens_per_s": num_tokens / own_s,
        "prepare_ratio": own_s / prepare_s,
    }


def run_data_bench(quick: bool = False) -> dict:
    work_dir = tempfile.mkdtemp(prefix="rewind-bench-data-")
    try:
        read = bench_read(
            num_tokens=4_000_000 if quick else 50_000_000,
            num_batches=20 if quick else 200,
            repeats=3 if quick else 5,
            work_dir=work_dir,
        )
        prep = bench_prepare(
            max_bytes=1_000_000 if quick else 20_000_000,
            vocab_size=1024 if quick else 8192,
            repeats=2 if quick else 5,
            work_dir=work_dir,
        )
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    return {**read, **prep}
