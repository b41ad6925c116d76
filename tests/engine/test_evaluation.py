"""Evaluation figures (rewind.engine.step.evaluation): loss and accuracy exactly as before, perplexity and bits
per byte consistent with the loss, accuracy only where there are answers; and their projection into
metrics.jsonl / TensorBoard (rewind.stores.metrics), a pure function of the Evaluated event."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rewind.engine.data.datasets import BuiltinDataset
from rewind.engine.data.tokenizer import ByteTokenizer
from rewind.engine.model.model import GPT
from rewind.engine.step.evaluation import Evaluation, evaluate, evaluate_dataset, validate
from rewind.kernels.losses import fused_losses
from rewind.states.config_reading import config_from_dict
from rewind.states.events import Evaluated
from rewind.stores.metrics import project

BLOCK_SIZE = 24  # the smallest that holds an `add` example


@pytest.fixture(scope="module")
def config():
    return config_from_dict(
        {
            "architecture": {"block_size": BLOCK_SIZE, "vocab_size": 256, "num_layers": 1, "num_heads": 2, "d_model": 32},
            "training": {
                "batch_size": 4,
                "tokens": [192],
                "datasets": [[{"name": "grammar", "rate": 0.5}, {"name": "add", "rate": 0.5}]],
                "evaluations": ["grammar", "add"],
                "eval_samples": 10,  # not a multiple of the batch: a short last batch
            },
            "logging": {"validation_interval": 2},
        }
    )


@pytest.fixture(scope="module")
def datasets():
    return {name: BuiltinDataset(name, BLOCK_SIZE, 256) for name in ("grammar", "add")}


@pytest.fixture(scope="module")
def model(config):
    return GPT(config.architecture, seed=1)


def reference_score(model, dataset, indices, rows) -> tuple[float, float]:
    """The figures as rewind computed them before bits per byte existed (engine/step/evaluation.py `_score`,
    kept verbatim): loss and accuracy must stay these, bit for bit, so old and new runs compare."""
    total_nll = 0.0
    num_correct = num_tokens = 0
    with torch.no_grad():
        for start in range(0, len(indices), rows):
            tokens, mask = dataset.batch("validation", indices[start : start + rows])
            count = int(mask.sum())
            if count == 0:
                continue
            losses = fused_losses(model(tokens[:, :-1]), tokens[:, 1:], mask, count)
            total_nll += float(losses.ce) * count
            num_correct += int(losses.num_correct)
            num_tokens += count
    return total_nll / num_tokens, num_correct / num_tokens


def test_loss_and_accuracy_are_bitwise_what_they_were(model, datasets, config):
    model.eval()
    result = evaluate(model, datasets, config)
    for name in ("grammar", "add"):
        loss, accuracy = reference_score(model, datasets[name], np.arange(10), 4)
        assert result.losses[name] == loss  # ==, not approx
        if datasets[name].has_answers:
            assert result.scores[name] == accuracy
    want = {
        name: reference_score(model, datasets[name], (np.arange(2 * 4) + 8) % datasets[name].num_samples("validation"), 4)[0]
        for name in ("grammar", "add")
    }
    assert validate(model, datasets, config, step=2) == want  # round 1 of validation_interval 2


def test_accuracy_only_for_datasets_with_answers(model, datasets, config):
    result = evaluate(model, datasets, config)
    assert set(result.losses) == set(result.perplexities) == {"grammar", "add"}
    assert set(result.scores) == {"add"}  # grammar is running text: next-token accuracy means nothing
    assert 0.0 <= result.scores["add"] <= 1.0
    assert result.bits_per_byte == {}  # no byte table, no bits per byte


def test_perplexity_is_exp_loss_and_bytes_make_bits_per_byte_loss_over_ln2(model, datasets, config):
    result = evaluate(model, datasets, config, ByteTokenizer().token_num_bytes())
    for name, loss in result.losses.items():
        assert 0.0 < loss < 10.0
        assert result.perplexities[name] == math.exp(loss)
        # One byte per token: bits per byte is the loss in bits, exactly.
        assert result.bits_per_byte[name] == loss / math.log(2)


def test_bits_per_byte_counts_the_bytes_the_targets_stand_for(model, datasets, config):
    dataset = datasets["add"]
    plain = evaluate_dataset(model, dataset, config, 10)
    assert plain.bits_per_byte is None and plain.num_bytes == 0
    two_bytes = evaluate_dataset(model, dataset, config, 10, np.full(256, 2))
    assert two_bytes.num_bytes == 2 * two_bytes.num_tokens
    assert two_bytes.bits_per_byte == pytest.approx(plain.loss / math.log(2) / 2, rel=1e-12)
    # Ids past the table stand for no bytes: with 11 entries, of the answers' digits and newlines only
    # the newline (10) counts.
    short = evaluate_dataset(model, dataset, config, 10, np.ones(11, dtype=np.int64))
    tokens, mask = dataset.batch("validation", np.arange(10))
    assert 0 < short.num_bytes == int((tokens[:, 1:][mask] == 10).sum()) < short.num_tokens
    assert short.bits_per_byte == pytest.approx(plain.loss * plain.num_tokens / short.num_bytes / math.log(2))
    # No byte at all: no figure rather than a division by zero.
    assert evaluate_dataset(model, dataset, config, 10, np.zeros(256, dtype=np.int64)).bits_per_byte is None


def test_evaluation_leaves_the_model_in_its_mode_and_fills_the_event(model, datasets, config):
    model.train()
    result = evaluate(model, datasets, config, ByteTokenizer().token_num_bytes())
    assert model.training
    assert isinstance(result, Evaluation)
    event = Evaluated(
        step=3, tokens=96, boundary=0, scores=result.scores, losses=result.losses, bits_per_byte=result.bits_per_byte
    )
    assert event.scores == {"add": result.scores["add"]}


def test_the_projection_derives_perplexity_and_records_bits_per_byte():
    event = Evaluated(
        step=3,
        tokens=96,
        boundary=0,
        scores={"add": 0.25},
        losses={"grammar": 2.0, "add": 1.0, "huge": 1000.0},
        bits_per_byte={"grammar": 2.0 / math.log(2)},
    )
    record, scalars = project(event)
    assert record["perplexity"] == {"add": math.exp(1.0), "grammar": math.exp(2.0), "huge": math.inf}
    assert list(record["perplexity"]) == ["add", "grammar", "huge"]  # sorted, like every nested dict
    assert record["bits_per_byte"] == {"grammar": 2.0 / math.log(2)}
    tags = dict(scalars)
    assert tags["eval/add/accuracy"] == 0.25 and "eval/grammar/accuracy" not in tags
    assert tags["eval/add/perplexity"] == math.exp(1.0)
    assert tags["eval/grammar/bits_per_byte"] == 2.0 / math.log(2) and "eval/add/bits_per_byte" not in tags
    # A log written before bits per byte existed projects with none, and the same perplexities.
    old_record, _ = project(Evaluated(step=3, tokens=96, boundary=0, scores={}, losses={"add": 1.0}))
    assert old_record["bits_per_byte"] == {} and old_record["perplexity"] == {"add": math.exp(1.0)}
    assert project(event) == (record, scalars)  # a pure function: a rebuild gives the same
