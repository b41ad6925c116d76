"""The event vocabulary: every transition of a run, as a frozen, tagged msgspec struct.

Conventions shared by every event:
- `step` is the number of optimizer steps completed when the event happens, `tokens` the number of
  training tokens consumed by then (= step * tokens_per_step). So `StepCommitted(step=1)` closes the
  first optimizer step (schedule index k = 0), and `StageEntered(step=k)` fires before the step with
  index k runs.
- The tag (`type` in JSON) is the class name, past tense. New fields get defaults so old logs stay
  readable; anything else needs an upcaster in `rewind.stores.codec`.
- No tensors: weights live in checkpoints that events name by id.
"""

from __future__ import annotations

import msgspec

from rewind.states.config import Config
from rewind.states.state import State

# Bumped whenever an event changes incompatibly; the log frames carry it and the codec upcasts.
SCHEMA_VERSION = 1


class Event(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    step: int
    tokens: int


class ForkOrigin(msgspec.Struct, frozen=True, kw_only=True):
    """Where a forked run came from: the parent's run directory, step and checkpoint."""

    run: str
    step: int
    checkpoint: str
    config_hash: str


class RunStarted(Event, frozen=True, kw_only=True):
    config: Config
    config_hash: str
    rewind_version: str = "0"
    parent: ForkOrigin | None = None
    # CPU threads the run computes with (0 = not recorded). A CPU sum is split across threads, so its
    # bits depend on the count: resume, fork and replay use this one, wherever they run.
    num_threads: int = 0


class StageEntered(Event, frozen=True, kw_only=True):
    stage: int


class FadeStarted(Event, frozen=True, kw_only=True):
    boundary: int  # between stage `boundary` and `boundary + 1`


class FadeEnded(Event, frozen=True, kw_only=True):
    boundary: int


class ReferenceRefreshed(Event, frozen=True, kw_only=True):
    stage: int
    # The checkpoint whose model weights are the frozen reference from now on. Empty in a dry-run.
    checkpoint: str = ""


class StackAppended(Event, frozen=True, kw_only=True):
    """Room for progressive growth: a stack of blocks joined the model (appended or prepended)."""

    stack: int
    num_blocks: int
    position: str = "append"  # "append" | "prepend"
    trunk: str = "trainable"  # "trainable" | "frozen" | "lora" | "qlora"


class StepCommitted(Event, frozen=True, kw_only=True):
    stage: int
    lr: float
    beta: float
    loss: float
    kl: float = 0.0
    grad_norm: float = 0.0
    rows: list[int] = []  # rows of this step drawn from each stage (the fade allocation)
    cursors: dict[str, int] = {}  # samples consumed per dataset, after this step
    skipped: bool = False  # non-finite loss with on_nonfinite = "skip": no update was applied


class Validated(Event, frozen=True, kw_only=True):
    losses: dict[str, float]  # validation loss per dataset


class Evaluated(Event, frozen=True, kw_only=True):
    """Task scores at a stage boundary (or the end): answer-token accuracy per task."""

    boundary: int  # -1 = before training, n - 1 = end of the run
    scores: dict[str, float]
    losses: dict[str, float] = {}


class CheckpointCommitted(Event, frozen=True, kw_only=True):
    checkpoint: str  # "<step:08d>-<short hash>", a directory under RUN/checkpoints/
    manifest_sha256: str
    files: dict[str, str] = {}  # file name -> sha256 of its bytes
    reason: str = "interval"  # "interval" | "boundary" | "reference" | "final" | "stop"


class CheckpointDeleted(Event, frozen=True, kw_only=True):
    checkpoint: str


class NonFiniteLoss(Event, frozen=True, kw_only=True):
    loss: float
    action: str  # "stop" | "skip"


class RunStopped(Event, frozen=True, kw_only=True):
    """The process stopped before the end on purpose (Ctrl-C, non-finite loss): resumable."""

    reason: str


class RunResumed(Event, frozen=True, kw_only=True):
    """A new process took over from `checkpoint`. Log records with seq in [first, last] are superseded:
    they stay in the log (it is append-only) but no longer count. `restored` is the control state as of
    that checkpoint, so folding never has to look back."""

    checkpoint: str
    superseded_first_seq: int
    superseded_last_seq: int  # < first when nothing was superseded
    restored: State
    config_hash: str = ""


class ConfigChanged(Event, frozen=True, kw_only=True):
    """`rewind train --fork`: the run goes on under a new config from its restore point. Tokens per
    step must not change (step k always starts at token k * tps)."""

    config: Config
    config_hash: str
    previous_hash: str


class RunFinished(Event, frozen=True, kw_only=True):
    pass


AnyEvent = (
    RunStarted
    | StageEntered
    | FadeStarted
    | FadeEnded
    | ReferenceRefreshed
    | StackAppended
    | StepCommitted
    | Validated
    | Evaluated
    | CheckpointCommitted
    | CheckpointDeleted
    | NonFiniteLoss
    | RunStopped
    | RunResumed
    | ConfigChanged
    | RunFinished
)

EVENT_TYPES: dict[str, type[Event]] = {t.__name__: t for t in AnyEvent.__args__}  # type: ignore[attr-defined]


def event_to_dict(event: Event) -> dict:
    """JSON-ready dict with `type` first, then `step`, `tokens` and the fields."""
    data = msgspec.to_builtins(event)
    return {"type": type(event).__name__, **{k: v for k, v in data.items() if k != "type"}}
