"""Packed rows (`forward(..., documents=...)`): each document of a row attends only within itself with its
positions restarting at 0, so it computes what it computes alone, its loss too (token sum over token count);
a masked objective's documents attend both ways within themselves; a malformed `documents` is refused."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch
import torch.nn.functional as F

from rewind.engine.model.attention_inputs import document_positions, rope_and_mask
from rewind.engine.model.model import GPT
from rewind.states.config import ArchitectureSection

ARCH = ArchitectureSection(block_size=16, vocab_size=32, num_layers=2, num_heads=2, d_model=16)
DOCUMENT_LENGTHS = [4, 7, 5]


def packed(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """A row of three documents (tokens, document of each position) and the documents alone."""
    generator = torch.Generator().manual_seed(seed)
    alone = [torch.randint(0, ARCH.vocab_size, (n,), generator=generator) for n in DOCUMENT_LENGTHS]
    documents = torch.cat([torch.full((n,), k) for k, n in enumerate(DOCUMENT_LENGTHS)])
    return torch.cat(alone)[None], documents[None], alone


def spans() -> list[slice]:
    starts = [sum(DOCUMENT_LENGTHS[:k]) for k in range(len(DOCUMENT_LENGTHS))]
    return [slice(s, s + n) for s, n in zip(starts, DOCUMENT_LENGTHS, strict=True)]


@pytest.mark.parametrize("norm", ["rmsnorm", "layernorm"])
@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
@pytest.mark.parametrize("causal", [True, False])
def test_each_document_of_a_packed_row_computes_what_it_computes_alone(norm, mlp, causal):
    model = GPT(msgspec.structs.replace(ARCH, norm=norm, mlp=mlp), [1, 1], seed=2).eval()
    model.causal = causal  # False: a masked objective's attention, block-diagonal without the causal part
    tokens, documents, alone = packed()
    with torch.no_grad():
        together = model(tokens, documents=documents)[0]
        plain = model(tokens)[0]
        for span, document in zip(spans(), alone, strict=True):
            torch.testing.assert_close(together[span], model(document[None])[0], rtol=1e-5, atol=1e-5)
    # The packing matters: without `documents` the later documents see the earlier ones.
    assert not torch.allclose(together[spans()[1]], plain[spans()[1]], atol=1e-3)


def test_the_packed_loss_is_the_unpacked_loss():
    """Token sum over token count: the label that crosses a document boundary is masked (ignored)."""
    model = GPT(ARCH, seed=3).eval()
    tokens, documents, alone = packed(seed=1)
    inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()
    labels[documents[:, 1:] != documents[:, :-1]] = -100
    logits = model(inputs, documents=documents[:, :-1])
    packed_loss = F.cross_entropy(logits[0], labels[0], ignore_index=-100)
    sums = [F.cross_entropy(model(d[None, :-1])[0], d[1:], reduction="sum") for d in alone]
    count = sum(n - 1 for n in DOCUMENT_LENGTHS)
    assert int((labels != -100).sum()) == count
    torch.testing.assert_close(packed_loss, sum(sums) / count, rtol=1e-5, atol=1e-6)
    (packed_grad,) = torch.autograd.grad(packed_loss, model.head.weight)
    (plain_grad,) = torch.autograd.grad(sum(sums) / count, model.head.weight)
    torch.testing.assert_close(packed_grad, plain_grad, rtol=1e-4, atol=1e-6)


def test_one_document_is_the_plain_row_and_training_features_work_with_documents():
    """A row that is one document computes the plain forward's logits; dropout (keyed) and activation
    checkpointing (which recomputes with the same mask) give the same gradients."""
    tokens, _, _ = packed()
    one = torch.zeros_like(tokens)
    model = GPT(ARCH, seed=3).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, documents=one), model(tokens), rtol=1e-5, atol=1e-5)
    _, documents, _ = packed()
    grads = []
    for checkpointing in (False, True):
        arch = msgspec.structs.replace(ARCH, dropout=0.1, activation_checkpointing=checkpointing)
        model = GPT(arch, seed=3).train()
        model(tokens, documents=documents, dropout_seed=9).square().mean().backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


@pytest.mark.parametrize(
    "documents, message",
    [
        (torch.tensor([[0, 0, 1, 0, 1, 1]]), "non-decreasing"),
        (torch.tensor([[0.0, 0, 1, 1, 1, 1]]), "integer tensor"),
        (torch.tensor([[0, 0, 1, 1, 1]]), r"documents has shape \(1, 5\), the tokens \(1, 6\)"),
        (torch.tensor([0, 0, 1, 1, 1, 1]), r"documents has shape \(6,\), the tokens \(1, 6\)"),
    ],
)
def test_malformed_documents_are_refused(documents, message):
    with pytest.raises(ValueError, match=message):
        GPT(ARCH)(torch.zeros(1, 6, dtype=torch.long), documents=documents)


def test_positions_restart_at_each_documents_first_position():
    """(RoPE depends only on the distance between positions, so the logits cannot tell; the rotations can.)"""
    documents = torch.tensor([[0, 0, 0, 1, 1, 2], [0, 1, 1, 1, 1, 1]])
    expected = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 0, 1, 2, 3, 4]])
    assert torch.equal(document_positions(documents), expected)
    model = GPT(ARCH)
    cos, sin, mask = rope_and_mask((model.rope_cos, model.rope_sin), (2, 6), True, documents, None)
    assert torch.equal(cos[:, 0], model.rope_cos[expected]) and torch.equal(
        sin[:, 0], model.rope_sin[expected]
    )
    allowed = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                            [0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 1]], dtype=torch.bool)  # fmt: skip
    assert torch.equal(mask[0, 0] == 0, allowed) and mask[0, 0][~allowed].eq(-math.inf).all()
