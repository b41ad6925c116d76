"""Training objectives: clm is today's slicing bit for bit; mlm/diffusion mask only real tokens, with
draws that are a function of (seed, step, global row, purpose) and nothing else."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rewind.engine.data.datasets import BuiltinDataset
from rewind.engine.step.objectives import (
    ObjectiveBatch,
    depth_level,
    eligible_positions,
    is_causal,
    level_rate,
    mask_token_id,
    model_vocab_size,
    num_time_levels,
    objective_batch,
    time_levels,
)
from rewind.states.config import ObjectiveSection


def _replace(objective: ObjectiveSection, **changes) -> ObjectiveSection:
    """A copy with some fields changed (config sections are frozen)."""
    return msgspec.structs.replace(objective, **changes)


def _round_half_up(value: Fraction) -> int:
    """Exact rounding, halves up: the reference for the linear depth map."""
    return math.floor(value + Fraction(1, 2))


VOCAB = 256
MASK = mask_token_id(VOCAB)
MLM = ObjectiveSection(kind="mlm", mask_rate=0.15)
DIFFUSION_INPUT = ObjectiveSection(kind="diffusion", time="input", num_levels=8)
DIFFUSION_DEPTH = ObjectiveSection(kind="diffusion", time="depth", num_levels=8)
MASKED_OBJECTIVES = [MLM, DIFFUSION_INPUT, DIFFUSION_DEPTH]
MASKED_IDS = ["mlm", "diffusion-input", "diffusion-depth"]


def _rows(
    name: str, num_rows: int, block_size: int = 48, start: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Real rows of a built-in dataset: "grammar" is scored everywhere, the packed tasks are padded."""
    return BuiltinDataset(name, block_size, VOCAB).batch("train", range(start, start + num_rows))


def _random_rows(num_rows: int, num_positions: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows scored everywhere with ids spread over the whole vocabulary (id 0 included)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(VOCAB, (num_rows, num_positions + 1), generator=generator)
    return tokens, torch.ones((num_rows, num_positions), dtype=torch.bool)


def _mixed_rows() -> tuple[torch.Tensor, torch.Tensor]:
    """Padded packed rows and fully scored rows in one batch (same block size)."""
    tokens_a, mask_a = _rows("sort", 12)
    tokens_b, mask_b = _rows("grammar", 12)
    return torch.cat([tokens_a, tokens_b]), torch.cat([mask_a, mask_b])


def _assert_well_formed(batch: ObjectiveBatch, tokens: torch.Tensor, loss_mask: torch.Tensor) -> None:
    x = tokens[:, :-1]
    eligible = eligible_positions(loss_mask)
    masked = batch.loss_mask
    assert masked.dtype == torch.bool and masked.shape == x.shape
    assert batch.inputs.dtype == torch.long and batch.targets.dtype == torch.long
    assert not bool((masked & ~eligible).any()), "a padding position was masked"
    assert bool((batch.inputs[masked] == MASK).all())
    assert torch.equal(batch.inputs[~masked], x[~masked])
    assert torch.equal(batch.targets, x)
    # Masked positions are exactly the mask-token positions: data ids never reach MASK.
    assert torch.equal(masked, batch.inputs == MASK)
    assert torch.equal(masked.any(dim=1), eligible.any(dim=1)), "a row with real tokens has no loss"
    assert batch.causal is False


def _concat(batches: list[ObjectiveBatch]) -> ObjectiveBatch:
    levels = [b.levels for b in batches]
    return ObjectiveBatch(
        inputs=torch.cat([b.inputs for b in batches]),
        targets=torch.cat([b.targets for b in batches]),
        loss_mask=torch.cat([b.loss_mask for b in batches]),
        levels=None if levels[0] is None else torch.cat(levels),
        causal=batches[0].causal,
    )


def _assert_same(a: ObjectiveBatch, b: ObjectiveBatch) -> None:
    assert torch.equal(a.inputs, b.inputs)
    assert torch.equal(a.targets, b.targets)
    assert torch.equal(a.loss_mask, b.loss_mask)
    assert (a.levels is None) == (b.levels is None)
    if a.levels is not None:
        assert torch.equal(a.levels, b.levels)
    assert a.causal == b.causal


# --- model-side facts ---------------------------------------------------------------------------------


def test_mask_token_is_one_past_the_vocabulary():
    assert mask_token_id(256) == 256
    assert mask_token_id(50257) == 50257


@pytest.mark.parametrize(
    ("objective", "vocab", "time_rows", "causal"),
    [
        (ObjectiveSection(kind="clm"), 256, 0, True),
        (ObjectiveSection(kind="mlm"), 257, 0, False),
        (ObjectiveSection(kind="diffusion", time="input", num_levels=16), 257, 16, False),
        (ObjectiveSection(kind="diffusion", time="depth", num_levels=16), 257, 0, False),
    ],
)
def test_model_needs(objective, vocab, time_rows, causal):
    assert model_vocab_size(objective, 256) == vocab
    assert num_time_levels(objective) == time_rows
    assert is_causal(objective) is causal


# --- clm ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["grammar", "add"])
def test_clm_is_todays_slicing_bit_for_bit(name):
    tokens, loss_mask = _rows(name, 6)
    batch = objective_batch(ObjectiveSection(kind="clm"), VOCAB, tokens, loss_mask, seed=3, step=7)
    # What engine/step/step.py has always done: inputs, targets = tokens[:, :-1], tokens[:, 1:].
    for got, want in ((batch.inputs, tokens[:, :-1]), (batch.targets, tokens[:, 1:])):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)
        assert got.stride() == want.stride() and got.data_ptr() == want.data_ptr()
    assert batch.loss_mask is loss_mask
    assert batch.levels is None
    assert batch.causal is True


def test_clm_ignores_seed_step_and_stack():
    tokens, loss_mask = _rows("reverse", 4)
    clm = ObjectiveSection(kind="clm")
    a = objective_batch(clm, VOCAB, tokens, loss_mask, seed=0, step=0)
    b = objective_batch(
        clm, VOCAB, tokens, loss_mask, seed=9, step=5, first_row=3, stack_index=1, num_stacks=2
    )
    _assert_same(a, b)


# --- eligibility --------------------------------------------------------------------------------------


def test_eligible_positions_end_at_the_last_scored_token():
    # tokens a b c d PAD PAD PAD PAD; target position 2 scores tokens[3] = d, the row's last real token.
    loss_mask = torch.tensor([[False, False, True, False, False, False, False]])
    assert eligible_positions(loss_mask).tolist() == [[True, True, True, True, False, False, False]]
    # Scoring the last target makes every position of x eligible (its token tokens[T] is not in x).
    assert eligible_positions(torch.tensor([[False, True, False, True]])).all()
    assert eligible_positions(torch.ones((2, 5), dtype=torch.bool)).all()
    assert not eligible_positions(torch.zeros((2, 5), dtype=torch.bool)).any()
    assert eligible_positions(torch.zeros((3, 0), dtype=torch.bool)).shape == (3, 0)


def test_packed_rows_eligible_exactly_on_their_text():
    tokens, loss_mask = _rows("reverse", 16, block_size=64)
    eligible = eligible_positions(loss_mask)
    x = tokens[:, :-1]
    for row in range(tokens.shape[0]):
        text_length = int((tokens[row] != 0).sum())  # byte 0 never occurs in the tasks' text
        assert bool((tokens[row, :text_length] != 0).all()), "padding is only ever trailing"
        assert int(eligible[row].sum()) == min(text_length, x.shape[1])
        assert bool(eligible[row, : min(text_length, x.shape[1])].all())
    assert bool((x[~eligible] == 0).all())


def test_token_id_zero_is_an_ordinary_token_in_fully_scored_rows():
    tokens = torch.zeros((2, 9), dtype=torch.long)  # a user token file may well hold id 0
    loss_mask = torch.ones((2, 8), dtype=torch.bool)
    batch = objective_batch(
        ObjectiveSection(kind="mlm", mask_rate=1.0), VOCAB, tokens, loss_mask, seed=0, step=0
    )
    assert batch.loss_mask.all()


@pytest.mark.parametrize("objective", MASKED_OBJECTIVES, ids=MASKED_IDS)
def test_rate_one_masks_every_real_token_and_no_padding(objective):
    full = _replace(objective, mask_rate=1.0, min_mask_rate=1.0, max_mask_rate=1.0)
    tokens, loss_mask = _mixed_rows()
    batch = objective_batch(full, VOCAB, tokens, loss_mask, seed=1, step=2)
    _assert_well_formed(batch, tokens, loss_mask)
    assert torch.equal(batch.loss_mask, eligible_positions(loss_mask))


def test_rows_scoring_nothing_stay_unmasked():
    tokens, loss_mask = _random_rows(4, 16, seed=0)
    loss_mask[1] = False
    loss_mask[3] = False
    batch = objective_batch(
        ObjectiveSection(kind="mlm", mask_rate=1.0), VOCAB, tokens, loss_mask, seed=0, step=0
    )
    assert batch.loss_mask.any(dim=1).tolist() == [True, False, True, False]
    assert torch.equal(batch.inputs[1], tokens[1, :-1])


# --- masked objectives: invariants and reproducibility ------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    objective=st.sampled_from(MASKED_OBJECTIVES),
    rate=st.floats(0.001, 1.0),
    seed=st.integers(0, 2**40),
    step=st.integers(0, 10**6),
    first_row=st.integers(0, 1000),
)
def test_masked_batches_are_well_formed(objective, rate, seed, step, first_row):
    objective = _replace(objective, mask_rate=rate, min_mask_rate=min(rate, 0.5))
    tokens, loss_mask = _mixed_rows()
    batch = objective_batch(
        objective,
        VOCAB,
        tokens,
        loss_mask,
        seed=seed,
        step=step,
        first_row=first_row,
        stack_index=1,
        num_stacks=3,
    )
    _assert_well_formed(batch, tokens, loss_mask)


def test_a_tiny_rate_still_masks_one_position_per_row():
    tokens, loss_mask = _mixed_rows()
    tiny = ObjectiveSection(kind="mlm", mask_rate=1e-9)
    batch = objective_batch(tiny, VOCAB, tokens, loss_mask, seed=4, step=4)
    _assert_well_formed(batch, tokens, loss_mask)
    assert batch.loss_mask.sum(dim=1).tolist() == [1] * tokens.shape[0]
    # The forced position is spread over the row, not always the first eligible one.
    assert len(set(batch.loss_mask.float().argmax(dim=1).tolist())) > 5


@pytest.mark.parametrize("objective", MASKED_OBJECTIVES, ids=MASKED_IDS)
def test_same_seed_step_and_row_give_the_same_batch(objective):
    tokens, loss_mask = _mixed_rows()
    a = objective_batch(objective, VOCAB, tokens, loss_mask, seed=11, step=5, first_row=2)
    b = objective_batch(objective, VOCAB, tokens.clone(), loss_mask.clone(), seed=11, step=5, first_row=2)
    _assert_same(a, b)


@pytest.mark.parametrize(
    "objective",
    # Capped below 1.0: at rate 1.0 every mask is "all", the same under any draw.
    [MLM, _replace(DIFFUSION_INPUT, max_mask_rate=0.9)],
    ids=["mlm", "diffusion-input"],
)
@pytest.mark.parametrize("change", ["step", "seed", "first_row"])
def test_masks_change_with_step_seed_and_row(objective, change):
    tokens, loss_mask = _random_rows(256, 64, seed=1)
    base = {"seed": 0, "step": 3, "first_row": 0}
    other = dict(base, **{change: base[change] + 1})
    a = objective_batch(objective, VOCAB, tokens, loss_mask, **base)
    b = objective_batch(objective, VOCAB, tokens, loss_mask, **other)
    num_same_rows = int((a.loss_mask == b.loss_mask).all(dim=1).sum())
    # Two independent 64-position masks agree with probability well under 1e-6 per row.
    assert num_same_rows == 0


def test_a_row_gets_a_fresh_mask_every_step():
    tokens, loss_mask = _random_rows(1, 64, seed=2)
    masks = {
        tuple(objective_batch(MLM, VOCAB, tokens, loss_mask, seed=0, step=step).loss_mask[0].tolist())
        for step in range(50)
    }
    assert len(masks) == 50


def test_draws_depend_on_the_global_row_not_the_local_one():
    tokens, loss_mask = _random_rows(6, 32, seed=3)
    whole = objective_batch(DIFFUSION_INPUT, VOCAB, tokens, loss_mask, seed=5, step=9)
    tail = objective_batch(DIFFUSION_INPUT, VOCAB, tokens[4:], loss_mask[4:], seed=5, step=9, first_row=4)
    assert torch.equal(tail.loss_mask, whole.loss_mask[4:])
    assert torch.equal(tail.levels, whole.levels[4:])
    misplaced = objective_batch(DIFFUSION_INPUT, VOCAB, tokens[4:], loss_mask[4:], seed=5, step=9)
    assert not torch.equal(misplaced.loss_mask, whole.loss_mask[4:])


@settings(max_examples=30, deadline=None)
@given(
    objective=st.sampled_from(MASKED_OBJECTIVES),
    cuts=st.lists(st.integers(1, 23), max_size=6, unique=True),
    seed=st.integers(0, 2**31),
    step=st.integers(0, 10**5),
)
def test_micro_batch_splits_give_the_whole_batch(objective, cuts, seed, step):
    tokens, loss_mask = _mixed_rows()
    kwargs = {"seed": seed, "step": step, "stack_index": 0, "num_stacks": 2}
    whole = objective_batch(objective, VOCAB, tokens, loss_mask, **kwargs)
    bounds = [0, *sorted(cuts), tokens.shape[0]]
    parts = [
        objective_batch(objective, VOCAB, tokens[lo:hi], loss_mask[lo:hi], first_row=lo, **kwargs)
        for lo, hi in itertools.pairwise(bounds)
    ]
    _assert_same(_concat(parts), whole)


@pytest.mark.parametrize("objective", MASKED_OBJECTIVES, ids=MASKED_IDS)
def test_global_rng_is_neither_touched_nor_used(objective):
    tokens, loss_mask = _mixed_rows()
    torch.manual_seed(123)
    before = torch.get_rng_state()
    first = objective_batch(objective, VOCAB, tokens, loss_mask, seed=0, step=1)
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(456)
    second = objective_batch(objective, VOCAB, tokens, loss_mask, seed=0, step=1)
    _assert_same(first, second)


def test_mask_stream_golden_value():
    # Pinned: a resumed run must mask exactly what the killed run would have. If this fails, masks
    # of old runs changed; change the derivation only on purpose.
    tokens = torch.zeros((2, 17), dtype=torch.long)
    loss_mask = torch.ones((2, 16), dtype=torch.bool)
    batch = objective_batch(
        ObjectiveSection(kind="mlm", mask_rate=0.5), VOCAB, tokens, loss_mask, seed=0, step=0, first_row=7
    )
    assert [row.nonzero().squeeze(1).tolist() for row in batch.loss_mask] == GOLDEN_MASKED_POSITIONS


GOLDEN_MASKED_POSITIONS = [[0, 2, 7, 8, 10, 15], [2, 5, 6, 7, 8, 10, 12, 15]]


def test_empty_batch_and_empty_rows():
    empty = objective_batch(
        MLM,
        VOCAB,
        torch.zeros((0, 9), dtype=torch.long),
        torch.zeros((0, 8), dtype=torch.bool),
        seed=0,
        step=0,
    )
    assert empty.inputs.shape == empty.loss_mask.shape == (0, 8)
    short = objective_batch(
        DIFFUSION_INPUT,
        VOCAB,
        torch.ones((3, 1), dtype=torch.long),
        torch.zeros((3, 0), dtype=torch.bool),
        seed=0,
        step=0,
    )
    assert short.inputs.shape == (3, 0) and short.levels.shape == (3,)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("objective", MASKED_OBJECTIVES, ids=MASKED_IDS)
def test_cuda_rows_get_the_cpu_draws_on_their_device(objective):
    tokens, loss_mask = _mixed_rows()
    on_cpu = objective_batch(objective, VOCAB, tokens, loss_mask, seed=2, step=3)
    on_cuda = objective_batch(objective, VOCAB, tokens.cuda(), loss_mask.cuda(), seed=2, step=3)
    for tensor in (on_cuda.inputs, on_cuda.targets, on_cuda.loss_mask):
        assert tensor.is_cuda
    _assert_same(
        on_cpu,
        ObjectiveBatch(
            inputs=on_cuda.inputs.cpu(),
            targets=on_cuda.targets.cpu(),
            loss_mask=on_cuda.loss_mask.cpu(),
            levels=None if on_cuda.levels is None else on_cuda.levels.cpu(),
            causal=on_cuda.causal,
        ),
    )


# --- mask rates -----------------------------------------------------------------------------------------


def test_mlm_empirical_rate_is_the_mask_rate():
    tokens, loss_mask = _random_rows(400, 64, seed=4)  # 25,600 eligible positions
    for rate in (0.15, 0.5):
        objective = ObjectiveSection(kind="mlm", mask_rate=rate)
        batch = objective_batch(objective, VOCAB, tokens, loss_mask, seed=2, step=0)
        # sd = sqrt(0.25 / 25600) ~ 0.003 at worst; the forced positions add < 1e-4 at these rates.
        assert abs(float(batch.loss_mask.float().mean()) - rate) < 0.015


def test_depth_diffusion_masks_at_the_stack_level_rate():
    tokens, loss_mask = _random_rows(400, 64, seed=5)
    objective = ObjectiveSection(
        kind="diffusion", time="depth", num_levels=5, min_mask_rate=0.1, max_mask_rate=0.9
    )
    for stack_index, want in ((0, 0.9), (2, 0.5), (4, 0.1)):
        batch = objective_batch(
            objective, VOCAB, tokens, loss_mask, seed=1, step=0, stack_index=stack_index, num_stacks=5
        )
        assert batch.levels is None
        assert abs(float(batch.loss_mask.float().mean()) - want) < 0.015


def test_input_diffusion_masks_each_row_at_its_level_rate():
    tokens, loss_mask = _random_rows(2000, 64, seed=6)
    objective = ObjectiveSection(
        kind="diffusion", time="input", num_levels=4, min_mask_rate=0.1, max_mask_rate=1.0
    )
    batch = objective_batch(objective, VOCAB, tokens, loss_mask, seed=3, step=1)
    assert batch.levels is not None and batch.levels.dtype == torch.long
    for level in range(4):
        rows = batch.levels == level
        rate = float(batch.loss_mask[rows].float().mean())
        assert abs(rate - level_rate(objective, level)) < 0.02
    assert bool(batch.loss_mask[batch.levels == 3].all()), "rate 1.0 masks every real token"


# --- levels ---------------------------------------------------------------------------------------------


@given(
    num_levels=st.integers(2, 64),
    low=st.floats(0.001, 1.0),
    high=st.floats(0.001, 1.0),
)
def test_level_rate_endpoints_and_monotone(num_levels, low, high):
    low, high = min(low, high), max(low, high)
    objective = ObjectiveSection(
        kind="diffusion", num_levels=num_levels, min_mask_rate=low, max_mask_rate=high
    )
    rates = [level_rate(objective, level) for level in range(num_levels)]
    assert rates[0] == low and rates[-1] == high
    assert all(a <= b for a, b in itertools.pairwise(rates))
    gaps = [b - a for a, b in itertools.pairwise(rates)]
    assert max(gaps) - min(gaps) <= 1e-12  # evenly spaced


def test_level_rate_refuses_levels_out_of_range():
    objective = ObjectiveSection(kind="diffusion", num_levels=4)
    for level in (-1, 4):
        with pytest.raises(ValueError, match="outside"):
            level_rate(objective, level)


@pytest.mark.parametrize("num_levels", [2, 3, 8, 16])
def test_linear_depth_covers_every_level_when_stacks_equal_levels(num_levels):
    objective = ObjectiveSection(kind="diffusion", time="depth", num_levels=num_levels, depth_map="linear")
    levels = [depth_level(objective, i, num_levels) for i in range(num_levels)]
    # The stack nearest the input sees the most masking.
    assert levels == list(range(num_levels - 1, -1, -1))


@pytest.mark.parametrize("depth_map", ["linear", "exponential"])
def test_one_stack_trains_at_the_top_level(depth_map):
    objective = ObjectiveSection(kind="diffusion", time="depth", num_levels=16, depth_map=depth_map)
    assert depth_level(objective, 0, 1) == 15


@settings(max_examples=200)
@given(
    depth_map=st.sampled_from(["linear", "exponential"]),
    num_levels=st.integers(2, 40),
    num_stacks=st.integers(2, 40),
    low=st.floats(0.001, 1.0),
    high=st.floats(0.001, 1.0),
)
def test_depth_levels_span_the_range_and_fall_with_stack_index(depth_map, num_levels, num_stacks, low, high):
    low, high = min(low, high), max(low, high)
    objective = ObjectiveSection(
        kind="diffusion",
        time="depth",
        num_levels=num_levels,
        min_mask_rate=low,
        max_mask_rate=high,
        depth_map=depth_map,
    )
    levels = [depth_level(objective, i, num_stacks) for i in range(num_stacks)]
    assert levels[0] == num_levels - 1 and levels[-1] == 0  # the full range, not two levels
    assert all(a >= b for a, b in itertools.pairwise(levels))
    if depth_map == "linear":
        assert levels == [
            _round_half_up(Fraction((num_stacks - 1 - i) * (num_levels - 1), num_stacks - 1))
            for i in range(num_stacks)
        ]
        if num_stacks >= num_levels:
            assert set(levels) == set(range(num_levels))


def test_exponential_depth_rates_grow_geometrically():
    objective = ObjectiveSection(
        kind="diffusion",
        time="depth",
        num_levels=16,
        min_mask_rate=0.05,
        max_mask_rate=1.0,
        depth_map="exponential",
    )
    levels = [depth_level(objective, i, 16) for i in range(16)]
    assert levels == [15, 12, 10, 8, 6, 5, 4, 3, 2, 2, 1, 1, 1, 0, 0, 0]
    linear = ObjectiveSection(
        kind="diffusion", time="depth", num_levels=16, min_mask_rate=0.05, max_mask_rate=1.0
    )
    # The geometric curve lies below the chord: never more masking than the linear map.
    assert all(
        e <= line for e, line in zip(levels, [depth_level(linear, i, 16) for i in range(16)], strict=True)
    )
    # Each stack's level is the one whose rate is nearest to min * (max / min) ** f.
    for i, level in enumerate(levels):
        target = 0.05 * 20.0 ** ((15 - i) / 15)
        nearest = min(range(16), key=lambda lv: abs(level_rate(objective, lv) - target))
        assert level == nearest


def test_depth_level_refuses_stacks_out_of_range():
    objective = ObjectiveSection(kind="diffusion", time="depth")
    for stack_index, num_stacks in ((-1, 2), (2, 2), (0, 0)):
        with pytest.raises(ValueError):
            depth_level(objective, stack_index, num_stacks)


def test_time_levels_are_uniform_and_reproducible():
    objective = ObjectiveSection(kind="diffusion", time="input", num_levels=8)
    levels = time_levels(objective, seed=0, step=3, first_row=0, num_rows=8000)
    assert levels.dtype == torch.long and int(levels.min()) >= 0 and int(levels.max()) <= 7
    counts = torch.bincount(levels, minlength=8).tolist()
    # 1000 expected per level, sd ~ 30: a loose +-15% bound.
    assert all(850 <= count <= 1150 for count in counts), counts
    chi_square = sum((count - 1000) ** 2 / 1000 for count in counts)
    assert chi_square < 30  # 7 degrees of freedom: p < 1e-4
    again = time_levels(objective, seed=0, step=3, first_row=0, num_rows=8000)
    assert torch.equal(levels, again)
    assert not torch.equal(levels, time_levels(objective, seed=0, step=4, first_row=0, num_rows=8000))


# --- bad input --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens_shape", "mask_shape"),
    [((4, 9), (4, 9)), ((4, 9), (3, 8)), ((9,), (8,)), ((4, 9), (4, 8, 1)), ((4, 0), (4, 0))],
)
def test_shapes_that_disagree_are_refused(tokens_shape, mask_shape):
    tokens = torch.zeros(tokens_shape, dtype=torch.long)
    loss_mask = torch.ones(mask_shape, dtype=torch.bool)
    for objective in (ObjectiveSection(kind="clm"), *MASKED_OBJECTIVES):
        with pytest.raises(ValueError) as info:
            objective_batch(objective, VOCAB, tokens, loss_mask, seed=0, step=0)
        assert "\n" not in str(info.value)


@pytest.mark.parametrize(("stack_index", "num_stacks"), [(-1, 2), (2, 2), (0, 0)])
def test_stack_out_of_range_is_refused(stack_index, num_stacks):
    tokens, loss_mask = _random_rows(2, 8, seed=0)
    with pytest.raises(ValueError, match="stack_index"):
        objective_batch(
            DIFFUSION_DEPTH,
            VOCAB,
            tokens,
            loss_mask,
            seed=0,
            step=0,
            stack_index=stack_index,
            num_stacks=num_stacks,
        )


def test_unknown_kind_and_negative_first_row_are_refused():
    tokens, loss_mask = _random_rows(2, 8, seed=0)
    with pytest.raises(ValueError, match=r"objective\.kind"):
        objective_batch(ObjectiveSection(kind="bert"), VOCAB, tokens, loss_mask, seed=0, step=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="first_row"):
        objective_batch(MLM, VOCAB, tokens, loss_mask, seed=0, step=0, first_row=-1)
