"""The control state of a run: what `fold(events)` computes. Small, frozen, no tensors.

`apply` lives in `rewind.states.fold`; this module only defines the shape. Where the state keeps what an
event recorded (the checkpoints, the activation cache), it holds the event itself, not a copy of fields.

The state is derived data: it is never written into the log. (Caches of it may sit beside the log, see
`rewind.stores.snapshots`; they are rebuilt from the log whenever they are missing or do not decode, so
renaming a field here never strands a run.)
"""

from __future__ import annotations

import msgspec

from rewind.states.data_identity import DataIdentity
from rewind.states.events import (
    SEED_FALLS_BACK_TO_CHILD,
    ActivationsCached,
    CheckpointCommitted,
    ForkSeed,
    RolloutsRecorded,
)
from rewind.states.features import Features
from rewind.states.shapes import (
    BaseMode,
    CheckpointReason,
    ModelLayout,
    OptimizerResetRef,
    Reference,
    StackLayout,
)

# Defined with the events (a fork's seed) or beside them (shapes), and imported from here too.
__all__ = [
    "SEED_FALLS_BACK_TO_CHILD",
    "BaseMode",
    "CheckpointReason",
    "ForkSeed",
    "ModelLayout",
    "OptimizerResetRef",
    "Reference",
    "StackLayout",
    "State",
    "Superseded",
    "anchor_checkpoint",
    "control_summary",
    "reference_to_restore",
]

class Superseded(msgspec.Struct, frozen=True, kw_only=True):
    """Log records [first_seq, last_seq] stopped counting when the run resumed from `checkpoint`."""

    first_seq: int
    last_seq: int
    checkpoint: str
    step: int


class State(msgspec.Struct, frozen=True, kw_only=True):
    started: bool = False
    finished: bool = False
    config_hash: str = ""  # the label the log gives the config in force (identity: config.config_hash)
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
    # Stages whose entry clears the optimizer (the config's), and those entered whose OptimizerReset
    # has not happened yet: state, like pending_refreshes, so a crash in between still resets.
    optimizer_reset_stages: list[int] = []
    pending_optimizer_resets: list[int] = []
    last_optimizer_reset: OptimizerResetRef | None = None
    # The model's structure once it has grown (None: the initial model of `num_layers` blocks, which
    # the fold takes from the config in force; see `rewind.states.growth.current_layout`).
    layout: ModelLayout | None = None
    num_layers: int = 0
    num_growths: int = 0  # config.growth entries done
    # A growth happened after the last checkpoint: that checkpoint (even one at this very step, taken
    # for the boundary before the growth) does not hold the model, so a reference refresh needs another.
    grown_since_checkpoint: bool = False
    # The last ActivationsCached: a complete cache of the current trunk, one chunk per step for the steps
    # [step, step + num_steps), in the order training reads them.
    activation_cache: ActivationsCached | None = None
    # The last RolloutsRecorded: the rollout batch a grpo stage's steps update on (its window).
    rollouts: RolloutsRecorded | None = None
    cursors: dict[str, int] = {}
    last_loss: float | None = None
    num_skipped_steps: int = 0
    last_checkpoint: CheckpointCommitted | None = None
    live_checkpoints: list[CheckpointCommitted] = []  # committed and not deleted, in commit order
    last_evaluated_boundary: int = -2  # -2 = none yet, -1 = before training
    last_validated_step: int = -1
    stopped_reason: str = ""
    resumes: list[Superseded] = []
    parent_run: str = ""
    # CPU threads the current segment computes with (RunStarted's, then a RunResumed's that records one;
    # 0 = not recorded).
    num_threads: int = 0
    cpu_capability: str = ""  # the CPU kernels it computes with (RunStarted's; "" = not recorded)
    # Where the current segment computes (RunStarted's, then the last RunResumed's): "" = the CPU, not
    # recorded; world_size 0 = one process, not recorded.
    device: str = ""
    world_size: int = 0
    features: list[str] = []  # RunStarted's (a fork's: its parent's), as recorded; typed: `behaviours`
    # The data on record: each user dataset's identity (RunStarted's, updated by ConfigChanged), the
    # tokenizer's and the pretrained weights' sha256 ("" = bytes / none), and the epoch each dataset is in.
    data: dict[str, DataIdentity] = {}
    tokenizer: str = ""
    pretrained: str = ""
    epochs: dict[str, int] = {}
    # The step before whose first update the baseline evaluation is due; -1 = none (done, or the run
    # was started without the feature or without evaluations).
    baseline_step: int = -1
    # The seq the next record gets. Folding only the effective records (superseded ones left out)
    # counts the same, because applying a RunResumed moves it past the range it supersedes.
    next_seq: int = 0
    # Where a resume would restart: the state just after the last restore anchor (RunStarted, a
    # CheckpointCommitted, or a RunResumed) and the records that belong to it (retention deletions after
    # a checkpoint, a config change after a resume). Its own `anchor` is None. Keeping it here is what
    # lets `apply` derive a RunResumed's state from the log itself instead of trusting a copy.
    anchor: State | None = None
    anchor_open: bool = False  # the last record was the anchor or belongs to it

    @property
    def behaviours(self) -> Features:
        """`features`, typed: one bool per behaviour the run was started with."""
        return Features.of(self.features)


def control_summary(state: State) -> dict:
    """What a checkpoint's manifest records about the control state it was taken in."""
    return {
        "step": state.step,
        "tokens": state.tokens,
        "stage": state.stage,
        "cursors": dict(state.cursors),
        "config_hash": state.config_hash,
    }


def anchor_checkpoint(anchor: State) -> str:
    """The checkpoint a restore anchor restarts from ("" = the run's start: weights from the seed)."""
    return anchor.last_checkpoint.checkpoint if anchor.last_checkpoint is not None else ""


def reference_to_restore(state: State) -> Reference | None:
    """The KL reference a process restarting at `state` must load: none while a refresh is due, since
    the refresh replaces it before any step reads it (and the checkpoint it names may be gone:
    retention keeps a checkpoint only while it is the reference). Resume and fork both ask this."""
    return None if state.pending_refreshes else state.reference
