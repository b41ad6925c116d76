"""What a transition is: a mutator per event type, which checks that the event may follow the state and
returns the state after it.

Each event type registers its one mutator with `@mutates(EventType)` (the ordinary ones in
`rewind.states.mutators`, a resume's in `rewind.states.resumes`); `rewind.states.fold.apply` looks it
up and keeps the seq count and the restore anchor, which every transition shares. A check that fails
raises `IllegalTransition` naming the event and the reason, so a log that was tampered with, reordered
or written by a buggy engine is caught at fold time instead of silently producing a different run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from rewind.states.events import Event, RunStarted
from rewind.states.state import State

E = TypeVar("E", bound=Event)
Mutator = Callable[[State, E], State]

# Event type -> its mutator; filled as the modules that declare them are imported (rewind.states.fold
# imports them all, and a test checks that every event type has one).
MUTATORS: dict[type[Event], Mutator] = {}


class IllegalTransition(Exception):
    """An event that cannot follow the state it was applied to."""

    def __init__(self, event: Event, reason: str):
        self.event = event
        self.reason = reason
        super().__init__(f"{type(event).__name__} at step {event.step}: {reason}")


def require(condition: bool, event: Event, reason: str) -> None:
    if not condition:
        raise IllegalTransition(event, reason)


def mutates(event_type: type[E]) -> Callable[[Mutator[E]], Mutator[E]]:
    """Register the decorated function as the one mutator of `event_type`."""

    def register(mutator: Mutator[E]) -> Mutator[E]:
        assert event_type not in MUTATORS, f"{event_type.__name__} has two mutators"
        MUTATORS[event_type] = mutator
        return mutator

    return register


def transition(state: State, event: Event) -> State:
    """The state after `event` (the seq count and anchor aside), by the event type's mutator."""
    if not state.started:
        require(isinstance(event, RunStarted), event, "the first event of a run must be RunStarted")
    elif state.finished:
        require(False, event, "the run has already finished")
    mutator = MUTATORS.get(type(event))
    if mutator is None:
        raise IllegalTransition(event, "unknown event type")
    return mutator(state, event)
