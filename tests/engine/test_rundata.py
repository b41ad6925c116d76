"""A run's data (rewind.engine.data.rundata): the tokenizer decided at the start and kept in RUN/data, the
identity of every dataset on record, and the checks of a resume (cheap) and of `verify --data` (full).

The file-level fingerprint (rewind.stores.datafiles) is what the cheap check rests on: it notices an
edit in one of its sampled blocks and a change of size, and misses an edit between the blocks, which is
exactly what the full check is for.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import msgspec
import numpy as np
import pytest

from rewind.engine.data.dataprep import prepare
from rewind.engine.data.datasets import DatasetError
from rewind.engine.data.documents import iter_documents
from rewind.engine.data.registry import DatasetRegistry
from rewind.engine.data.rundata import (
    DataChanged,
    check_data,
    copy_run_data,
    home_of,
    identities,
    publish_run_data,
    replace_config_data,
    start_home,
    tokenizer_path,
    verify_data,
)
from rewind.engine.data.tokenizer import TokenizerError, train_bpe
from rewind.engine.run.parts import open_datasets
from rewind.states.config import (
    ArchitectureSection,
    Config,
    DataSource,
    Sampling,
    TokenizerSection,
    TrainingSection,
)
from rewind.states.events import RUN_FEATURES
from rewind.states.stages import PretrainStage
from rewind.states.state import State
from rewind.stores.datafiles import (
    FINGERPRINT_BLOCK,
    NUM_FINGERPRINT_BLOCKS,
    file_identity,
    fingerprint_offsets,
)
from tests.engine.test_userdata import prepared_in

BLOCK = 16
WORDS = [
    "the",
    "cat",
    "sat",
    "on",
    "a",
    "mat",
    "while",
    "dogs",
    "ran",
    "far",
    "away",
    "from",
    "home",
    "and",
    "back",
]


def documents(seed: int, num: int = 12) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=30)) + "." for _ in range(num)]


def write_jsonl(path: Path, texts: list[str]) -> str:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return str(path)


def write_tokens(path: Path, num_tokens: int, seed: int = 0) -> str:
    np.random.default_rng(seed).integers(0, 256, size=num_tokens).astype(np.uint16).tofile(path)
    return str(path)


def make_config(data: dict[str, DataSource], vocab_size: int = 512, **tokenizer) -> Config:
    return Config(
        architecture=ArchitectureSection(block_size=BLOCK, vocab_size=vocab_size),
        stages=[PretrainStage(tokens=1024, datasets=[Sampling(name=next(iter(data)))])],
        data=data,
        tokenizer=TokenizerSection(**tokenizer),
    )


def started(config: Config, run_dir: Path) -> tuple[State, object]:
    """What a start puts on record, as rewind.engine.run.session does it: the home, every dataset the
    run reads opened, the identities."""
    home = start_home(config, str(run_dir))
    open_datasets(config, home)
    state = State(
        features=list(RUN_FEATURES), data=identities(config, home), tokenizer=home.tokenizer.identity
    )
    publish_run_data(home, config, str(run_dir))  # (the session does it when it records RunStarted)
    return state, home


def sha256_of(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# --- the run's tokenizer ----------------------------------------------------------------------------


def test_a_tokenizer_file_is_copied_into_the_run(tmp_path):
    tokenizer = train_bpe(documents(0), 300)
    (tmp_path / "tok.json").write_text(tokenizer.to_json(), encoding="utf-8")
    docs = write_jsonl(tmp_path / "d.jsonl", documents(1))
    config = make_config({"d": DataSource(kind="jsonl", path=docs)}, path=str(tmp_path / "tok.json"))
    home = start_home(config, str(tmp_path / "run"))
    assert home.tokenizer.identity == tokenizer.identity == sha256_of(tmp_path / "tok.json")
    assert not (tmp_path / "run").exists()  # nothing is written before the start is on its way to its record
    assert home.full_identity and home.data_dir is None
    open_datasets(config, home)
    publish_run_data(home, config, str(tmp_path / "run"))
    assert (tmp_path / "run" / "data" / "tokenizer.json").read_bytes() == (tmp_path / "tok.json").read_bytes()
    assert tokenizer_path(str(tmp_path / "run")) == str(tmp_path / "run" / "data" / "tokenizer.json")
    assert home.data_dir == str(tmp_path / "run" / "data")


def test_bytes_write_no_tokenizer_file(tmp_path):
    docs = write_jsonl(tmp_path / "d.jsonl", documents(1))
    home = start_home(
        make_config({"d": DataSource(kind="jsonl", path=docs)}, vocab_size=256), str(tmp_path / "run")
    )
    assert home.tokenizer.identity == "" and home.tokenizer.vocab_size == 256
    assert not (tmp_path / "run" / "data" / "tokenizer.json").exists()


def test_a_trained_tokenizer_learns_the_text_datasets_it_is_told_to(tmp_path):
    first, second = documents(1), documents(2)
    data = {
        "a": DataSource(kind="jsonl", path=write_jsonl(tmp_path / "a.jsonl", first)),
        "tok": DataSource(kind="tokens", path=write_tokens(tmp_path / "t.bin", 40 * 17)),
        "b": DataSource(kind="text", path=str(tmp_path / "b.txt")),
        "qa": DataSource(kind="jsonl", path=str(tmp_path / "qa.jsonl"), prompt_field="q", response_field="a"),
    }
    (tmp_path / "b.txt").write_text("\n".join(second), encoding="utf-8")
    (tmp_path / "qa.jsonl").write_text(json.dumps({"q": "zzzz qqqq", "a": "xxxx"}) + "\n")
    every = start_home(make_config(data, train_vocab_size=300), str(tmp_path / "run1")).tokenizer
    # Every text dataset, in the config's order; not the tokens, not the pairs.
    assert every.identity == train_bpe([*first, "\n".join(second)], 300).identity
    assert json.loads(every.to_json())["model"]["type"] == "BPE"
    only_b = start_home(
        make_config(data, train_vocab_size=300, train_on=["b"]), str(tmp_path / "run2")
    ).tokenizer
    assert only_b.identity == train_bpe(iter_documents([str(tmp_path / "b.txt")], "text"), 300).identity
    assert only_b.identity != every.identity


def test_a_prepared_directorys_tokenizer_is_adopted(tmp_path):
    tokenizer = train_bpe(documents(3), 300)
    prepare([write_jsonl(tmp_path / "a.jsonl", documents(3))], tmp_path / "prep", tokenizer, kind="jsonl")
    config = make_config({"p": DataSource(kind="tokens", path=str(tmp_path / "prep"))})
    state, home = started(config, tmp_path / "run")
    assert home.tokenizer.identity == tokenizer.identity == state.tokenizer
    assert sha256_of(tmp_path / "run" / "data" / "tokenizer.json") == tokenizer.identity

    other = train_bpe(documents(4), 300)
    prepare([write_jsonl(tmp_path / "b.jsonl", documents(4))], tmp_path / "prep2", other, kind="jsonl")
    both = make_config(
        {
            "p": DataSource(kind="tokens", path=str(tmp_path / "prep")),
            "q": DataSource(kind="tokens", path=str(tmp_path / "prep2")),
        }
    )
    with pytest.raises(TokenizerError, match=r"different tokenizers .*: prepare 'q' again with the tokenizer of 'p': "):
        start_home(both, str(tmp_path / "run2"))


def test_a_tokenizer_larger_than_the_vocabulary_is_refused_in_one_line(tmp_path):
    rng = np.random.default_rng(0)  # words enough for 400 ids (a small corpus stops merging earlier)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = ["".join(rng.choice(letters, size=rng.integers(2, 7))) for _ in range(2000)]
    tokenizer = train_bpe([" ".join(words[i : i + 50]) for i in range(0, 2000, 50)], 400)
    assert tokenizer.vocab_size == 400
    (tmp_path / "tok.json").write_text(tokenizer.to_json(), encoding="utf-8")
    docs = write_jsonl(tmp_path / "d.jsonl", documents(1))
    config = make_config(
        {"d": DataSource(kind="jsonl", path=docs)}, vocab_size=320, path=str(tmp_path / "tok.json")
    )
    with pytest.raises(TokenizerError) as caught:
        start_home(config, str(tmp_path / "run"))
    assert str(caught.value) == "the tokenizer has 400 ids, more than architecture.vocab_size 320"
    assert not (tmp_path / "run" / "data" / "tokenizer.json").exists()  # checked before it is written
    prepare([docs], tmp_path / "prep", tokenizer, kind="jsonl")
    adopted = make_config({"p": DataSource(kind="tokens", path=str(tmp_path / "prep"))}, vocab_size=320)
    with pytest.raises(TokenizerError, match=r"400 ids, more than architecture\.vocab_size 320"):
        start_home(adopted, str(tmp_path / "run2"))


def test_a_start_on_bytes_leaves_no_tokenizer_of_an_earlier_failed_start(tmp_path):
    tokenizer = train_bpe(documents(0), 300)
    (tmp_path / "tok.json").write_text(tokenizer.to_json(), encoding="utf-8")
    run = tmp_path / "run"
    missing = DataSource(kind="tokens", path=str(tmp_path / "missing.bin"))
    home = start_home(make_config({"d": missing}, path=str(tmp_path / "tok.json")), str(run))
    with pytest.raises(DatasetError):  # the start fails (before anything is written, now)
        DatasetRegistry(make_config({"d": missing}), home)["d"]
    run.joinpath("data").mkdir(parents=True)  # as a start of an earlier release could have left it
    run.joinpath("data", "tokenizer.json").write_text(tokenizer.to_json(), encoding="utf-8")
    # The user fixes the config, dropping [tokenizer]: the run is bytes and records tokenizer "".
    fixed = make_config(
        {"d": DataSource(kind="tokens", path=write_tokens(tmp_path / "t.bin", 40 * 17))}, vocab_size=256
    )
    state, _ = started(fixed, run)
    assert state.tokenizer == ""
    # (Before: the stale file stayed, and every resume was refused: "changed since the run started".)
    assert not (run / "data" / "tokenizer.json").exists()
    assert home_of(str(run), state).tokenizer.identity == ""


def test_a_changed_run_tokenizer_is_refused_and_an_old_run_carves_the_tail(tmp_path):
    tokenizer = train_bpe(documents(0), 300)
    (tmp_path / "tok.json").write_text(tokenizer.to_json(), encoding="utf-8")
    docs = write_jsonl(tmp_path / "d.jsonl", documents(1))
    state, _ = started(
        make_config({"d": DataSource(kind="jsonl", path=docs)}, path=str(tmp_path / "tok.json")),
        tmp_path / "run",
    )
    home = home_of(str(tmp_path / "run"), state)
    assert home.tokenizer.identity == tokenizer.identity and home.default_split == "random"
    assert not home.full_identity
    run_copy = tmp_path / "run" / "data" / "tokenizer.json"
    run_copy.write_text(train_bpe(documents(5), 300).to_json(), encoding="utf-8")
    with pytest.raises(DataChanged) as caught:
        home_of(str(tmp_path / "run"), state)
    assert "tokenizer.json: the run's tokenizer file changed since the run started" in str(caught.value)
    assert tokenizer.identity[:12] in str(caught.value) and "\n" not in str(caught.value)
    old = msgspec.structs.replace(state, features=[f for f in state.features if f != "data_identity"])
    assert home_of(str(tmp_path / "run"), old).default_split == "tail"  # nothing on record: not refused


# --- identities and their checks --------------------------------------------------------------------


@pytest.fixture
def token_run(tmp_path):
    """A run started on two token files (one only declared, never trained on) and a jsonl corpus."""
    data = {
        "main": DataSource(kind="tokens", path=write_tokens(tmp_path / "main.bin", 60 * 17)),
        "spare": DataSource(
            kind="tokens",
            path=write_tokens(tmp_path / "spare.bin", 30 * 17, seed=1),
            validation_path=write_tokens(tmp_path / "spare_valid.bin", 5 * 17, seed=2),
        ),
        "docs": DataSource(kind="jsonl", path=write_jsonl(tmp_path / "docs.jsonl", documents(6))),
    }
    config = msgspec.structs.replace(
        make_config(data, vocab_size=256),
        stages=[PretrainStage(tokens=1024, datasets=[Sampling(name="main", rate=0.5), Sampling(name="docs", rate=0.5)])],
        training=TrainingSection(evaluations=["spare"]),  # read by evaluations only: on record all the same
    )
    state, _ = started(config, tmp_path / "run")
    return config, state, tmp_path


def test_every_dataset_is_on_record_with_its_content_hashes(token_run):
    config, state, tmp_path = token_run
    assert sorted(state.data) == ["docs", "main", "spare"]
    for name, identity in state.data.items():
        files = [*identity.sources, *identity.validation_sources]
        assert files and all(f.sha256 == sha256_of(f.path) for f in files), name
    assert [f.path for f in state.data["spare"].validation_sources] == [str(tmp_path / "spare_valid.bin")]
    assert state.data["docs"].prepared and state.data["docs"].kind == "jsonl"
    assert check_data(config, state, home_of(str(tmp_path / "run"), state)) == []
    assert check_data(config, state, home_of(str(tmp_path / "run"), state), full=True) == []


def test_a_declared_dataset_nothing_reads_is_not_on_record_and_does_not_stop_the_start(tmp_path):
    # (Before: identities() wanted every text dataset tokenised, and the start opened only those trained
    # on, so declaring one for later failed the start with "not a prepared data directory".)
    data = {
        "main": DataSource(kind="tokens", path=write_tokens(tmp_path / "main.bin", 60 * 17)),
        "later": DataSource(kind="jsonl", path=write_jsonl(tmp_path / "later.jsonl", documents(7))),
    }
    state, _ = started(make_config(data, vocab_size=256), tmp_path / "run")
    assert sorted(state.data) == ["main"]


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "change, needle",
    [
        (lambda p: flip_byte(p, 100), "main.bin: contents changed (same size, different fingerprint)"),
        (
            lambda p: p.write_bytes(p.read_bytes() + b"\0\0"),
            f"main.bin: size {60 * 17 * 2 + 2} bytes, the run recorded",
        ),
        (lambda p: p.write_bytes(p.read_bytes()[:-34]), "main.bin: size"),
    ],
)
def test_a_changed_token_file_is_a_change_in_one_line(token_run, change, needle):
    config, state, tmp_path = token_run
    change(tmp_path / "main.bin")
    changes = check_data(config, state, home_of(str(tmp_path / "run"), state))
    assert len(changes) == 1 and changes[0].startswith("dataset 'main': ") and needle in changes[0]


def test_changed_documents_and_a_changed_validation_file_are_changes(token_run):
    config, state, tmp_path = token_run
    flip_byte(tmp_path / "spare_valid.bin", 3)
    (tmp_path / "docs.jsonl").write_text(
        (tmp_path / "docs.jsonl").read_text() + json.dumps({"text": "more"}) + "\n"
    )
    changes = check_data(config, state, home_of(str(tmp_path / "run"), state))
    assert len(changes) == 2
    assert changes[0].startswith("dataset 'docs': ") and "docs.jsonl: size" in changes[0]
    assert (
        changes[1].startswith("dataset 'spare' (validation): ")
        and "spare_valid.bin: contents changed" in changes[1]
    )
    # A dataset the new config declares otherwise is not held to the old record (a fork records the new one).
    moved = msgspec.structs.replace(
        config, data={**config.data, "docs": DataSource(kind="jsonl", path="elsewhere")}
    )
    assert sorted(replace_config_data(moved, config).data) == ["main", "spare"]


def test_a_deleted_data_file_is_a_change(token_run):
    config, state, tmp_path = token_run
    os.remove(tmp_path / "main.bin")
    changes = check_data(config, state, home_of(str(tmp_path / "run"), state))
    assert len(changes) == 1 and "dataset 'main'" in changes[0] and "main.bin" in changes[0]


def test_a_changed_tokenizer_file_is_a_change(tmp_path):
    tokenizer = train_bpe(documents(0), 300)
    (tmp_path / "tok.json").write_text(tokenizer.to_json(), encoding="utf-8")
    docs = write_jsonl(tmp_path / "d.jsonl", documents(1))
    config = make_config({"d": DataSource(kind="jsonl", path=docs)}, path=str(tmp_path / "tok.json"))
    state, _ = started(config, tmp_path / "run")
    home = home_of(str(tmp_path / "run"), state)
    assert check_data(config, state, home) == []
    (tmp_path / "tok.json").write_text(train_bpe(documents(9), 300).to_json(), encoding="utf-8")
    [line] = check_data(config, state, home)
    assert line.startswith(f"tokenizer.path: {tmp_path / 'tok.json'} changed since the run started")
    os.remove(tmp_path / "tok.json")
    [line] = check_data(config, state, home)
    assert "(missing" in line


# --- cheap and full -------------------------------------------------------------------------------


def test_the_fingerprint_samples_blocks_and_the_full_hash_reads_everything(tmp_path):
    size = 2 * NUM_FINGERPRINT_BLOCKS * FINGERPRINT_BLOCK  # large enough to be sampled
    path = tmp_path / "big.bin"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, size=size).astype(np.uint8).tobytes())
    offsets = fingerprint_offsets(size)
    assert (
        len(offsets) == NUM_FINGERPRINT_BLOCKS and offsets[0] == 0 and offsets[-1] == size - FINGERPRINT_BLOCK
    )
    before = file_identity(path, full=True)
    assert before.sha256 == sha256_of(path) and file_identity(path).sha256 == ""
    gap = offsets[1] + FINGERPRINT_BLOCK + 10  # between the first two blocks
    assert offsets[1] + FINGERPRINT_BLOCK < gap < offsets[2]
    flip_byte(path, gap)
    missed = file_identity(path, full=True)
    assert missed.fingerprint == before.fingerprint and missed.sha256 != before.sha256
    flip_byte(path, offsets[7] + 5)
    assert file_identity(path).fingerprint != before.fingerprint
    small = tmp_path / "small.bin"
    small.write_bytes(b"abc")
    assert fingerprint_offsets(3) == [0] and fingerprint_offsets(0) == []
    fingerprint = file_identity(small).fingerprint
    small.write_bytes(b"abd")
    assert file_identity(small).fingerprint != fingerprint  # a small file is read whole


def test_verify_finds_what_the_cheap_check_misses(tmp_path):
    size_tokens = NUM_FINGERPRINT_BLOCKS * FINGERPRINT_BLOCK  # 2 MiB of uint16
    path = Path(write_tokens(tmp_path / "big.bin", size_tokens))
    config = make_config({"big": DataSource(kind="tokens", path=str(path))}, vocab_size=256)
    state, _ = started(config, tmp_path / "run")
    run = str(tmp_path / "run")
    problems, notes = verify_data(run, config, state)
    assert problems == [] and notes == ["data: 1 dataset(s), 1 file(s) re-hashed, all as recorded"]
    offsets = fingerprint_offsets(path.stat().st_size)
    flip_byte(path, offsets[3] + FINGERPRINT_BLOCK + 1)  # between two sampled blocks
    assert check_data(config, state, home_of(run, state)) == []  # a resume does not see it
    problems, notes = verify_data(run, config, state)
    assert len(problems) == 1 and problems[0].startswith("data: dataset 'big': ")
    assert "big.bin: contents changed (sha256" in problems[0]
    assert notes == ["data: 1 dataset(s), 1 file(s) re-hashed"]


def test_verify_checks_the_runs_prepared_tokens_and_says_why_an_old_run_has_nothing(token_run):
    config, state, tmp_path = token_run
    run = str(tmp_path / "run")
    assert verify_data(run, config, state)[0] == []
    prepared = prepared_in(tmp_path / "run" / "data", "docs")
    flip_byte(prepared / "train.bin", 2)
    problems, _ = verify_data(run, config, state)
    # The fingerprint says so against the record, the whole hash against the manifest.
    assert any("(its token files): train.bin: contents changed" in p for p in problems)
    assert any(f"{prepared}/train.bin: contents changed" in p for p in problems)
    old = msgspec.structs.replace(state, features=[])
    assert verify_data(run, config, old) == (
        [],
        ["data: the run started before rewind recorded its data (nothing to compare with)"],
    )


def test_a_resume_notices_the_runs_prepared_tokens_changed(token_run):
    config, state, tmp_path = token_run
    flip_byte(
        prepared_in(tmp_path / "run" / "data", "docs") / "train.bin", 2
    )  # same size, in the first block
    assert check_data(config, state, home_of(str(tmp_path / "run"), state)) != []


def test_a_fork_copies_the_runs_tokenizer_and_prepared_documents(tmp_path):
    tokenizer = train_bpe(documents(0), 300)
    (tmp_path / "tok.json").write_text(tokenizer.to_json(), encoding="utf-8")
    docs = write_jsonl(tmp_path / "d.jsonl", documents(1))
    config = make_config({"d": DataSource(kind="jsonl", path=docs)}, path=str(tmp_path / "tok.json"))
    state, home = started(config, tmp_path / "parent")
    copy_run_data(home, config, str(tmp_path / "parent"), str(tmp_path / "child"))
    parent, child = (
        prepared_in(tmp_path / "parent" / "data", "d"),
        prepared_in(tmp_path / "child" / "data", "d"),
    )
    assert parent.name == child.name
    for path in ("tokenizer.json", f"{parent.name}/manifest.json", f"{parent.name}/train.bin"):
        assert (tmp_path / "child" / "data" / path).read_bytes() == (
            tmp_path / "parent" / "data" / path
        ).read_bytes()
    child_home = home_of(str(tmp_path / "child"), state)
    assert (
        child_home.tokenizer.identity == tokenizer.identity and check_data(config, state, child_home) == []
    )
