"""A grpo stage's reward functions: the built-in `exact_match`, or your own as "module:function".

A reward function takes a batch and returns one reward per completion, None where it does not apply:

    def my_reward(prompts: list[str], completions: list[str], completion_ids: list[list[int]],
                  *, answer: list[str], **row_fields: list[str]) -> list[float | None]

Every argument is a list aligned with the completions (completion n of a rollout batch of P prompts x G
completions is the (n % G)-th of prompt n // G): `prompts[n]` is completion n's prompt text (each prompt
repeated G times), `completions[n]` its text (decoded, without the end token), `completion_ids[n]` its
token ids, and each row field (today `answer`: the dataset's answer_field, "answer" for the built-in
tasks) the field of completion n's row, as a list too. Several functions are summed by their weights
(rewind.engine.posttrain.grpo_losses.weighted_rewards; a function's None is left out of its completion's sum).

Before anything is recorded (a start, a resume, a fork), each function of each grpo stage is tried
(`try_rewards`): imported, then called once as a rollout calls it, on the first TRIAL_ROWS rows of each of
the stage's datasets with made-up completions (the row's answer, an empty one and TRIAL_GARBAGE), its
return checked as every rollout's is. A function that does not import, raises or returns what no reward is
says so in one line then, not after the stages before it have trained.

"module" is looked for first beside the config file (`beside`: the directory `rewind train CONFIG` or
`rewind fork --config CONFIG` read it from, as relative data paths are;
rewind.engine.data.userdata.DataHome.base_dir), then in the working directory, as `module.py` or a package
directory `module/`, and last on the Python path (an installed module). A command without a config file
(`rewind resume`, `rewind replay`, `rewind fork` without --config) looks in the working directory.
It runs with your permissions, as any code you ask a trainer to run, but as a guest: each call gets its own
copies of the arguments (one function sorting `completions` in place cannot misalign the next one's), the
working directory it may change is restored after its import and after every call (a run's relative paths
stay the run's), and a SystemExit it raises is one line naming it, not the end of the run (KeyboardInterrupt
still stops it). A reward is None or a real number (numbers.Real, so numpy's scalars and fractions too, but
never a bool) that converts to a finite float within float32's range; what is quoted of anything else, or
of an exception, is cut at QUOTE_LIMIT characters, on one line.
Its identity goes on record with every rollout batch (RolloutsRecorded.reward_code: the sha256 of the
module's file, of every module of yours it imports, and its __version__ when it has one; exactly what is
covered: rewind.engine.posttrain.reward_code): a resume inside the stage under other code is refused, as a changed
dataset is, because the rewards on record would no longer be what the code computes.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import math
import numbers
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext, suppress
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from rewind.engine.data.examples import encode_text, exact_match_rewards
from rewind.engine.posttrain.reward_code import code_change, forget, module_identity, watching

if TYPE_CHECKING:
    from rewind.engine.data.example_sources import ExampleSources
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
# At most this much of a value or an exception's message is quoted in a line (a function can return or
# raise megabytes).
QUOTE_LIMIT = 200
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
        with _guest(module_name):
            if found is not None:
                _import_from(top, found)
            return importlib.import_module(module_name)
    except (Exception, SystemExit) as exc:  # its own import errors included: said in one line, not a traceback
        if found is None and isinstance(exc, ModuleNotFoundError) and exc.name == top:
            where = " or ".join(
                f"{'beside the config' if beside and i == 0 else 'in the working directory'} ({place})"
                for i, place in enumerate(places)
            )
            raise RewardError(
                f"reward function {name}: cannot import {module_name}: no {top}.py nor {top}/ {where}, "
                "and no installed module of that name"
            ) from None
        what = str(exc) if isinstance(exc, RewardError) else _failure(exc)
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
        forget(key)
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
    """What `name`'s code is, for the record: "builtin", or its module's (rewind.engine.posttrain.reward_code:
    "sha256:<the module file's hex>", then ";imports=..." and ";version=V" where it has them)."""
    if name in BUILTIN:
        return BUILTIN_IDENTITY
    load_reward(name, beside)  # imported, so the module is in sys.modules
    module_name = name.partition(":")[0]
    source = getattr(sys.modules[module_name], "__file__", None)
    if not isinstance(source, str) or not Path(source).is_file():
        raise RewardError(f"reward function {name}: its module has no file to identify it by")
    return module_identity(module_name)


def reward_identities(names: Sequence[str], beside: str | None = None) -> dict[str, str]:
    return {name: reward_identity(name, beside) for name in names}


def reward_code_changes(
    recorded: dict[str, str], beside: str | None = None, *, run_dir: str | None = None, fork_at: int | None = None
) -> str:
    """Why the reward functions a stage's held batch was scored by are not the code here now ("" if they
    are), and the way forward: a resume inside the stage would score with other code than the record's.
    `run_dir` and `fork_at` (the step the stage began at) make the fork's command exact."""
    changed = changed_reward_code(recorded, beside)
    if not changed:
        return ""
    run, step = run_dir or "RUN", "N" if fork_at is None else str(fork_at)
    where = "" if fork_at is not None else f", N the step its grpo stage began at (`rewind log {run} --type StageEntered`)"
    return (
        f"{changed}; restore that code to go on, or go on under the new code in a fork from before the stage's "
        f"first rollout batch: `rewind fork {run} --at-step {step} NEW_RUN`{where}"
    )


def changed_reward_code(recorded: dict[str, str], beside: str | None = None) -> str:
    """The first of the functions `recorded` identifies whose code here is other code ("" if none is),
    and what of it changed (the content of its module's file or of a module it imports, its version)."""
    for name, was in sorted(recorded.items()):
        if what := code_change(name.partition(":")[0], was, reward_identity(name, beside)):
            return f"reward function {name} changed since the run scored with it: {what}"
    return ""


def score_groups(
    names: Sequence[str],
    prompts: Sequence[str],
    answers: Sequence[str],
    completion_ids: list[list[int]],
    decode: Decoder,
    beside: str | None = None,
    *,
    trial: bool = False,
) -> torch.Tensor:
    """(F, N) rewards of N completions, N / len(prompts) of each prompt in order (its group), called as
    the module doc says: the prompt and the answer of completion n's row repeated into lists aligned with
    the completions, each completion's text decoded from its ids (the end token already left out)."""
    group = len(completion_ids) // len(prompts)
    row = [n // group for n in range(len(completion_ids))]
    return score(
        names, [prompts[i] for i in row], [decode(ids) for ids in completion_ids], completion_ids,
        {"answer": [answers[i] for i in row]}, beside, trial=trial,
    )  # fmt: skip


def try_rewards(stage: Stage, examples: ExampleSources, beside: str | None = None) -> None:
    """Import a grpo stage's reward functions and call them once as a rollout does (the module doc), on
    the first TRIAL_ROWS train rows of each of its datasets, each with three made-up completions: its
    answer, "" and TRIAL_GARBAGE. RewardError (one line, naming the function and what it did) on the
    first that fails. What the imports and the calls import is noted: the identities cover it."""
    names = [reward.function for reward in stage.grpo.rewards]
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
            score_groups(names, [row.text for row in rows], answers, made_up, tokenizer.decode, beside, trial=True)
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
    *,
    trial: bool = False,
) -> torch.Tensor:
    """(F, N) float32 rewards of the N completions by each function (NaN where it gave None). Each call
    gets copies of the lists and runs as a guest (`_guest`); `trial`: what it imports is noted."""
    rows = []
    for name in names:
        function = load_reward(name, beside)
        try:
            owner = name.partition(":")[0] if name not in BUILTIN else None
            with _guest(owner if trial else None, _home_of(owner)):
                values = function(
                    list(prompts), list(completions), [list(ids) for ids in completion_ids],
                    **{field: list(values) for field, values in row_fields.items()},
                )  # fmt: skip
                rows.append(_rewards(name, values, len(completions)))  # user code may run here too (its types)
        except RewardError:
            raise
        except (Exception, SystemExit) as exc:  # the function's own failure: said in one line, naming it
            raise RewardError(f"reward function {name} failed: {_failure(exc)}") from None
    return torch.tensor(rows, dtype=torch.float32)


def _rewards(name: str, values: object, count: int) -> list[float]:
    """The `count` rewards `values` holds as floats (None: NaN), or RewardError. Its items are what is read,
    one by one: what a list's len() says is not asked."""
    if not isinstance(values, list | tuple):
        raise RewardError(
            f"reward function {name}: returned {_a(values)}, not a list or tuple of {_many(count, 'reward')}"
        )
    items = []
    try:
        for value in values:
            items.append(value)
            if len(items) > count:
                break
    except Exception as exc:
        raise RewardError(f"reward function {name}: returned {_a(values)} that does not read: {_failure(exc)}") from None
    if len(items) != count:
        many = f"more than {_many(count, 'reward')}" if len(items) > count else _many(len(items), "reward")
        raise RewardError(
            f"reward function {name}: returned {_a(values)} of {many} for {_many(count, 'completion')}"
        )
    return [_reward(name, value) for value in items]


def _reward(name: str, value: object) -> float:
    if value is None:
        return math.nan
    number = math.nan
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        with suppress(ArithmeticError, ValueError, TypeError):  # 10**5000 overflows: refused below
            number = float(value)
    if math.isfinite(number) and abs(number) <= FLOAT32_MAX:
        return number
    raise RewardError(
        f"reward function {name}: returned {_quoted(value)}, not a finite number (a real number such as an int, a float "
        "or a numpy scalar, not a bool, with |r| <= 3.4e38: float32) or None"
    )


@contextmanager
def _guest(owner: str | None, home: str | None = None) -> Iterator[None]:
    """Run user code (a reward module's import, a call): the working directory it may change is restored
    after it, and while `owner` is imported or tried, what it imports is noted (reward_code.watching).
    `home`, a reward module's directory, is on the Python path during a call, as while it was imported:
    an import inside the function finds the module's neighbours then too."""
    here = os.getcwd()
    if home is not None:
        sys.path.insert(0, home)
    try:
        with watching(owner) if owner is not None else nullcontext():
            yield
    finally:
        os.chdir(here)
        if home is not None and home in sys.path:
            sys.path.remove(home)


def _home_of(module_name: str | None) -> str | None:
    """The directory a reward module was found in (a package's parent), or None (a built-in, or a module
    rewind did not find beside a config or in the working directory: an installed one)."""
    top = None if module_name is None else module_name.partition(".")[0]
    if top is None or top not in _FOUND or top not in sys.modules:
        return None
    source = _file_of(sys.modules[top])
    if source is None:
        return None
    return str(source.parent.parent if source.name == "__init__.py" else source.parent)


def _a(value: object) -> str:
    """What a function returned, as a message names it: 'None', 'a list', 'an int'."""
    if value is None:
        return "None"
    kind = type(value).__name__
    return f"{'an' if kind.lower().startswith(tuple('aeiou')) else 'a'} {kind}"


def _many(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _failure(exc: BaseException) -> str:
    message = _text(exc, str)
    said = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    if isinstance(exc, SystemExit):
        return f"{said} (sys.exit: a reward function returns its rewards, it cannot end the run)"
    return said


def _quoted(value: object) -> str:
    if isinstance(value, int) and value.bit_length() > 64:  # (refused ones are past 2**128; 4300 digits have no repr)
        return f"an int of about {math.floor(value.bit_length() * math.log10(2)) + 1} digits"
    return _text(value, repr)


def _text(value: object, show: Callable[[object], str]) -> str:
    """`show(value)` on one line and cut at QUOTE_LIMIT characters (and what fails to show, said so)."""
    try:
        text = show(value)
    except Exception as exc:
        text = f"<a {type(value).__name__} that cannot be shown: {type(exc).__name__}>"
    if not isinstance(text, str):
        text = f"<a {type(value).__name__}>"
    cut = text[: QUOTE_LIMIT + 1].replace("\r", "\\r").replace("\n", "\\n")
    return cut[:QUOTE_LIMIT] + "..." if len(cut) > QUOTE_LIMIT else cut
