"""Training objectives: turn one step's rows into what the model reads, what it predicts, and where
the loss counts.

- "clm": next-token prediction, exactly the slicing `rewind.engine.step.step` has always done (inputs are
  tokens[:, :-1], targets tokens[:, 1:], the data's loss mask), causal attention.
- "mlm": the sequence x = tokens[:, :-1] with a random subset of its real tokens replaced by a mask
  token (one id past the data's vocabulary); the model, attending both ways, predicts the original
  tokens at the masked positions, and only there does the loss count.
- "diffusion": masked diffusion, i.e. mlm whose mask rate is a noise level. With time = "input" each
  row draws its level and the model is told it (a learned time embedding, `levels`); with
  time = "depth" the level is set by which stack is being trained, so depth plays the role of time.

Eligible positions. A row of the data format (`rewind.engine.data.datasets`) is real tokens followed by
optional trailing padding (the packed tasks fill the rest of the row with byte 0); padding is never
scored, and every real example ends on a scored target (its answer's newline). So a row's real tokens
are x[0 .. e], where tokens[e] is the last scored target (loss_mask[e - 1]), and nothing after it.
This is decided from the loss mask, never from token values: in a user's token file id 0 is an
ordinary token. Rows whose loss mask is all False have no eligible position and are left unmasked.
Rows scored everywhere (the grammar, user files) are eligible everywhere.

Randomness. Row r of a step's batch draws its mask from `torch_generator(seed, "mask", step, r)` and
its time level from `torch_generator(seed, "time", step, r)`, with r the row's global index in the
step's batch (`first_row` + local index). So a row's draws depend on (seed, step, row, purpose)
only: the same under any split into micro-batches, the same on a resumed run, fresh every step, and
never taken from torch's global RNG. Each position draws u ~ U[0, 1) (float64) and is masked when
eligible and u < rate; a row with eligible positions but none masked masks the eligible position of
smallest u (uniform over the eligible positions, and no extra draw), so every such row has a loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rewind.engine.model.rng import torch_generator
from rewind.states.check_continuation import is_causal as is_causal  # (re-exported: its home)
from rewind.states.check_continuation import model_vocab_size as model_vocab_size
from rewind.states.check_continuation import num_time_levels as num_time_levels
from rewind.states.config import ObjectiveSection

MASK_PURPOSE = "mask"
TIME_PURPOSE = "time"
OBJECTIVE_KINDS = ("clm", "mlm", "diffusion")


def mask_token_id(vocab_size: int) -> int:
    """The mask token: one id past the data's vocabulary (the model gets one extra embedding row and
    logit for it when the objective masks). Data ids are in [0, vocab_size), so it never collides."""
    return vocab_size


def level_rate(objective: ObjectiveSection, level: int) -> float:
    """Mask rate of diffusion level `level`: evenly spaced from min_mask_rate (level 0) to
    max_mask_rate (level num_levels - 1), both endpoints exact, non-decreasing in the level."""
    num_levels = objective.num_levels
    if num_levels < 2:
        raise ValueError(f"objective.num_levels must be >= 2, got {num_levels}")
    if not 0 <= level < num_levels:
        raise ValueError(f"diffusion level {level} is outside [0, {num_levels})")
    low, high = objective.min_mask_rate, objective.max_mask_rate
    if level == num_levels - 1:
        return high  # exactly, not low + (high - low), which may miss it by an ulp
    # low + d * f rounds monotonically in f, and the min() keeps float rounding from crossing the top.
    return min(high, low + (high - low) * level / (num_levels - 1))


def _round_half_up(numerator: int, denominator: int) -> int:
    """round(numerator / denominator) with halves rounded up, in exact integer arithmetic."""
    return (2 * numerator + denominator) // (2 * denominator)


def depth_level(objective: ObjectiveSection, stack_index: int, num_stacks: int) -> int:
    """The diffusion level stack `stack_index` (0 = input side) of `num_stacks` trains at, with
    time = "depth".

    Direction: the stack nearest the input trains at the top level (most masking) and the stack
    nearest the output at level 0 (least). A forward pass then reads like the reverse diffusion
    process: the input is the noisiest state, and each stack further up is one more denoising step
    towards clean tokens. A one-stack model is the whole chain, so it starts from the top level.

    With f = (num_stacks - 1 - stack_index) / (num_stacks - 1) (f = 1 for a single stack), L levels:
    - linear: level = round(f * (L - 1)), halves up, in exact integer arithmetic. With num_stacks == L
      this is L - 1 - stack_index: every level exactly once.
    - exponential: the mask rate grows geometrically across stacks, from min_mask_rate at the output
      side to max_mask_rate at the input side: the target rate is min * (max / min) ** f, and the
      stack trains at the level whose rate is nearest to it,
          level = round((L - 1) * ((max / min) ** f - 1) / (max / min - 1)),  halves up.
      Both ends are exact (f = 0 -> 0, f = 1 -> L - 1); in between the geometric curve lies below the
      linear one, so more stacks train at light masking. When min == max every level has the same
      rate and the linear map is used. Unlike linear, it cannot hit every level with num_stacks == L
      (a non-increasing map of L stacks onto all L levels is the linear one); levels repeat near 0.
    """
    if num_stacks < 1:
        raise ValueError(f"num_stacks must be >= 1, got {num_stacks}")
    if not 0 <= stack_index < num_stacks:
        raise ValueError(f"stack_index {stack_index} is outside [0, {num_stacks})")
    num_levels = objective.num_levels
    if num_levels < 2:
        raise ValueError(f"objective.num_levels must be >= 2, got {num_levels}")
    top = num_levels - 1
    if num_stacks == 1:
        return top
    from_output = num_stacks - 1 - stack_index
    low, high = objective.min_mask_rate, objective.max_mask_rate
    if objective.depth_map == "linear" or high == low:
        return _round_half_up(from_output * top, num_stacks - 1)
    if objective.depth_map != "exponential":
        raise ValueError(
            f"unknown objective.depth_map {objective.depth_map!r} (expected linear or exponential)"
        )
    ratio = high / low
    position = (ratio ** (from_output / (num_stacks - 1)) - 1.0) / (ratio - 1.0)
    return min(top, max(0, math.floor(position * top + 0.5)))


@dataclass(frozen=True)
class ObjectiveBatch:
    inputs: torch.Tensor  # (B, T) long: what the model reads
    targets: torch.Tensor  # (B, T) long: what it predicts at each position
    loss_mask: torch.Tensor  # (B, T) bool: positions the loss counts
    levels: torch.Tensor | None  # (B,) long diffusion levels when time is an input, else None
    causal: bool  # attention: True = causal (clm), False = bidirectional


def eligible_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: the positions of x = tokens[:, :-1] holding a row's real tokens, i.e. x[0 .. e]
    with tokens[e] the row's last scored target (see the module docstring); none if nothing is scored."""
    num_rows, num_positions = loss_mask.shape
    if num_positions == 0:
        return torch.zeros((num_rows, 0), dtype=torch.bool, device=loss_mask.device)
    index = torch.arange(num_positions, device=loss_mask.device)
    # Last scored target position t (target tokens[t + 1]); -1 for a row that scores nothing.
    last_scored = torch.where(loss_mask, index, torch.full_like(index, -1)).amax(dim=1)
    # x[s] = tokens[s] is real for s <= last_scored + 1; last_scored == -1 leaves every s out.
    return (index.unsqueeze(0) <= (last_scored + 1).unsqueeze(1)) & (last_scored >= 0).unsqueeze(1)


def _row_uniforms(seed: int, step: int, first_row: int, num_rows: int, num_positions: int) -> torch.Tensor:
    """(num_rows, num_positions) float64 U[0, 1) on the CPU, row r from its own (seed, "mask", step,
    first_row + r) stream: drawn on the CPU, so the bits are the same whatever device the rows live on."""
    uniforms = torch.empty((num_rows, num_positions), dtype=torch.float64)
    for row in range(num_rows):
        generator = torch_generator(seed, MASK_PURPOSE, step, first_row + row)
        torch.rand(num_positions, dtype=torch.float64, generator=generator, out=uniforms[row])
    return uniforms


def time_levels(
    objective: ObjectiveSection, *, seed: int, step: int, first_row: int, num_rows: int
) -> torch.Tensor:
    """(num_rows,) long CPU: each row's diffusion level, uniform in [0, num_levels), from its own
    (seed, "time", step, global row) stream."""
    levels = torch.empty(num_rows, dtype=torch.long)
    for row in range(num_rows):
        generator = torch_generator(seed, TIME_PURPOSE, step, first_row + row)
        levels[row] = torch.randint(objective.num_levels, (1,), generator=generator)[0]
    return levels


def _masked_batch(
    tokens: torch.Tensor,
    loss_mask: torch.Tensor,
    rates: torch.Tensor,
    vocab_size: int,
    *,
    seed: int,
    step: int,
    first_row: int,
    levels: torch.Tensor | None,
) -> ObjectiveBatch:
    x = tokens[:, :-1]
    num_rows, num_positions = x.shape
    eligible = eligible_positions(loss_mask.to(device="cpu", dtype=torch.bool))
    uniforms = _row_uniforms(seed, step, first_row, num_rows, num_positions)
    masked = eligible & (uniforms < rates.unsqueeze(1))
    # A row with real tokens but no draw under its rate still gets one masked position: the eligible
    # one of smallest u, which is uniform over them and costs no further draw.
    unlucky = eligible.any(dim=1) & ~masked.any(dim=1)
    if bool(unlucky.any()):
        forced = uniforms.masked_fill(~eligible, 2.0).argmin(dim=1)
        masked[unlucky.nonzero().squeeze(1), forced[unlucky]] = True
    masked = masked.to(tokens.device)
    inputs = x.masked_fill(masked, mask_token_id(vocab_size))
    return ObjectiveBatch(
        inputs=inputs,
        targets=x,
        loss_mask=masked,
        levels=None if levels is None else levels.to(tokens.device),
        causal=False,
    )


def _check_kind(objective: ObjectiveSection) -> None:
    if objective.kind not in OBJECTIVE_KINDS:
        raise ValueError(
            f"unknown objective.kind {objective.kind!r} (expected one of {', '.join(OBJECTIVE_KINDS)})"
        )


def _check_shapes(tokens: torch.Tensor, loss_mask: torch.Tensor) -> None:
    if tokens.ndim != 2 or loss_mask.ndim != 2:
        raise ValueError(
            f"tokens and loss_mask must be 2-D, got {tuple(tokens.shape)} and {tuple(loss_mask.shape)}"
        )
    if tokens.shape[1] < 1 or tokens.shape != (loss_mask.shape[0], loss_mask.shape[1] + 1):
        raise ValueError(
            f"tokens {tuple(tokens.shape)} must be (B, T + 1) for loss_mask {tuple(loss_mask.shape)} = (B, T)"
        )


def objective_batch(
    objective: ObjectiveSection,
    vocab_size: int,
    tokens: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    seed: int,
    step: int,
    first_row: int = 0,
    stack_index: int = 0,
    num_stacks: int = 1,
) -> ObjectiveBatch:
    """The batch the model trains on at `step` from `assemble_batch`'s rows: tokens (B, T + 1) long,
    loss_mask (B, T) bool. `first_row`: the global index of row 0 within the step's batch (a
    micro-batch passes its offset). `stack_index` / `num_stacks`: the stack being trained (0 = input
    side) and how many there are, used by diffusion with time = "depth". Outputs are on tokens' device."""
    _check_kind(objective)
    _check_shapes(tokens, loss_mask)
    if first_row < 0:
        raise ValueError(f"first_row must be >= 0, got {first_row}")
    if num_stacks < 1 or not 0 <= stack_index < num_stacks:
        raise ValueError(f"stack_index {stack_index} is outside [0, {num_stacks})")
    if objective.kind == "clm":
        # The same views engine/step/step.py has always taken: the loss is bit for bit unchanged.
        return ObjectiveBatch(
            inputs=tokens[:, :-1], targets=tokens[:, 1:], loss_mask=loss_mask, levels=None, causal=True
        )
    num_rows = tokens.shape[0]
    levels = None
    if objective.kind == "mlm":
        if not 0.0 < objective.mask_rate <= 1.0:
            raise ValueError(f"objective.mask_rate must be in (0, 1], got {objective.mask_rate}")
        rates = torch.full((num_rows,), objective.mask_rate, dtype=torch.float64)
    elif objective.time == "input":
        levels = time_levels(objective, seed=seed, step=step, first_row=first_row, num_rows=num_rows)
        table = torch.tensor(
            [level_rate(objective, level) for level in range(objective.num_levels)], dtype=torch.float64
        )
        rates = table[levels]
    elif objective.time == "depth":
        rate = level_rate(objective, depth_level(objective, stack_index, num_stacks))
        rates = torch.full((num_rows,), rate, dtype=torch.float64)
    else:
        raise ValueError(f"unknown objective.time {objective.time!r} (expected input or depth)")
    return _masked_batch(
        tokens, loss_mask, rates, vocab_size, seed=seed, step=step, first_row=first_row, levels=levels
    )
