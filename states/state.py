"""The control state of a run: what `fold(events)` computes. Small, frozen, no tensors.

`apply` lives in `rewind.states.fold`; this module only defines the shape so that events (which
carry a restored State on resume) and the fold can both import it.
"""

from __future__ import annotations

import msgspec


class Reference(msgspec.Struct, frozen=True, kw_only=True):
    stage: int
    step: int
    checkpoint: str


class CheckpointRef(msgspec.Struct, frozen=True, kw_only=True):
    checkpoint: str
    step: int
    tokens: int
    reason: str
    manifest_sha256: str
    files: dict[str, str] = {}


class Stack(msgspec.Struct, frozen=True, kw_only=True):
    stack: int
    num_blocks: int
    position: str
    trunk: str
    step: int


class Superseded(msgspec.Struct, frozen=True, kw_only=True):
    """Log records [first_seq, last_seq] stopped counting when the run resumed from `checkpoint`."""

    first_seq: int
    last_seq: int
    checkpoint: str
    step: int


class State(msgspec.Struct, frozen=True, kw_only=True):
    started: bool = False
    finished: bool = False
    config_hash: str = ""
    num_stages: int = 0
    tokens_per_step: int = 0
    num_steps: int = 0
    reference_update_stages: list[int] = []
    step: int = 0  # optimizer steps completed
    tokens: int = 0  # training tokens consumed
    stage: int = -1  # current primary stage; -1 before the first StageEntered
    num_stages_entered: int = 0
    fades_started: list[int] = []  # boundaries whose fade has begun, ascending
    fades_ended: list[int] = []
    # Stages entered whose reference refresh has not happened yet. Kept as state (not re-derived from
    # the stage number) so a crash between StageEntered and ReferenceRefreshed still refreshes.
    pending_refreshes: list[int] = []
    reference: Reference | None = None
    stacks: list[Stack] = []
    cursors: dict[str, int] = {}
    last_loss: float | None = None
    num_skipped_steps: int = 0
    last_checkpoint: CheckpointRef | None = None
    live_checkpoints: list[CheckpointRef] = []
    last_evaluated_boundary: int = -2  # -2 = none yet, -1 = before training
    stopped_reason: str = ""
    resumes: list[Superseded] = []
    parent_run: str = ""
    num_threads: int = 0  # CPU threads the run computes with (RunStarted's; 0 = not recorded)


def control_summary(state: State) -> dict:
    """What a checkpoint's manifest records about the control state it was taken in."""
    return {
        "step": state.step,
        "tokens": state.tokens,
        "stage": state.stage,
        "cursors": dict(state.cursors),
        "config_hash": state.config_hash,
    }
