"""Incremental decoding (rewind.engine.model.attention_inputs.KVCache): a prefill of right-padded prompts of
different lengths, then a token per row per call, gives the logits of the model's plain forward over each
row's context, for every block kind, a grown model of several stacks and LoRA-wrapped trunks; a context
that outgrows the block is refused."""

from __future__ import annotations

import msgspec
import pytest
import torch

from rewind.engine.model.attention_inputs import KVCache
from rewind.engine.model.model import GPT
from rewind.states.config import ArchitectureSection
from tests.engine.test_growth import _config, _fresh, _grown, _trained

ARCH = ArchitectureSection(block_size=24, vocab_size=40, num_layers=2, num_heads=2, d_model=16)
LENGTHS = [5, 9, 2]


def prompts(vocab_size: int, lengths=LENGTHS, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def full_last_logits(model, rows: list[list[int]]) -> torch.Tensor:
    """Each row's last-position logits from the plain forward, one row at a time."""
    with torch.no_grad():
        return torch.stack([model(torch.tensor([row]))[0, -1] for row in rows])


def prefill(model, rows: list[list[int]], capacity: int) -> tuple[KVCache, torch.Tensor]:
    lengths = torch.tensor([len(r) for r in rows])
    padded = torch.full((len(rows), int(lengths.max())), 7)  # the padding: its value must not matter
    for i, row in enumerate(rows):
        padded[i, : len(row)] = torch.tensor(row)
    cache = KVCache(len(rows), capacity)
    with torch.no_grad():
        logits = model(padded, cache=cache, valid=lengths)
    return cache, logits[torch.arange(len(rows)), lengths - 1]


def assert_decoding_matches(model, vocab_size: int, steps: int = 6) -> None:
    rows = prompts(vocab_size)
    cache, logits = prefill(model, rows, max(LENGTHS) + steps)
    assert cache.lengths.tolist() == LENGTHS
    expected = full_last_logits(model, rows)
    assert expected.abs().max() > 0.1
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        new = torch.randint(0, vocab_size, (len(rows),), generator=generator)
        rows = [[*row, int(t)] for row, t in zip(rows, new, strict=True)]
        with torch.no_grad():
            logits = model(new[:, None], cache=cache)[:, -1]
        torch.testing.assert_close(logits, full_last_logits(model, rows), rtol=1e-5, atol=1e-5)
    assert cache.lengths.tolist() == [n + steps for n in LENGTHS]


@pytest.mark.parametrize("norm", ["rmsnorm", "layernorm"])
@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
def test_cached_decoding_gives_the_full_forwards_logits(norm, mlp):
    arch = msgspec.structs.replace(ARCH, norm=norm, mlp=mlp)
    model = GPT(arch, [1, 2], seed=3, stack_ids=[1, 0]).eval()  # several stacks, not in id order
    assert_decoding_matches(model, arch.vocab_size)


@pytest.mark.parametrize("trunk", ["frozen", "lora"])
def test_a_grown_model_with_a_frozen_or_lora_trunk_decodes_as_it_computes(tmp_path, trunk):
    config = _config(f'init = "random"\nposition = "append"\ntrunk = "{trunk}"\nnum_blocks = 1')
    parts = _fresh(config, tmp_path)
    vocab_size, block_size = config.architecture.vocab_size, config.architecture.block_size
    tokens = torch.randint(0, vocab_size, (4, block_size + 1), generator=torch.Generator().manual_seed(3))
    grown, _ = _grown(_trained(parts, tokens), config)
    model = grown.model.eval()
    assert len(model.order) == 2
    if trunk == "lora":
        assert any(".lora_A." in name for name, _ in model.named_parameters())
    assert_decoding_matches(model, vocab_size)


def test_rows_are_independent_and_the_cache_is_the_callers():
    """A row decodes the same alone or beside others, and two caches in turn never mix: the model
    keeps no decoding state of its own."""
    model = GPT(ARCH, seed=4).eval()
    names = set(dict(model.named_buffers())) | set(dict(model.named_parameters()))
    rows = prompts(ARCH.vocab_size)
    both, both_logits = prefill(model, rows, 12)
    alone, alone_logits = prefill(model, rows[1:2], 12)
    torch.testing.assert_close(both_logits[1:2], alone_logits, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        step_both = model(torch.tensor([[1], [2], [3]]), cache=both)[:, -1]
        step_alone = model(torch.tensor([[2]]), cache=alone)[:, -1]
    torch.testing.assert_close(step_both[1:2], step_alone, rtol=1e-5, atol=1e-5)
    kept = both.select(torch.tensor([1]))
    with torch.no_grad():
        after_select = model(torch.tensor([[5]]), cache=kept)[:, -1]
        after_alone = model(torch.tensor([[5]]), cache=alone)[:, -1]
    torch.testing.assert_close(after_select, after_alone, rtol=1e-5, atol=1e-5)
    assert both.lengths.tolist() == [6, 10, 3] and kept.lengths.tolist() == [11]
    assert set(dict(model.named_buffers())) | set(dict(model.named_parameters())) == names


def test_a_context_beyond_the_block_or_the_cache_is_refused():
    model = GPT(ARCH, seed=4).eval()
    with pytest.raises(ValueError, match="exceeds block_size 24"):
        model(torch.zeros(1, 3, dtype=torch.long), cache=KVCache(1, ARCH.block_size + 1))
    cache = KVCache(2, 8)
    with torch.no_grad():
        model(torch.zeros(2, 6, dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match="context of 9 tokens exceeds the cache's 8"):
            model(torch.zeros(2, 3, dtype=torch.long), cache=cache)
    assert cache.lengths.tolist() == [6, 6]  # a refused call appends nothing
    with pytest.raises(ValueError, match="3 rows of tokens for a cache of 2 rows"):
        model(torch.zeros(3, 1, dtype=torch.long), cache=cache)


def test_a_cache_serves_no_portion_packed_rows_or_dropout():
    cache = KVCache(1, 8)
    idx = torch.zeros(1, 2, dtype=torch.long)
    model = GPT(ARCH, seed=4).eval()
    with pytest.raises(ValueError, match="a cache serves whole-model forwards"):
        model(idx, cache=cache, portion="trunk")
    with pytest.raises(ValueError, match="a cache serves whole-model forwards"):
        model(idx, cache=cache, documents=torch.zeros(1, 2, dtype=torch.long))
    dropping = GPT(msgspec.structs.replace(ARCH, dropout=0.1), seed=4).train()
    with pytest.raises(ValueError, match="without dropout"):
        dropping(idx, cache=cache, dropout_seed=1)
    assert cache.lengths.tolist() == [0]
