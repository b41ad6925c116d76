"""A grpo stage's reward functions: the built-in `exact_match`, or your own as "module:function".

A reward function takes a batch and returns one reward per completion, None where it does not apply:

    def my_reward(prompts: list[str], completions: list[str], completion_ids: list[list[int]],
                  **row_fields: list[str]) -> list[float | None]

`prompts` and `completions` are texts (a completion without its end token), `completion_ids` its token
ids, and each row field a list aligned with the completions (today `answer`: the row's reference
answer). Several functions are summed by their weights (rewind.engine.grpo_losses.weighted_rewards; a
function's None is left out of its completion's sum).

Your module is imported by name from the Python path (the directory you run `rewind` from first), so it
runs with your permissions, as any code you ask a trainer to run. Its identity goes on record with every
rollout batch (RolloutsRecorded.reward_code: the sha256 of the module's file, and its __version__ when it
has one): a resume inside the stage under another version of the code is refused, as a changed dataset
is, because the rewards on record would no longer be what the code computes.
"""

from __future__ import annotations

import hashlib
import importlib
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from rewind.engine.task_rows import exact_match_rewards

RewardFunction = Callable[..., list]
BUILTIN: dict[str, RewardFunction] = {"exact_match": exact_match_rewards}
# Rewards are kept as float32 (the rollout file): a larger magnitude would be kept as infinite.
FLOAT32_MAX = 3.4028234663852886e38
# What a built-in function's identity is on record as: its code is rewind's (the release is on record).
BUILTIN_IDENTITY = "builtin"


class RewardError(ValueError):
    """A reward function that cannot be loaded or returned what no reward is: one line."""


def load_reward(name: str) -> RewardFunction:
    """The function `name` names (a built-in's name, or "module:function")."""
    if name in BUILTIN:
        return BUILTIN[name]
    module_name, _, attribute = name.partition(":")
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, "")  # the directory rewind runs from, as `python -m` would have it
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # its own import errors included: said in one line, not a traceback
        raise RewardError(f"reward function {name}: cannot import {module_name}: {type(exc).__name__}: {exc}") from None
    function = getattr(module, attribute, None)
    if not callable(function):
        raise RewardError(f"reward function {name}: {module_name} has no function {attribute!r}")
    return function


def reward_identity(name: str) -> str:
    """What `name`'s code is, for the record: "builtin", or "sha256:<the module file's hex>" (+ ";version=V")."""
    if name in BUILTIN:
        return BUILTIN_IDENTITY
    load_reward(name)  # imported, so the module is in sys.modules
    module = sys.modules[name.partition(":")[0]]
    source = getattr(module, "__file__", None)
    if not source or not Path(source).is_file():
        raise RewardError(f"reward function {name}: its module has no file to identify it by")
    identity = "sha256:" + hashlib.sha256(Path(source).read_bytes()).hexdigest()
    version = getattr(module, "__version__", None)
    return identity + (f";version={version}" if isinstance(version, str) else "")


def reward_identities(names: Sequence[str]) -> dict[str, str]:
    return {name: reward_identity(name) for name in names}


def reward_code_changes(recorded: dict[str, str]) -> str:
    """Why the reward functions a stage's last batch was scored by are not the code here now ("" if they
    are): a resume inside the stage would compute other rewards than the record's."""
    for name, was in sorted(recorded.items()):
        now = reward_identity(name)
        if now != was:
            return (
                f"reward function {name} changed since the run scored with it ({was} -> {now}); restore its "
                "code, or fork the run to go on under the new one"
            )
    return ""


def score(
    names: Sequence[str],
    prompts: list[str],
    completions: list[str],
    completion_ids: list[list[int]],
    row_fields: dict[str, list[str]],
) -> torch.Tensor:
    """(F, N) float32 rewards of the N completions by each function (NaN where it gave None)."""
    rows = []
    for name in names:
        try:
            values = load_reward(name)(prompts, completions, completion_ids, **row_fields)
        except RewardError:
            raise
        except Exception as exc:  # the function's own failure: said in one line, naming it
            raise RewardError(f"reward function {name} failed: {type(exc).__name__}: {exc}") from None
        if not isinstance(values, list | tuple) or len(values) != len(completions):
            raise RewardError(
                f"reward function {name}: returned {type(values).__name__} of "
                f"{len(values) if isinstance(values, list | tuple) else '?'} values for {len(completions)} completions"
            )
        row = []
        for value in values:
            if value is None:
                row.append(math.nan)
            elif isinstance(value, int | float) and not isinstance(value, bool) and abs(value) <= FLOAT32_MAX:
                row.append(float(value))  # (NaN fails the comparison: refused too)
            else:
                raise RewardError(
                    f"reward function {name}: returned {value!r}, not a finite number (float32: |r| <= 3.4e38) or None"
                )
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float32)
