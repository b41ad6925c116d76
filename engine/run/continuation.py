"""Whether a run can be resumed under a config: the same config, or the refusal that names what
differs and the flag that forks. Whether a fork may go on from a checkpoint under another config is
the pure rule `rewind.states.check_continuation.change_problem`.
"""

from __future__ import annotations

from rewind.states.config import Config
from rewind.states.config_identity import config_differences, config_hash


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
