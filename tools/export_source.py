"""What every export reads: the run's last committed checkpoint (the one a resume would go on from), the
config in force there, the layout of the model it holds (`export_source`, entered as every command
enters a run: rewind.engine.run.entry.enter), and the transformers family that computes it (`--hf`,
`--adapters`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rewind.tools.errors import CommandError, UsageError


@dataclass(frozen=True)
class ExportSource:
    """What an export writes from: the run's folded state (its last checkpoint: `state.last_checkpoint`),
    the config in force, and the layout of the model the checkpoint holds: that of the fold's restore
    anchor (the state just after the checkpoint, which is what a resume loads it under), not the log's
    latest, which a growth after the checkpoint has changed."""

    state: Any  # rewind.states.state.State
    config: Any  # rewind.states.config.Config
    layout: Any  # rewind.engine.model.layout.ModelLayout


def export_source(run_dir: str) -> ExportSource:
    """The run's last committed checkpoint to export, or one line (CommandError, exit 1 when the run has
    none yet)."""
    from rewind.engine.run.entry import enter
    from rewind.engine.run.parts import RunError
    from rewind.states.entry import ReadCheckpoint
    from rewind.states.growth import current_layout

    try:
        entry = enter(ReadCheckpoint(export=True), run_dir).entry
    except RunError as exc:
        raise CommandError(str(exc), exc.exit_code) from None
    assert entry.point is not None
    return ExportSource(entry.state, entry.config, current_layout(entry.point.state))


def expressible(config, option: str):
    """The transformers family of a run of `config`; UsageError (exit 2) when no transformers model
    computes it."""
    from rewind.engine.model import hf_models
    try:
        return hf_models.family_of(config)
    except hf_models.NotExpressible as exc:
        raise UsageError(f"{option}: no transformers model computes the run's model: {exc}") from None
