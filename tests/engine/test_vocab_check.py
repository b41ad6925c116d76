"""Token ids past architecture.vocab_size in a token file too large to scan whenever it is opened
(more than EAGER_VOCAB_CHECK_TOKENS, 2**26: patched down to 0 here, so that a few hundred tokens count
as large). A start scans it whole before it records RunStarted: one line, exit 2, nothing written. A
run that did not (one started by an earlier release) meets the id when a step reads it: one line,
exit 1, no step committed on it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rewind.engine.data import datasets as datasets_module
from rewind.engine.data.datasets import DatasetError, TokenIdError, WindowedDataset
from rewind.engine.data.tokens import TokenFileError, open_stream
from rewind.states.events import RunStarted, StepCommitted
from rewind.stores.runs import read_seq_events
from tests.engine.test_loop import run_cli

CONFIG = """
[architecture]
block_size = 8
vocab_size = 256
num_layers = 1
num_heads = 2
d_model = 16
[training]
batch_size = 2
tokens = [64]
datasets = [[{ name = "toks" }]]
[data.toks]
kind = "tokens"
path = "t.bin"
"""


@pytest.fixture
def large(monkeypatch) -> None:
    monkeypatch.setattr(datasets_module, "EAGER_VOCAB_CHECK_TOKENS", 0)


def setup(folder: Path, bad_id: int | None) -> Path:
    values = np.arange(90 * 9) % 200
    if bad_id is not None:
        values[::7] = bad_id  # in every window: whichever a step reads holds one
    values.astype(np.uint16).tofile(folder / "t.bin")
    (folder / "run.toml").write_text(CONFIG)
    return folder / "run.toml"


def train(config: Path, run: Path) -> tuple[int, str]:
    code, _, err = run_cli("train", config, "--run-dir", run, "--no-progress")
    assert "Traceback" not in err
    return code, err


def test_a_start_scans_a_large_file_whole_and_records_nothing(tmp_path, large):
    code, err = train(setup(tmp_path, 300), tmp_path / "run")
    assert code == 2, err
    assert (
        err.strip()
        == f"rewind: dataset 'toks': {tmp_path / 't.bin'}: token id 300 is outside architecture.vocab_size 256"
    )
    assert not (tmp_path / "run" / "events").exists()  # (before: RunStarted, then a traceback at step 1)
    code, err = train(setup(tmp_path, None), tmp_path / "run")
    assert code == 0, err


def test_an_id_met_by_a_step_is_one_line_and_exit_1(tmp_path, large, monkeypatch):
    opened = WindowedDataset.__init__

    def as_an_earlier_release(self, *args, check_all=False, **kwargs):  # started without the whole scan
        opened(self, *args, **kwargs)

    monkeypatch.setattr(WindowedDataset, "__init__", as_an_earlier_release)
    code, err = train(setup(tmp_path, 300), tmp_path / "run")
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "token id 300 is outside architecture.vocab_size 256" in err
    events = [e for _, e in read_seq_events(str(tmp_path / "run"))]
    assert isinstance(events[0], RunStarted) and not any(isinstance(e, StepCommitted) for e in events)


def test_the_lazy_error_is_a_dataset_error_and_a_token_file_error(tmp_path, large):
    setup(tmp_path, 300)
    dataset = WindowedDataset(
        "toks", open_stream(str(tmp_path / "t.bin"), "uint16"), 8, 256, split="tail", fraction=0.5
    )
    with pytest.raises(TokenIdError, match="token id 300") as caught:
        dataset.batch("train", [0])
    assert isinstance(caught.value, DatasetError) and isinstance(caught.value, TokenFileError)
    with pytest.raises(DatasetError, match="token id 300"):
        WindowedDataset(
            "toks",
            open_stream(str(tmp_path / "t.bin"), "uint16"),
            8,
            256,
            split="tail",
            fraction=0.5,
            check_all=True,
        )
