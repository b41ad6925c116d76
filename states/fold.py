"""The fold: `apply(state, event)` is the only way the control state changes.

Each event type's mutator (rewind.states.transition: `@mutates`, in rewind.states.mutators and, for
RunResumed, rewind.states.resumes) checks that the event may follow the state and returns the state
after it, or raises `IllegalTransition` naming the event and the reason. `apply` adds what every
transition shares: the seq count and the restore anchor a resume restarts from.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from rewind.states import mutators, resumes
from rewind.states.events import (
    CheckpointCommitted,
    CheckpointDeleted,
    ConfigChanged,
    Event,
    RunResumed,
    RunStarted,
)
from rewind.states.resumes import seed_of
from rewind.states.state import State
from rewind.states.transition import IllegalTransition, transition

__all__ = ["ANCHOR_FOLLOWERS", "IllegalTransition", "apply", "fold", "seed_of"]

# The modules whose import registers the mutators `transition` looks up.
_REGISTERED = (mutators, resumes)

replace = msgspec.structs.replace

# Records that belong to the restore anchor just before them: a resume keeps them (see State.anchor).
ANCHOR_FOLLOWERS = (CheckpointDeleted, ConfigChanged)


def apply(state: State, event: Event) -> State:
    """The state after `event`, with the seq count and the restore anchor kept up to date."""
    new = transition(state, event)
    if isinstance(event, RunStarted | CheckpointCommitted | RunResumed):
        opened = replace(new, next_seq=new.next_seq + 1, anchor_open=True, anchor=None)
        return replace(opened, anchor=opened)
    if state.anchor_open and isinstance(event, ANCHOR_FOLLOWERS):
        extended = replace(new, next_seq=state.next_seq + 1, anchor=None)
        return replace(extended, anchor=extended)
    return replace(new, next_seq=state.next_seq + 1, anchor_open=False, anchor=state.anchor)


def fold(events: Iterable[Event], state: State | None = None) -> State:
    """Fold events into a state, starting from `state` (the empty state by default)."""
    current = state if state is not None else State()
    for event in events:
        current = apply(current, event)
    return current
