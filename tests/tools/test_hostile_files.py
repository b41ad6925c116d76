"""Every reader of a file a user or a run directory supplies, fed hostile files: a FIFO, a link to
/dev/zero, a directory, a file past the reader's cap, JSON nested 1,000s deep, numbers past every
range, bytes that are not UTF-8, and garbage. Each reader either reads what is there (garbage that
happens to be acceptable) or raises its own one-line error, in a worker process with a deadline and a
memory limit (tests/stores/isolated.py: a reader that blocked or read without end would fail the test,
not hang it); then the commands that read them, each in a subprocess with a timeout: one line on stderr
starting "rewind: ", no traceback, a non-zero exit.

The in-process part is a hypothesis property over (reader, hostile file); the commands are a fixed set
(the whole cross product of commands and hostile files is marked slow)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from rewind.engine.data import documents, tokenizer
from rewind.engine.data.documents import DocumentError, iter_documents
from rewind.engine.data.tokenizer import TokenizerError, load_tokenizer, train_bpe
from rewind.engine.data.tokens import TokenFileError, open_stream
from rewind.engine.model import hf_llama, pretrained_files
from rewind.engine.model.pretrained import PretrainedError, expected_shapes, load_pretrained
from rewind.states.config import ArchitectureSection, Config, ConfigError, RunSection
from rewind.stores import cachefiles, datamanifest
from rewind.stores.activations import ActivationCache, CacheError, CacheSpec
from rewind.stores.datamanifest import ManifestError, check_prepared, read_manifest
from rewind.stores.preparedwriter import write_prepared
from rewind.tools import configfile
from rewind.tools.configfile import load_config
from rewind.tools.errors import UsageError
from rewind.tools.import_mapping import translate
from rewind.tools.import_yaml import Notes, YamlConfig, read_yaml
from tests.engine.test_tokenizer_guard import bomb
from tests.stores.isolated import Isolated

ARCH = ArchitectureSection(block_size=32, vocab_size=128, num_layers=1, num_heads=2, d_model=32, mlp="swiglu")
CONFIG = Config(run=RunSection(seed=1), architecture=ARCH)
SMALL_CAP = 4096  # the caps, made small in-process so that "past the cap" is cheap to write


# --- hostile files ------------------------------------------------------------------------------------


def deep_json(depth: int) -> bytes:
    return b'{"a": ' * depth + b"1" + b"}" * depth


def huge_numbers(digits: int) -> bytes:
    """A JSON object whose every field a reader looks at is a number past every range."""
    number = "9" * digits
    keys = ["format", "vocab_size", "rope_theta", "hidden_size", "zarr_format", "weight_map", "text", "version"]
    return ("{" + ", ".join(f'"{k}": {number}' for k in keys) + ', "x": 1e999}').encode()


def not_utf8(prefix: bytes) -> bytes:
    return b'{"text": "' + prefix + b'\xff\xfe", "format": 1}\n'


HOSTILE: dict[str, Callable[[st.DrawFn], Callable[[Path], None]]] = {}


def hostile(name: str):
    def register(make):
        HOSTILE[name] = make
        return make

    return register


@hostile("fifo")
def _fifo(draw):
    return lambda path: os.mkfifo(path)


@hostile("dev-zero")
def _zero(draw):
    return lambda path: os.symlink("/dev/zero", path)


@hostile("directory")
def _directory(draw):
    return lambda path: path.mkdir()


@hostile("past-the-cap")
def _oversized(draw):
    extra = draw(st.integers(1, 1 << 20))

    def make(path):
        with open(path, "wb") as handle:
            handle.truncate(SMALL_CAP + extra)  # sparse: nothing written

    return make


@hostile("deep-json")
def _deep(draw):
    depth = draw(st.integers(900, 200_000))
    return lambda path: path.write_bytes(deep_json(depth))


@hostile("huge-numbers")
def _huge(draw):
    digits = draw(st.sampled_from([20, 400, 4301, 5000]))
    return lambda path: path.write_bytes(huge_numbers(digits))


@hostile("not-utf8")
def _not_utf8(draw):
    prefix = draw(st.binary(max_size=20))
    return lambda path: path.write_bytes(not_utf8(prefix))


@hostile("garbage")
def _garbage(draw):
    data = draw(st.binary(max_size=300))
    return lambda path: path.write_bytes(data)


# --- every reader -------------------------------------------------------------------------------------


def llama_directory(folder: Path) -> Path:
    """A one-block Llama directory of CONFIG: config.json and model.safetensors, as transformers writes."""
    folder.mkdir()
    config = hf_llama.llama_config(ARCH, num_layers=ARCH.num_layers, eos_token_id=None)
    (folder / "config.json").write_text(json.dumps(config))
    flat = {name: torch.zeros(shape) for name, shape in expected_shapes(CONFIG).items()}
    save_file(hf_llama.to_llama(flat), folder / "model.safetensors")
    return folder


def prepared(folder: Path) -> Path:
    write_prepared(
        folder, {"train": np.arange(64, dtype=np.uint16)}, dtype="uint16", num_documents={"train": 1},
        input_kind="text", text_field="text", vocab_size=256, tokenizer_json=None, separator=[10], sources=[],
    )
    return folder


def yaml_import(path: Path) -> None:
    translate(YamlConfig(read_yaml(str(path)), str(path)), "run", Notes())


def cache(folder: Path) -> Path:
    ActivationCache.create(str(folder), CacheSpec(num_rows=4, seq_len=2, width=3, dtype="float32", rows_per_chunk=2))
    return folder


@dataclass(frozen=True)
class Reader:
    """A reader: `setup(folder)` returns the path of the file it reads (to be made hostile) and `read`
    reads it through rewind, raising `errors` for what it refuses."""

    setup: Callable[[Path], Path]
    read: Callable[[Path], object]
    errors: tuple[type[BaseException], ...]
    binary: bool = False  # reads bytes, not JSON/text: only what is not a regular file must be refused


READERS = {
    "tokenizer.json": Reader(lambda f: f / "tokenizer.json", load_tokenizer, (TokenizerError,)),
    "manifest.json": Reader(
        lambda f: prepared(f / "prep") / "manifest.json", lambda p: read_manifest(p.parent), (ManifestError,)
    ),
    "prepared token file": Reader(
        lambda f: prepared(f / "prep") / "train.bin",
        lambda p: check_prepared(p.parent, full=True) == [] or pytest.fail(check_prepared(p.parent, full=True)[0]),
        (pytest.fail.Exception,), binary=True,
    ),
    "jsonl documents": Reader(lambda f: f / "docs.jsonl", lambda p: list(iter_documents([str(p)], "jsonl")),
                              (DocumentError,)),
    "text documents": Reader(lambda f: f / "doc.txt", lambda p: list(iter_documents([str(p)], "text")),
                             (DocumentError,)),
    "gzipped documents": Reader(lambda f: f / "docs.jsonl.gz", lambda p: list(iter_documents([str(p)], "jsonl")),
                                (DocumentError,)),
    "parquet documents": Reader(lambda f: f / "docs.parquet", lambda p: list(iter_documents([str(p)], "parquet")),
                                (DocumentError,), binary=True),
    "token file": Reader(lambda f: f / "corpus.bin", lambda p: open_stream(str(p), "uint16"), (TokenFileError,),
                         binary=True),
    "pretrained config.json": Reader(
        lambda f: llama_directory(f / "llama") / "config.json", lambda p: load_pretrained(str(p.parent), CONFIG),
        (PretrainedError,),
    ),
    "pretrained shard index": Reader(
        lambda f: llama_directory(f / "llama") / "model.safetensors.index.json",
        lambda p: load_pretrained(str(p.parent), CONFIG), (PretrainedError,),
    ),
    "pretrained weights": Reader(
        lambda f: llama_directory(f / "llama") / "model.safetensors", lambda p: load_pretrained(str(p.parent), CONFIG),
        (PretrainedError,), binary=True,
    ),
    "rewind export": Reader(lambda f: f / "export.safetensors", lambda p: load_pretrained(str(p), CONFIG),
                            (PretrainedError,), binary=True),
    "zarr.json": Reader(lambda f: cache(f / "trunk-1.zarr") / "zarr.json",
                        lambda p: ActivationCache.open(str(p.parent)), (CacheError,)),
    "import-config YAML": Reader(lambda f: f / "theseus.yaml", yaml_import, (UsageError,)),
    "TOML config": Reader(lambda f: f / "run.toml", load_config, (UsageError, ConfigError)),
}


def shrink_caps() -> None:
    """Every cap SMALL_CAP (in the worker), so that a file past it is a small sparse file."""
    for module, name in [
        (datamanifest, "MAX_MANIFEST_BYTES"), (datamanifest, "MAX_TOKENIZER_BYTES"),
        (documents, "MAX_DOCUMENT_BYTES"), (cachefiles, "MAX_META_BYTES"), (tokenizer, "MAX_TOKENIZER_BYTES"),
        (pretrained_files, "MAX_JSON_BYTES"), (configfile, "MAX_CONFIG_BYTES"),
    ]:
        assert hasattr(module, name), (module, name)
        setattr(module, name, SMALL_CAP)


def read_with(reader_name: str, path: str) -> None:
    READERS[reader_name].read(Path(path))


@pytest.fixture(scope="module")
def worker():
    with Isolated(timeout=60, setup=f"{__name__}:shrink_caps") as isolated:
        yield isolated


@settings(max_examples=400, deadline=None)
@given(reader_name=st.sampled_from(sorted(READERS)), kind=st.sampled_from(sorted(HOSTILE)), data=st.data())
def test_every_reader_refuses_a_hostile_file_in_one_line_without_hanging(worker, reader_name, kind, data):
    reader = READERS[reader_name]
    make = HOSTILE[kind](data.draw)
    folder = Path(tempfile.mkdtemp(prefix="hostile-"))
    try:
        target = reader.setup(folder)
        if os.path.lexists(target):
            os.unlink(target)
        make(target)
        outcome = worker.call(f"{__name__}:read_with", reader_name, str(target))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    must_refuse = kind in ("fifo", "dev-zero", "directory") or (kind == "past-the-cap" and not reader.binary)
    if outcome.kind == "raised" and any(outcome.raised(error) for error in reader.errors):
        assert outcome.message and "\n" not in outcome.message, (reader_name, kind, outcome.message)
    else:
        assert outcome.kind == "returned", (reader_name, kind, outcome)
        assert not must_refuse, f"{reader_name} read a {kind} file"


# --- the commands that read them ----------------------------------------------------------------------


def rewind(*args: object, cwd: Path | None = None, timeout: float = 90) -> tuple[int, str]:
    """`python -m rewind ARGS` in a subprocess with a deadline (a hang fails the test): (exit, stderr)."""
    done = subprocess.run(
        [sys.executable, "-m", "rewind", *map(str, args)], capture_output=True, text=True, timeout=timeout,
        cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return done.returncode, done.stderr


def one_line_refusal(result: tuple[int, str], *needles: str) -> str:
    code, err = result
    assert code != 0 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rewind: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def make_hostile(kind: str, path: Path) -> None:
    examples = {
        "fifo": lambda: os.mkfifo(path),
        "dev-zero": lambda: os.symlink("/dev/zero", path),
        "deep-json": lambda: path.write_bytes(deep_json(100_000)),
        "huge-numbers": lambda: path.write_bytes(huge_numbers(5000)),
        "not-utf8": lambda: path.write_bytes(not_utf8(b"")),
    }
    if path.exists() or path.is_symlink():
        path.unlink()
    examples[kind]()


FAST = ["fifo", "deep-json"]
KINDS = [pytest.param(k, marks=() if k in FAST else pytest.mark.slow) for k in
         ["fifo", "dev-zero", "deep-json", "huge-numbers", "not-utf8"]]


@pytest.mark.parametrize("kind", KINDS)
def test_data_info_on_a_hostile_manifest(tmp_path, kind):
    make_hostile(kind, prepared(tmp_path / "prep") / "manifest.json")
    one_line_refusal(rewind("data", "info", tmp_path / "prep"), str(tmp_path / "prep"))


@pytest.mark.parametrize("kind", KINDS)
def test_data_prepare_on_a_hostile_input(tmp_path, kind):
    make_hostile(kind, tmp_path / "docs.jsonl")
    line = one_line_refusal(rewind("data", "prepare", tmp_path / "docs.jsonl", "--out", tmp_path / "out"))
    assert str(tmp_path / "docs.jsonl") in line and not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", [*KINDS, pytest.param("bomb"), pytest.param("no-unk", marks=pytest.mark.slow)])
def test_data_prepare_with_a_hostile_tokenizer(tmp_path, kind):
    (tmp_path / "doc.txt").write_text("a cat sat on a mat\n")
    path = tmp_path / "tokenizer.json"
    if kind == "bomb":  # the 2 KB file whose normalizer multiplies "a" 10**15-fold: no SIGABRT
        path.write_text(bomb())
    elif kind == "no-unk":
        path.write_text(json.dumps({**json.loads(bomb()), "normalizer": None, "model": {
            "type": "WordLevel", "vocab": {"a": 0}, "unk_token": "[UNK]"}}))
    else:
        make_hostile(kind, path)
    code, err = rewind("data", "prepare", tmp_path / "doc.txt", "--out", tmp_path / "out", "--tokenizer", path)
    assert code == 1, err  # (data prepare: a tokenizer file that is not one is exit 1)
    one_line_refusal((code, err), str(path))


YAML_ATTACKS = {
    # 9 levels of 9 aliases each (about 500 bytes): 387 million values once expanded.
    "billion-laughs": "a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n"
    + "".join(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]\n" for i in range(1, 9))
    + "training:\n  tokens: [1000]\n  batch_size: *a8\n",
    "deep": "training: " + "[" * 100_000 + "]" * 100_000 + "\n",
    "5000-digit batch_size": "training:\n  tokens: [1000]\n  batch_size: " + "9" * 5000 + "\n",
    "400-digit lr": "optimization:\n  lr: " + "9" * 400 + "\ntraining:\n  tokens: [1000]\n  dataset: [[{name: sort}]]\n",
    "400-digit rate": "training:\n  tokens: [1000]\n  dataset: [[{name: sort, rate: " + "9" * 400 + "}]]\n",
    "recursive alias": "a: &a [*a]\ntraining:\n  tokens: [1000]\n",
}


@pytest.mark.parametrize("attack", list(YAML_ATTACKS))
def test_import_config_on_a_hostile_yaml(tmp_path, attack):
    path = tmp_path / "theseus.yaml"
    path.write_text(YAML_ATTACKS[attack])
    code, err = rewind("import-config", path, timeout=30)
    assert code == 2, err
    line = one_line_refusal((code, err), str(path))
    assert len(line) < 300  # no value printed whole


def test_aliases_that_expand_past_the_bound_are_refused_as_the_yaml_is_read(tmp_path):
    """Refused while parsing, before anything walks the expansion (printing it, or naming unread keys)."""
    path = tmp_path / "theseus.yaml"
    path.write_text(YAML_ATTACKS["billion-laughs"])
    with pytest.raises(UsageError, match=r": not valid YAML at line 6: aliases expand the document past 100,000 values$"):
        read_yaml(str(path))


def test_import_config_accepts_simple_anchors(tmp_path):
    path = tmp_path / "theseus.yaml"
    path.write_text(
        "defaults: &defaults {lr: 0.001, weight_decay: 0.1}\noptimization:\n  <<: *defaults\n"
        "training:\n  tokens: &budget [1000, 2000]\n  dataset: [[{name: sort}], [{name: sort}]]\n"
    )
    done = subprocess.run([sys.executable, "-m", "rewind", "import-config", str(path)], capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert "lr = 0.001" in done.stdout and "weight_decay = 0.1" in done.stdout


# --- a run's files replaced --------------------------------------------------------------------------

RUN_CONFIG = """
[run]
seed = 3
[architecture]
block_size = 16
vocab_size = 320
num_layers = 1
num_heads = 2
d_model = 32
[training]
batch_size = 4
tokens = [768]
datasets = [[{ name = "corpus" }]]
validation_steps = 1
evaluations = ["prose"]
[logging]
report_interval = 1
checkpoint_interval = 4
[data.corpus]
kind = "tokens"
path = "corpus.bin"
validation_fraction = 0.1
[data.prose]
kind = "text"
path = "prose.txt"
[tokenizer]
path = "tokenizer.json"
"""


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory) -> Path:
    """A run stopped after 4 steps on a token file, with a tokenizer and a tokenised text dataset it
    declares (so RUN/data holds tokenizer.json and a prepared directory)."""
    folder = tmp_path_factory.mktemp("hostile-run")
    np.random.default_rng(0).integers(0, 256, size=20 * 17).astype(np.uint16).tofile(folder / "corpus.bin")
    (folder / "prose.txt").write_text("the cat sat on the mat and the dog ran far away from home\n" * 20)
    (folder / "tokenizer.json").write_text(train_bpe(["the cat sat on the mat"] * 4, 320).to_json())
    (folder / "run.toml").write_text(RUN_CONFIG)
    code, err = rewind("train", folder / "run.toml", "--run-dir", folder / "run", "--no-progress", "--max-steps", "4",
                       timeout=300)
    assert code == 0, err
    return folder


@contextlib.contextmanager
def replaced(path: Path, kind: str):
    """`path` made hostile for the duration, then put back (the run recorded the data files where the
    fixture made them, so those are replaced in place, not copied)."""
    kept = path.with_name(path.name + ".kept")
    path.rename(kept)
    try:
        make_hostile(kind, path)
        yield path
    finally:
        if path.is_dir() and not path.is_symlink():
            path.rmdir()
        elif os.path.lexists(path):
            path.unlink()
        kept.rename(path)


@pytest.mark.parametrize(
    ("where", "kind"),
    [
        ("corpus.bin", "fifo"),
        pytest.param("corpus.bin", "dev-zero", marks=pytest.mark.slow),
        ("run/data/tokenizer.json", "fifo"),
        pytest.param("run/data/tokenizer.json", "deep-json", marks=pytest.mark.slow),
        pytest.param("tokenizer.json", "fifo", marks=pytest.mark.slow),
        pytest.param("manifest of run/data/prose", "fifo", marks=pytest.mark.slow),
        pytest.param("manifest of run/data/prose", "deep-json", marks=pytest.mark.slow),
    ],
)
def test_resume_and_verify_data_with_a_run_file_replaced(stopped_run, where, kind):
    folder = stopped_run
    if where.startswith("manifest of "):
        [target] = (folder / "run" / "data").glob("prose-*/manifest.json")
    else:
        target = folder / where
    before = sorted(p.name for p in (folder / "run" / "events").iterdir())
    with replaced(target, kind):
        one_line_refusal(rewind("resume", folder / "run", "--no-progress", timeout=120))
        assert sorted(p.name for p in (folder / "run" / "events").iterdir()) == before
        code, err = rewind("verify", "--data", folder / "run", timeout=120)
        assert code == 1 and "Traceback" not in err, err


def test_verify_data_ends_on_a_token_file_linked_to_dev_zero(stopped_run):
    with replaced(stopped_run / "corpus.bin", "dev-zero") as corpus:
        done = subprocess.run([sys.executable, "-m", "rewind", "verify", "--data", str(stopped_run / "run")],
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr + done.stdout
    [problem] = [line for line in done.stdout.splitlines() if line.startswith("PROBLEM")]
    assert problem == f"PROBLEM data: dataset 'corpus': {corpus}: cannot read: a character device, not a regular file"


@pytest.mark.parametrize(
    ("kind", "needle"),
    [
        ("fifo", "a FIFO, not a regular file"),
        pytest.param("deep-json", "nested too deeply", marks=pytest.mark.slow),
        pytest.param("rope_theta", "rope", marks=pytest.mark.slow),
        pytest.param("architectures", "config.json", marks=pytest.mark.slow),
        pytest.param("huge rope_theta", "rope", marks=pytest.mark.slow),
    ],
)
def test_train_from_a_hostile_pretrained_config(tmp_path, kind, needle):
    llama = llama_directory(tmp_path / "llama")
    config = json.loads((llama / "config.json").read_text())
    edits = {"rope_theta": {"rope_theta": "abc", "rope_parameters": None},
             "architectures": {"architectures": 5, "model_type": None},
             "huge rope_theta": {"rope_theta": 10**400, "rope_parameters": None}}
    if kind in edits:
        (llama / "config.json").write_text(json.dumps({**config, **edits[kind]}))
    else:
        make_hostile(kind, llama / "config.json")
    (tmp_path / "run.toml").write_text(
        "[run]\nseed = 1\n[architecture]\nblock_size = 32\nvocab_size = 128\nnum_layers = 1\nnum_heads = 2\n"
        'd_model = 32\nmlp = "swiglu"\n[training]\nbatch_size = 2\ntokens = [64]\ndatasets = [[{ name = "sort" }]]\n'
        f'[pretrained]\npath = "{llama}"\n'
    )
    code, err = rewind("train", tmp_path / "run.toml", "--run-dir", tmp_path / "run", "--no-progress", timeout=120)
    assert code == 2, err
    one_line_refusal((code, err), "config.json", needle)
    assert not (tmp_path / "run" / "events").exists()
