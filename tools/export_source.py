"""What every export reads: the run's last committed checkpoint (the one a resume would go on from), the
layout of the model it holds, and the transformers family that computes it (`--hf`, `--adapters`)."""

from __future__ import annotations

from rewind.tools.errors import CommandError, UsageError
from rewind.tools.runlog import load_records


def checkpointed_state(run_dir: str, records: list | None = None):
    """The run's folded state, which has a committed checkpoint (CommandError, exit 1, when it has none):
    every export writes its last one, the checkpoint a resume would go on from."""
    from rewind.states.fold import fold

    state = fold(e for _, e in (load_records(run_dir) if records is None else records))
    if state.last_checkpoint is None:
        raise CommandError(f"{run_dir}: the run has no committed checkpoint yet", 1)
    return state


def checkpoint_layout(state):
    """The layout of the model that `state`'s last checkpoint holds: that of the fold's restore anchor
    (the state just after the checkpoint, which is what a resume loads it under), not the log's
    latest, which a growth after the checkpoint has changed."""
    from rewind.states.growth import current_layout

    anchor = state.anchor
    if anchor is None or anchor.last_checkpoint != state.last_checkpoint:
        raise CommandError(
            "the log's restore anchor is not its last checkpoint: cannot tell that model's layout", 1
        )
    return current_layout(anchor)


def expressible(config, option: str):
    """The transformers family of a run of `config`; UsageError (exit 2) when no transformers model
    computes it."""
    from rewind.engine.model import hf_models
    try:
        return hf_models.family_of(config)
    except hf_models.NotExpressible as exc:
        raise UsageError(f"{option}: no transformers model computes the run's model: {exc}") from None
