"""The `sft` strategy: a stage's rows are prompt/response examples at its datasets' cursors, one to a row
or packed several to a window (each attending to itself alone), the loss on the response and its end
token; a packed window's loss is its examples' unpacked loss. (Killed and resumed: test_posttrain_kill.)"""

from __future__ import annotations

import copy

import pytest
import torch

from rewind.engine.data.cursors import assemble_batch, sample_indices
from rewind.engine.data.example_batches import packed_row_count, packed_sft_batch, sft_batch, step_rows
from rewind.engine.data.examples import task_sft_row
from rewind.engine.data.registry import DatasetRegistry
from rewind.engine.model.layout import build_model
from rewind.engine.step.step import build_optimizer, train_step
from rewind.states.config_reading import loads_config
from tests.conftest import EXAMPLES

TINY = (EXAMPLES / "tiny.toml").read_text()
SECOND = 'tokens = 12_800\ndatasets = [{ name = "reverse", rate = 1.0 }]'
THIRD = 'datasets = [{ name = "sort", rate = 0.5 }, { name = "reverse", rate = 0.5 }]'
# pretrain on grammar -> sft on reverse -> packed sft on sort and reverse (fading into each other)
# (windows of 64 tokens hold two or three of the tasks' examples)
SFT_TEXT = (
    TINY.replace(SECOND, f'strategy = "sft"\n{SECOND}')
    .replace(THIRD, f'strategy = "sft"\n{THIRD}\nsft = {{ packing = true }}')
    .replace("block_size = 32", "block_size = 64")
)
BLOCK = 64
SFT = loads_config(SFT_TEXT)
NEWLINE = 10  # the byte-level tokenizer's end of a response


def _registry(config=SFT) -> DatasetRegistry:
    return DatasetRegistry(config)


def test_a_step_without_sft_rows_is_the_pretraining_batch_bit_for_bit():
    rows = [8, 0, 0]
    got = step_rows(SFT, rows, {"grammar": 3}, _registry())
    tokens, mask, cursors, _ = assemble_batch(SFT.run.seed, SFT, rows, {"grammar": 3}, _registry())
    assert got.documents is None and got.cursors == cursors
    assert torch.equal(got.tokens, tokens) and torch.equal(got.loss_mask, mask)


def test_an_sft_share_is_one_example_to_a_row_at_the_cursor_s_positions():
    got = step_rows(SFT, [0, 5, 0], {"reverse": 11}, _registry())
    indices = sample_indices(SFT.run.seed, "reverse", 2**20, 11, 5)
    want = sft_batch([task_sft_row("reverse", "train", int(i)) for i in indices], BLOCK, NEWLINE)
    assert got.cursors == {"reverse": 16} and got.documents is None
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.loss_mask, want.loss_mask)
    # the loss is on the response and its end token: the last target of every row is the newline
    for tokens, mask in zip(got.tokens, got.loss_mask, strict=True):
        targets = tokens[1:][mask].tolist()
        assert targets[-1] == NEWLINE and NEWLINE not in targets[:-1]


def test_a_packed_share_fills_its_windows_and_moves_the_cursor_by_the_examples_it_read():
    got = step_rows(SFT, [0, 0, 4], {"sort": 0, "reverse": 7}, _registry())
    # 4 rows split over sort and reverse (2 each), each filled with as many examples as fit
    assert got.tokens.shape == (4, BLOCK + 1) and got.documents is not None and got.documents.shape == (4, BLOCK)
    expected_cursors = {}
    batches = []
    for name, start in (("sort", 0), ("reverse", 7)):
        ahead = [task_sft_row(name, "train", int(i)) for i in sample_indices(SFT.run.seed, name, 2**20, start, 64)]
        count = packed_row_count(ahead, BLOCK, 2)
        assert count > 2  # several examples to a window
        batches.append(packed_sft_batch(ahead[:count], BLOCK, NEWLINE))
        expected_cursors[name] = start + count
    assert got.cursors == expected_cursors
    assert torch.equal(got.tokens, torch.cat([b.tokens for b in batches]))
    assert torch.equal(got.documents, torch.cat([b.documents for b in batches]))


def test_a_fade_from_pretraining_into_packed_sft_gives_pretraining_rows_one_document():
    config = loads_config(SFT_TEXT.replace('strategy = "sft"\ntokens = 12_800', "tokens = 12_800", 1))
    got = step_rows(config, [0, 3, 2], {}, _registry(config))
    assert got.documents is not None
    assert torch.equal(got.documents[:3], torch.zeros(3, BLOCK, dtype=torch.long))
    alone = step_rows(config, [0, 3, 0], {}, _registry(config))
    assert torch.equal(got.tokens[:3], alone.tokens)  # the pretraining share reads what it reads alone


def test_a_packed_window_trains_on_the_loss_its_examples_have_one_to_a_row():
    config = loads_config(SFT_TEXT.replace("[training]", "[training]\nper_device_batch_size = 2"))
    examples = [task_sft_row("reverse", "train", i) for i in range(6)]
    packed = packed_sft_batch(examples, BLOCK, NEWLINE)
    unpacked = sft_batch(examples, BLOCK, NEWLINE)
    assert packed.tokens.shape[0] < unpacked.tokens.shape[0]
    model = build_model(config, None)
    losses = []
    for batch in (packed, unpacked):
        copied = copy.deepcopy(model)
        result = train_step(
            copied, build_optimizer(copied, config), batch.tokens, batch.loss_mask, documents=batch.documents,
            config=config, lr=0.0, beta=0.0, reference=None, step=0,
        )
        losses.append(result.loss)
        assert result.num_target_tokens == int(unpacked.loss_mask.sum())
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
