"""A grpo stage's reward functions: the built-in `exact_match`, or your own as "module:function".

A reward function takes a batch and returns one reward per completion, None where it does not apply:

    def my_reward(prompts: list[str], completions: list[str], completion_ids: list[list[int]],
                  *, answer: list[str], **row_fields: list[str]) -> list[float | None]

Every argument is a list aligned with the completions (completion n of a rollout batch of P prompts x G
completions is the (n % G)-th of prompt n // G): `prompts[n]` is completion n's prompt text (each prompt
repeated G times), `completions[n]` its text (decoded, without the end token), `completion_ids[n]` its
token ids, and each row field (today `answer`: the dataset's answer_field, "answer" for the built-in
tasks) the field of completion n's row, as a list too. Several functions are summed by their weights
(rewind.engine.grpo_losses.weighted_rewards; a function's None is left out of its completion's sum).

Before anything is recorded (a start, a resume, a fork), each function of each grpo stage is tried
(`try_rewards`): imported, then called once as a rollout calls it, on the first TRIAL_ROWS rows of each of
the stage's datasets with made-up completions (the row's answer, an empty one and TRIAL_GARBAGE), its
return checked as every rollout's is. A function that does not import, raises or returns what no reward is
says so in one line then, not after the stages before it have trained.

"module" is looked for first beside the config file (`beside`: the directory `rewind train CONFIG` or
`rewind fork --config CONFIG` read it from, as relative data paths are;
rewind.engine.userdata.DataHome.base_dir), then in the working directory, as `module.py` or a package
directory `module/`, and last on the Python path (an installed module). A command without a config file
(`rewind resume`, `rewind replay`, `rewind fork` without --config) looks in the working directory.
It runs with your permissions, as any code you ask a trainer to run. Its identity goes on record with every
rollout batch (RolloutsRecorded.reward_code: the sha256 of the module's file, and its __version__ when it
has one): a resume inside the stage under another version of the code is refused, as a changed dataset
is, because the rewards on record would no longer be what the code computes.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from rewind.engine.rows import encode_text
from rewind.engine.task_rows import exact_match_rewards

if TYPE_CHECKING:
    from rewind.engine.example_sources import ExampleSources
    from rewind.states.config import Stage

RewardFunction = Callable[..., list]
Decoder = Callable[[list[int]], str]
BUILTIN: dict[str, RewardFunction] = {"exact_match": exact_match_rewards}
# Rewards are kept as float32 (the rollout file): a larger magnitude would be kept as infinite.
FLOAT32_MAX = 3.4028234663852886e38
# What a built-in function's identity is on record as: its code is rewind's (the release is on record).
BUILTIN_IDENTITY = "builtin"
# The trial before anything is recorded: rows of each dataset, and a completion no answer looks like.
TRIAL_ROWS = 2
TRIAL_GARBAGE = "?? x9 \ufffd"
# Modules this process imported from a file it found beside a config or in the working directory: the
# file, and the sha256 of its bytes then.
_FOUND: dict[str, tuple[Path, bytes]] = {}


class RewardError(ValueError):
    """A reward function that cannot be loaded or returned what no reward is: one line."""


def load_reward(name: str, beside: str | None = None) -> RewardFunction:
    """The function `name` names (a built-in's name, or "module:function" found as the module doc says)."""
    if name in BUILTIN:
        return BUILTIN[name]
    module_name, _, attribute = name.partition(":")
    function = getattr(_module(name, beside), attribute, None)
    if not callable(function):
        raise RewardError(f"reward function {name}: {module_name} has no function {attribute!r}")
    return function


def _places(beside: str | None) -> list[Path]:
    """Where a reward module is looked for, in order: beside the config file, then the working directory."""
    places = [Path(beside).resolve()] if beside else []
    here = Path.cwd().resolve()
    return places + ([here] if here not in places else [])


def _source(place: Path, top: str) -> Path | None:
    for candidate in (place / f"{top}.py", place / top / "__init__.py"):
        if candidate.is_file():
            return candidate.resolve()
    return None


def _module(name: str, beside: str | None) -> ModuleType:
    module_name = name.partition(":")[0]
    top = module_name.partition(".")[0]
    places = _places(beside)
    found = next((source for place in places if (source := _source(place, top)) is not None), None)
    try:
        if found is not None:
            _import_from(top, found)
        return importlib.import_module(module_name)
    except Exception as exc:  # its own import errors included: said in one line, not a traceback
        if found is None and isinstance(exc, ModuleNotFoundError) and exc.name == top:
            where = " or ".join(
                f"{'beside the config' if beside and i == 0 else 'in the working directory'} ({place})"
                for i, place in enumerate(places)
            )
            raise RewardError(
                f"reward function {name}: cannot import {module_name}: no {top}.py nor {top}/ {where}, "
                "and no installed module of that name"
            ) from None
        what = str(exc) if isinstance(exc, RewardError) else f"{type(exc).__name__}: {exc}"
        at = f" ({found})" if found is not None else ""
        raise RewardError(f"reward function {name}: cannot import {module_name}{at}: {what}") from None


def _import_from(top: str, source: Path) -> None:
    """Make the module (or package) `top` the one at `source`, as the file is now. One of that name this
    process imported from another file it found (another config's, in a process that opened two runs), or
    from this file before it changed, is imported again: the code that scores is the file found, the one
    whose hash goes on record. One imported from elsewhere (a library) is not replaced: shadowing it would
    break whatever imported it."""
    held, now = sys.modules.get(top), (source, hashlib.sha256(source.read_bytes()).digest())
    if held is not None and _FOUND.get(top) == now:
        return
    if held is not None and top not in _FOUND and _file_of(held) != source:
        raise RewardError(
            f"a module of that name is already imported ({_file_of(held) or 'built in'}); rename yours"
        )
    for key in [k for k in sys.modules if k == top or k.startswith(top + ".")]:
        del sys.modules[key]
    package = source.name == "__init__.py"
    spec = importlib.util.spec_from_file_location(
        top, source, submodule_search_locations=[str(source.parent)] if package else None
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[top], _FOUND[top] = module, now
    # Its own imports find its neighbours first, as a script's would; only while it is imported, so that
    # no other module is ever found in a config's directory.
    beside = str(source.parent.parent if package else source.parent)
    sys.path.insert(0, beside)
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[top], _FOUND[top]
        raise
    finally:
        sys.path.remove(beside)


def _file_of(module: ModuleType) -> Path | None:
    source = getattr(module, "__file__", None)
    return Path(source).resolve() if source else None


def reward_identity(name: str, beside: str | None = None) -> str:
    """What `name`'s code is, for the record: "builtin", or "sha256:<the module file's hex>" (+ ";version=V")."""
    if name in BUILTIN:
        return BUILTIN_IDENTITY
    load_reward(name, beside)  # imported, so the module is in sys.modules
    module = sys.modules[name.partition(":")[0]]
    source = getattr(module, "__file__", None)
    if not source or not Path(source).is_file():
        raise RewardError(f"reward function {name}: its module has no file to identify it by")
    identity = "sha256:" + hashlib.sha256(Path(source).read_bytes()).hexdigest()
    version = getattr(module, "__version__", None)
    return identity + (f";version={version}" if isinstance(version, str) else "")


def reward_identities(names: Sequence[str], beside: str | None = None) -> dict[str, str]:
    return {name: reward_identity(name, beside) for name in names}


def reward_code_changes(recorded: dict[str, str], beside: str | None = None) -> str:
    """Why the reward functions a stage's last batch was scored by are not the code here now ("" if they
    are): a resume inside the stage would compute other rewards than the record's."""
    for name, was in sorted(recorded.items()):
        now = reward_identity(name, beside)
        if now != was:
            return (
                f"reward function {name} changed since the run scored with it ({was} -> {now}); restore its "
                "code, or fork the run to go on under the new one"
            )
    return ""


def score_groups(
    names: Sequence[str],
    prompts: Sequence[str],
    answers: Sequence[str],
    completion_ids: list[list[int]],
    decode: Decoder,
    beside: str | None = None,
) -> torch.Tensor:
    """(F, N) rewards of N completions, N / len(prompts) of each prompt in order (its group), called as
    the module doc says: the prompt and the answer of completion n's row repeated into lists aligned with
    the completions, each completion's text decoded from its ids (the end token already left out)."""
    group = len(completion_ids) // len(prompts)
    row = [n // group for n in range(len(completion_ids))]
    return score(
        names, [prompts[i] for i in row], [decode(ids) for ids in completion_ids], completion_ids,
        {"answer": [answers[i] for i in row]}, beside,
    )  # fmt: skip


def try_rewards(stage: Stage, examples: ExampleSources, beside: str | None = None) -> None:
    """Import a grpo stage's reward functions and call them once as a rollout does (the module doc), on
    the first TRIAL_ROWS train rows of each of its datasets, each with three made-up completions: its
    answer, "" and TRIAL_GARBAGE. RewardError (one line, naming the function and what it did) on the
    first that fails."""
    names = [reward.function for reward in stage.grpo_settings.rewards]
    reward_identities(names, beside)  # each one imports and has a file to identify it by
    tokenizer = examples.home.tokenizer
    encode = tokenizer.encode if tokenizer.identity else None  # byte level: UTF-8 bytes, as the rows
    for sampling in stage.datasets:
        source = examples.prompts(sampling.name)
        rows = [source.row("train", i) for i in range(min(TRIAL_ROWS, source.num_rows("train")))]
        if not rows:
            continue
        answers = [examples.answer(sampling.name, row) for row in rows]
        made_up = [
            list(encode_text(text, encode)) for answer in answers for text in (answer, "", TRIAL_GARBAGE)
        ]
        try:
            score_groups(names, [row.text for row in rows], answers, made_up, tokenizer.decode, beside)
        except RewardError as exc:
            raise RewardError(
                f"{exc} (tried before the run records anything, on {len(rows)} rows of {sampling.name!r} with 3 made-up "
                f"completions each: the row's answer, '' and {TRIAL_GARBAGE!r})"
            ) from None


def score(
    names: Sequence[str],
    prompts: list[str],
    completions: list[str],
    completion_ids: list[list[int]],
    row_fields: dict[str, list[str]],
    beside: str | None = None,
) -> torch.Tensor:
    """(F, N) float32 rewards of the N completions by each function (NaN where it gave None)."""
    rows = []
    for name in names:
        function = load_reward(name, beside)
        try:
            values = function(prompts, completions, completion_ids, **row_fields)
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
