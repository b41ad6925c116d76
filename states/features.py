"""A run's behaviours: what a run started by this release does that older releases' runs did not.

The log records them by name (RunStarted.features, kept in State.features): a run keeps them for life, so a
release that changes what a run computes gates the change on a new name, and old runs (whose logs lack it)
resume and replay as they were. Code asks the typed form, `Features`, one bool per behaviour
(`State.behaviours`, `RunStarted.behaviours`); the names a run may record, RUN_FEATURES, are its fields, so
the two cannot drift. A name this release does not know is refused before a run is opened
(rewind.states.admission.features_problem): a newer release's run would compute something else here.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec


class Features(msgspec.Struct, frozen=True, kw_only=True):
    # Cosine and sgdr warm up from warmup_lr_mult x lr (before: from 0).
    lr_warmup_floor: bool = False
    # One evaluation before the first update (Evaluated boundary -1) of a run started from scratch, when the
    # config names evaluations (a fork starts from weights its parent evaluated).
    baseline_evaluation: bool = False
    # Retention keeps checkpoints taken for a reference refresh, as it keeps boundary ones (a later boundary
    # checkpoint's restore state names them; growth takes them routinely).
    reference_checkpoints_kept: bool = False
    # User datasets are tokenised into the run directory, their identity is on record and checked, and
    # validation rows are carved at random (DataSource.split = "" means "random"; before: "tail").
    data_identity: bool = False
    # A checkpoint's name and manifest hash hold only its training state (manifest format 2: no log position,
    # the KL reference by its content digest), so a resumed run names its checkpoints as a straight one does
    # (before: format 1, which also held the log position).
    content_named_checkpoints: bool = False
    # A grpo batch's mean reward is over the completions some function scored, the others counted apart
    # (RolloutsRecorded.unscored, metrics["unscored"]), and the logged KL is the importance-weighted
    # sum(ratio * k) / tokens the loss uses (before: unscored ones counted as 0 in the mean, no count, and
    # the plain mean of k).
    scored_reward_figures: bool = False

    @classmethod
    def of(cls, names: Iterable[str]) -> Features:
        """The behaviours a recorded list of names turns on (a name this release does not know turns on
        nothing here: trust refuses such a run before anything reads it)."""
        recorded = set(names)
        return cls(**{name: True for name in RUN_FEATURES if name in recorded})


# Every behaviour this release has, in the order a new run records them (RunStarted.features).
RUN_FEATURES: tuple[str, ...] = tuple(field.name for field in msgspec.structs.fields(Features))
