"""Whether a run may go on under a config: the continuation rules, in one place beside the entry
decision that applies them (rewind.states.entry.decide) for a resume, a fork in place and a fork.

A resume goes on under the config the run logged; another config is refused, naming what differs,
unless the caller forks (in place: `rewind train --fork`; into a new run: `rewind fork`), and a finished
run trains no further under any other. Forking, a run keeps its tokenizer at any point, and from a
checkpoint the weights it holds must still fit the model the new config describes.

The shapes a config gives the weights are stated here once (`model_vocab_size`, `num_time_levels`):
the engine builds its model with them, and these rules compare them. Pure.
"""

from __future__ import annotations

from typing import get_args

from rewind.states.config import Config, ObjectiveKind, ObjectiveSection
from rewind.states.config_identity import config_differences, config_hash
from rewind.states.history import RestorePoint
from rewind.states.model_size import mlp_width


def differences_shown(logged: Config, new: Config) -> str:
    """"" when `new` is the run's config (by identity, computed by this code from both configs, never a
    hash an older release wrote: a release that adds a field with a default does not strand a run); else
    the fields that differ, 'path: old -> new' joined by '; ' (the first four, then how many more)."""
    if config_hash(logged) == config_hash(new):
        return ""
    changes = config_differences(logged, new)
    shown = "; ".join(changes[:4]) + (f"; and {len(changes) - 4} more" if len(changes) > 4 else "")
    return shown or "no field differs in value"


def resume_refusal(run: str, logged: Config, new: Config) -> str:
    """Why run `run` of `logged` does not resume under `new` without forking ("" when it is the run's config)."""
    shown = differences_shown(logged, new)
    if not shown:
        return ""
    return f"{run}: the config differs from the run's ({shown}); pass --fork to continue under the new config"


def finished_refusal(run: str, step: int, logged: Config, new: Config) -> str:
    """Why finished run `run` (at `step`) of `logged` is not entered under `new` ("" when it is the run's
    config: there is then nothing to do)."""
    shown = differences_shown(logged, new)
    if not shown:
        return ""
    return (
        f"{run}: the run is already finished (step {step}), and the config given differs from the run's ({shown}); "
        f"it trains no further: use a new --run-dir, or `rewind fork {run} --at-step N NEW_RUN --set ...` to "
        "branch from one of its checkpoints"
    )


def tokenizer_problem(old: Config, new: Config) -> str:
    """Why a run of `old` cannot go on under `new` for its tokenizer ("" if it can)."""
    if old.tokenizer == new.tokenizer:
        return ""
    return (
        "tokenizer: a run's tokenizer is fixed when it starts (its token ids are what the weights learned; "
        "a fork keeps its parent's); start a new run for another tokenizer"
    )


def change_problem(old: Config, new: Config, point: RestorePoint) -> str:
    """Why a run of `old` cannot go on under `new` from `point` ("" if it can), for a resume under a
    changed config and a fork alike: the tokenizer at any point (the run's data is tokenised from its
    start), the weights' shapes only from a checkpoint (without one the model is built afresh)."""
    if not point.checkpoint:
        return tokenizer_problem(old, new)
    return continuation_problem(old, new, point.state.num_growths)


def continuation_problem(old: Config, new: Config, num_growths: int = 0) -> str:
    """Why a run cannot go on from a checkpoint of `old` under `new` ("" if it can): the architecture
    fields that give the weights their shapes must stay, and so must the `num_growths` growths already
    performed (the model is what they made; later ones may change). Dropout, RoPE base and the like may
    change."""
    if problem := tokenizer_problem(old, new):
        return problem
    done_before, done_after = old.growth[:num_growths], new.growth[:num_growths]
    if done_before != done_after:
        return (
            f"growth[0..{num_growths - 1}] already happened and cannot change when continuing from a checkpoint "
            f"(the new config has {len(new.growth)} growth entries; change only later ones)"
        )
    if num_growths and old.lora.targets != new.lora.targets:
        return "lora.targets cannot change when continuing from a checkpoint of a grown model: its adapters sit on the old ones"
    return objective_problem(old, new) or architecture_problem(old, new)


def objective_problem(old: Config, new: Config) -> str:
    """Why the objective's change would change the model's shape ("" if it would not)."""
    shapes = {
        "vocabulary": lambda c: model_vocab_size(c.objective, c.architecture.vocab_size),
        "time levels": lambda c: num_time_levels(c.objective),
    }
    for what, shape in shapes.items():
        before, after = shape(old), shape(new)
        if before != after:
            return (
                f"objective: the model's {what} would change ({before} -> {after}) when continuing from a checkpoint "
                "(a masked objective adds a mask token; time as input adds a time embedding)"
            )
    return ""


def architecture_problem(old: Config, new: Config) -> str:
    """The architecture fields that give the weights their shapes and differ ("" if none does)."""
    before, after = weight_shaping(old), weight_shaping(new)
    changed = [f"architecture.{k} ({before[k]} -> {after[k]})" for k in before if before[k] != after[k]]
    if not changed:
        return ""
    return (
        f"{', '.join(changed)} cannot change when continuing from a checkpoint: the weights have other shapes"
    )


def weight_shaping(config: Config) -> dict:
    """The architecture fields the weights' shapes follow."""
    a = config.architecture
    return {
        "vocab_size": a.vocab_size,
        "num_layers": a.num_layers,
        "d_model": a.d_model,
        "d_ff": mlp_width(a),
        "norm": a.norm,
        "mlp": a.mlp,
    }


def model_vocab_size(objective: ObjectiveSection, vocab_size: int) -> int:
    """Embedding rows and logits the model needs: the data's vocabulary, plus the mask token when the
    objective masks."""
    known_kind(objective)
    return vocab_size if objective.kind == "clm" else vocab_size + 1


def num_time_levels(objective: ObjectiveSection) -> int:
    """Rows of the time embedding: the diffusion levels when time is an input, else 0 (no embedding)."""
    known_kind(objective)
    return objective.num_levels if objective.kind == "diffusion" and objective.time == "input" else 0


def is_causal(objective: ObjectiveSection) -> bool:
    """Next-token prediction must not see the future; masked objectives attend both ways."""
    known_kind(objective)
    return objective.kind == "clm"


def known_kind(objective: ObjectiveSection) -> None:
    """ValueError for a kind no objective has (a section built in code, never one a config check passed)."""
    kinds = get_args(ObjectiveKind)
    if objective.kind not in kinds:
        raise ValueError(f"unknown objective.kind {objective.kind!r} (expected one of {', '.join(kinds)})")
