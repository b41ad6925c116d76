"""Post-training examples as token rows: the end token in the loss, padding told apart by position, packing that keeps
every target and its context, the preference layout, and GRPO's prompts and completion rows."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rewind.engine.data.example_batches import (
    completion_batch,
    packed_row_count,
    packed_sft_batch,
    preference_batch,
    prompt_tokens,
    sft_batch,
)
from rewind.engine.data.examples import PreferenceRow, PromptRow, SftRow

END = 9


def test_the_end_token_is_a_target_and_padding_is_not_even_with_the_same_id():
    batch = sft_batch([SftRow((5, 6), (7,)), SftRow((5,), ())], block_size=6, end_id=END, pad_id=END)
    assert batch.tokens.tolist() == [[5, 6, 7, END, END, END, END], [5, END, END, END, END, END, END]]
    # Targets 6, 7, END, pad...: the response's 7 and its END count, the padding ENDs after them do not.
    assert batch.loss_mask.tolist() == [[False, True, True, False, False, False], [True] + [False] * 5]
    assert (
        batch.tokens.dtype == torch.int64 and batch.loss_mask.dtype == torch.bool and batch.documents is None
    )


def test_a_long_example_keeps_its_end_left_truncated():
    batch = sft_batch([SftRow((1, 2, 3, 4, 5), (6, 7))], block_size=4, end_id=END)
    assert batch.tokens.tolist() == [[4, 5, 6, 7, END]]
    assert batch.loss_mask.tolist() == [[False, True, True, True]]
    batch = sft_batch(
        [SftRow((1,), (2, 3, 4, 5, 6, 7))], block_size=3, end_id=END
    )  # the response alone too long
    assert batch.tokens.tolist() == [[5, 6, 7, END]] and batch.loss_mask.tolist() == [[True, True, True]]


def test_packing_fills_windows_in_order_without_cutting_a_row():
    rows = [SftRow((1, 2), (3,)), SftRow((4,), (5,)), SftRow((6, 6, 6), (7,))]
    batch = packed_sft_batch(rows, block_size=7, end_id=END, pad_id=0)
    # 4 + 3 tokens fill 7 of 8; the third row's 5 start the next window.
    assert batch.tokens.tolist() == [[1, 2, 3, END, 4, 5, END, 0], [6, 6, 6, 7, END, 0, 0, 0]]
    assert batch.documents.tolist() == [[0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 1, 1]]
    assert batch.documents.dtype == torch.int64
    assert batch.loss_mask.tolist() == [
        [False, True, True, False, True, True, False],  # target 4 would cross into the second row: masked
        [False, False, True, True, False, False, False],
    ]  # fmt: skip


def targets_in_context(tokens: torch.Tensor, mask: torch.Tensor, documents: torch.Tensor | None) -> Counter:
    """Each masked target with every token before it in its own document (its row, unpacked)."""
    found = Counter()
    for row, position in mask.nonzero().tolist():
        start = 0 if documents is None else int((documents[row] == documents[row, position]).nonzero()[0])
        found[(int(tokens[row, position + 1]), tuple(tokens[row, start : position + 1].tolist()))] += 1
    return found


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 12), st.integers(0, 12)), min_size=1, max_size=10),
    st.integers(1, 24),
)
def test_packed_rows_hold_exactly_the_targets_of_unpacked_ones(lengths, block_size):
    # Row r's tokens are 100 (r + 1) + j: where each row went is plain. The pad id is the end token's.
    rows = [
        SftRow(tuple(100 * (r + 1) + j for j in range(p)), tuple(100 * (r + 1) + 50 + j for j in range(n)))
        for r, (p, n) in enumerate(lengths)
    ]
    packed = packed_sft_batch(rows, block_size, end_id=END, pad_id=END)
    unpacked = sft_batch(rows, block_size, end_id=END, pad_id=END)
    assert targets_in_context(packed.tokens, packed.loss_mask, packed.documents) == targets_in_context(
        unpacked.tokens, unpacked.loss_mask, None
    )
    documents = packed.documents
    assert documents.shape == packed.loss_mask.shape == (len(packed.tokens), block_size)
    assert bool((documents[:, 0] == 0).all()) and bool((documents[:, 1:] >= documents[:, :-1]).all())
    steps = documents[:, 1:] - documents[:, :-1]
    assert bool((steps <= 1).all())  # ids 0, 1, 2, ... in each window
    # No target in the mask crosses a boundary (the last position's target is the window's last token).
    crossing = torch.zeros_like(packed.loss_mask)
    crossing[:, :-1] = documents[:, 1:] != documents[:, :-1]
    assert not bool((packed.loss_mask & crossing).any())
    # Rows are never cut: each row's tokens sit in one window, contiguous, in one document; rows in order, and a
    # row opens a window only when it does not fit in what the previous row left.
    width, placed = block_size + 1, []
    for r, row in enumerate(rows):
        kept = [*row.prompt, *row.response, END][-width:]
        where = ((packed.tokens >= 100 * (r + 1)) & (packed.tokens < 100 * (r + 2))).nonzero().tolist()
        windows = {w for w, _ in where}
        assert len(windows) == 1
        (window,) = windows
        first = min(t for _, t in where)
        assert packed.tokens[window, first : first + len(kept)].tolist() == kept
        assert len(set(documents[window, first : min(first + len(kept), block_size)].tolist())) == 1
        placed.append((window, first, first + len(kept)))
    for (w0, _, end0), (w1, start1, end1) in itertools.pairwise(placed):
        assert (w1, start1) == (w0, end0) or (w1 == w0 + 1 and start1 == 0 and end0 + (end1 - start1) > width)
    assert placed[0][:2] == (0, 0) and placed[-1][0] == len(packed.tokens) - 1
    # A step of k windows takes the rows that packing puts in the first k.
    for k in range(len(packed.tokens) + 1):
        assert packed_row_count(rows, block_size, k) == sum(window < k for window, _, _ in placed)


def test_counting_the_rows_of_some_windows_reads_no_further():
    def rows():
        yield SftRow((1, 2), (3,))  # 4 tokens of a window of 6
        yield SftRow((4,), ())  # 2 more: full
        yield SftRow((5,), (6,))  # the next window
        raise AssertionError("read past the row that does not fit")

    assert packed_row_count(rows(), block_size=5, num_windows=1) == 2
    assert packed_row_count([], block_size=5, num_windows=3) == 0


def test_preference_rows_are_chosen_then_rejected():
    rows = [PreferenceRow((1, 2), (3,), (4, 4)), PreferenceRow((5,), (6, 6), (7,))]
    batch = preference_batch(rows, block_size=5, end_id=END)
    chosen = sft_batch([SftRow((1, 2), (3,)), SftRow((5,), (6, 6))], 5, END)
    rejected = sft_batch([SftRow((1, 2), (4, 4)), SftRow((5,), (7,))], 5, END)
    assert torch.equal(batch.tokens, torch.cat([chosen.tokens, rejected.tokens]))
    assert torch.equal(batch.loss_mask, torch.cat([chosen.loss_mask, rejected.loss_mask]))
    assert batch.tokens[2].tolist() == [1, 2, 4, 4, END, 0] and batch.loss_mask[2].tolist() == [0, 1, 1, 1, 0]


def test_prompts_for_sampling_are_left_truncated():
    rows = [PromptRow(0, (1, 2, 3, 4), "abcd", {}), PromptRow(1, (5,), "e", {})]
    assert prompt_tokens(rows, 2) == [[3, 4], [5]]
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        prompt_tokens(rows, 0)


def test_completion_rows_mask_the_completion_and_its_end_and_flag_truncation():
    batch = completion_batch([[1, 2], [3]], [[4, END, 5, 5], [6, 7, 8]], end_id=END, pad_id=END)
    # The first completion ends at its END (the 5s after it are not part of it); the second never ended.
    assert batch.tokens.tolist() == [[1, 2, 4, END], [3, 6, 7, 8]]  # as long as the longest row
    assert batch.completion_mask.tolist() == [[False, True, True], [True, True, True]]
    assert batch.truncated.tolist() == [False, True]
    per_token = torch.zeros(batch.completion_mask.shape)
    per_token[batch.completion_mask] = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5])  # 4, END; 6, 7, 8
    assert per_token[0, 2].item() == pytest.approx(0.2) and batch.tokens[0, 3] == END
    assert per_token[1].tolist() == pytest.approx([0.3, 0.4, 0.5]) and batch.tokens[1, 1:].tolist() == [
        6,
        7,
        8,
    ]
    fixed = completion_batch([[1, 2]], [[END]], end_id=END, block_size=6)
    assert fixed.tokens.tolist() == [[1, 2, END, 0, 0, 0, 0]] and fixed.completion_mask.sum() == 1
    with pytest.raises(ValueError, match="exceed block_size"):
        completion_batch([[1, 2]], [[3, 4]], end_id=END, block_size=2)
    with pytest.raises(ValueError, match="prompts for"):
        completion_batch([[1]], [], end_id=END)
    with pytest.raises(ValueError, match="prompt holds no token"):
        completion_batch([[]], [[1]], end_id=END)
