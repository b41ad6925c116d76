"""Whether a run can go on under a config: the same config (a resume), or another one from a
checkpoint (a fork, in place or not), whose weights must still fit the model it describes.
"""

from __future__ import annotations

from rewind.states.config import Config
from rewind.states.config_identity import config_differences, config_hash
from rewind.states.entry import tokenizer_problem


def continuation_problem(old: Config, new: Config, num_growths: int = 0) -> str:
    """Why a run cannot go on from a checkpoint of `old` under `new` ("" if it can): the architecture
    fields that give the weights their shapes must stay, and so must the `num_growths` growths already
    performed (the model is what they made; later ones may change). Dropout, RoPE base and the like may
    change."""
    from rewind.engine.objectives import model_vocab_size, num_time_levels

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
    def shaping(config: Config) -> dict:
        a = config.architecture
        return {"vocab_size": a.vocab_size, "num_layers": a.num_layers, "d_model": a.d_model,
                "d_ff": a.d_ff or 4 * a.d_model, "norm": a.norm, "mlp": a.mlp}

    before, after = shaping(old), shaping(new)
    changed = [f"architecture.{k} ({before[k]} -> {after[k]})" for k in before if before[k] != after[k]]
    if not changed:
        return ""
    return f"{', '.join(changed)} cannot change when continuing from a checkpoint: the weights have other shapes"


def config_mismatch(run_dir: str, logged: Config, new: Config) -> str:
    """"" when `new` is the run's config; else the refusal, naming what differs. Identity is computed
    by this code from both configs (never a hash an older release wrote), so a release that adds a
    field with a default does not strand a run."""
    if config_hash(logged) == config_hash(new):
        return ""
    changes = config_differences(logged, new)
    shown = "; ".join(changes[:4]) + (f"; and {len(changes) - 4} more" if len(changes) > 4 else "")
    return (
        f"{run_dir}: the config differs from the run's ({shown or 'no field differs in value'}); "
        "pass --fork to continue under the new config"
    )
