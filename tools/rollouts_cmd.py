"""`rewind rollouts RUN [--step N] [--json]`: the completions, rewards and advantages of a grpo step.

Read from the record: the last RolloutsRecorded among the run's effective records at or before step N
(default: the last one) names a rollout file by path and sha256 (rewind.stores.rollouts), which is
checked before anything in it is shown. Per prompt: its dataset and row, its text, then each completion
decoded with the run's tokenizer (the end token left out of the text: the finish reason says it was
there), how it finished ("eos" or "length": cut at max_new_tokens), each reward function's value in
the order of `reward_functions` (a list: a function may be named twice; None where it did not apply)
and its advantage. The batch's mean reward is the record's, over the completions some function scored;
`unscored` counts the others. Nothing is written to the run.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rewind.tools.errors import CommandError, UsageError
from rewind.tools.jsonout import NON_FINITE_HELP

ROLLOUTS_RECORDED = "RolloutsRecorded"  # the record's tag (rewind.states.events)
FINISH_REASONS = ("length", "eos")  # by the file's `finished` value


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "rollouts", help="the completions, rewards and advantages of a grpo step, from the record"
    )
    p.add_argument("run_dir", metavar="RUN")
    p.add_argument(
        "--step",
        type=int,
        metavar="N",
        help="the rollout batch recorded at or before step N (default: the last one)",
    )
    p.add_argument("--json", action="store_true", help=f"one JSON object: the batch's record and its prompts ({NON_FINITE_HELP})")
    p.set_defaults(run=run)


def last_rollouts(records: Sequence[tuple[int, Any]], step: int | None) -> int | None:
    """The index in `records` (effective (seq, event) pairs) of the last RolloutsRecorded whose step is
    at most `step` (any step when None); None when there is none."""
    found = None
    for index, (_, event) in enumerate(records):
        if step is not None and event.step > step:
            break  # effective records are in step order
        if is_rollouts(event):
            found = index
    return found


def is_rollouts(event: Any) -> bool:
    """Whether `event` is a RolloutsRecorded (told by its tag: the one place this command asks)."""
    from rewind.states.events import event_tag

    return event_tag(event) == ROLLOUTS_RECORDED


def show_rollouts(
    run_dir: str, record: Mapping[str, Any], decode: Callable[[list[int]], str], datasets: Sequence[str] = ()
) -> dict:
    """The rollout batch a RolloutsRecorded with fields `record` names, as a dict ready for JSON: the
    record's figures, then per prompt its completions. `decode` turns token ids into text; `datasets`:
    the names of the record's stage's datasets (what prompt_sources index). RolloutError (one line) for
    a file that is missing, damaged or not what the record says."""
    from rewind.stores.rollouts import RolloutError, read_rollouts

    tensors, metadata = read_rollouts(run_dir, record["path"], record["sha256"])
    num_prompts, num_completions = len(tensors["prompts"]), len(tensors["completions"])
    group_size = num_completions // num_prompts
    if (num_prompts, group_size) != (record["num_prompts"], record["group_size"]):
        raise RolloutError(
            f"{record['path']}: holds {num_prompts} prompts x {group_size} completions, but its record says "
            f"{record['num_prompts']} x {record['group_size']}"
        )
    names = metadata["reward_functions"].split(",")
    rewards = tensors["rewards"].tolist()
    advantages, finished = tensors["advantages"].tolist(), tensors["finished"].tolist()
    completion_lengths = tensors["completion_lengths"].tolist()
    prompts = []
    for p, (source, row, length) in enumerate(
        zip(
            tensors["prompt_sources"].tolist(),
            tensors["prompt_rows"].tolist(),
            tensors["prompt_lengths"].tolist(),
            strict=True,
        )
    ):
        prompt_tokens = tensors["prompts"][p, :length].tolist()
        completions = []
        for n in range(p * group_size, (p + 1) * group_size):
            tokens = tensors["completions"][n, : completion_lengths[n]].tolist()
            completions.append(
                {
                    "sample": n % group_size,
                    "text": decode(tokens[: len(tokens) - finished[n]]),
                    "tokens": tokens,
                    "finish": FINISH_REASONS[finished[n]],
                    "rewards": [None if math.isnan(row[n]) else row[n] for row in rewards],
                    "advantage": advantages[n],
                }
            )
        prompts.append(
            {
                "prompt": p,
                "source": source,
                "dataset": datasets[source] if source < len(datasets) else None,
                "row": row,
                "text": decode(prompt_tokens),
                "tokens": prompt_tokens,
                "completions": completions,
            }
        )
    return {
        "step": record["step"],
        "stage": record["stage"],
        "policy_step": int(metadata["policy_step"]),
        "path": record["path"],
        "sha256": record["sha256"],
        "num_prompts": num_prompts,
        "group_size": group_size,
        "reward_functions": names,
        "mean_reward": record["mean_reward"],  # over the completions some function scored
        "unscored": record["unscored"],  # the others: no function scored them
        "cursors": dict(record["cursors"]),
        "prompts": prompts,
    }


def render(shown: dict) -> list[str]:
    """The text output: a header line, then per prompt its text and one line per completion. Texts are
    quoted as JSON strings, so a newline in one never breaks a line."""
    lines = [
        f"rollouts recorded at step {shown['step']:,} (stage {shown['stage']}, sampled by the weights of step "
        f"{shown['policy_step']:,}): {shown['num_prompts']} prompts x {shown['group_size']} completions, "
        f"mean reward {shown['mean_reward']:.4g}"
        + ("" if shown["unscored"] is None else f" over the scored completions ({shown['unscored']} unscored)"),
        f"file {shown['path']}",
    ]
    for prompt in shown["prompts"]:
        where = prompt["dataset"] if prompt["dataset"] is not None else f"dataset {prompt['source']}"
        lines += [
            "",
            f"prompt {prompt['prompt']} ({where}, row {prompt['row']:,}): {json.dumps(prompt['text'])}",
        ]
        for completion in prompt["completions"]:
            rewards = "  ".join(
                f"{name} {'none' if value is None else f'{value:.4g}'}"
                for name, value in zip(shown["reward_functions"], completion["rewards"], strict=True)
            )
            lines.append(
                f"  [{completion['sample']}] {completion['finish']:<6}  {rewards}  advantage "
                f"{completion['advantage']:+.4f}  {json.dumps(completion['text'])}"
            )
    return lines


def run(args: argparse.Namespace) -> int:
    import msgspec

    from rewind.states.history import config_in_force, effective
    from rewind.stores.rollouts import RolloutError
    from rewind.tools.jsonout import print_json
    from rewind.tools.runlog import load_records
    from rewind.tools.sample_cmd import run_tokenizer
    from rewind.tools.state_cmd import fold_events

    records = effective(load_records(args.run_dir))
    state = fold_events(args.run_dir, (event for _, event in records))
    if args.step is not None and not 0 <= args.step <= state.step:
        raise UsageError(
            f"--step {args.step}: out of range; the run reached step {state.step} (use 0..{state.step})"
        )
    recorded_at = [event.step for _, event in records if is_rollouts(event)]
    if not recorded_at:
        raise CommandError(
            f"{args.run_dir}: no rollout batch on record (the run has trained no grpo or distill step)", 1
        )
    index = last_rollouts(records, args.step)
    if index is None:
        raise UsageError(
            f"--step {args.step}: no rollout batch at or before it; the first is at step {recorded_at[0]}"
        )
    event = records[index][1]
    config = config_in_force(records[: index + 1])
    stages = config.stages
    datasets = [s.name for s in stages[event.stage].datasets] if 0 <= event.stage < len(stages) else []
    decode = _decoder(run_tokenizer(args.run_dir, state.tokenizer), config.architecture.vocab_size)
    from rewind.engine.step.kinds import batch_problem  # (torch: only once the record is found)

    if problem := batch_problem(args.run_dir, event, config, None, state.behaviours):  # what no run writes is not shown
        raise CommandError(f"{args.run_dir}: {problem}", 1)
    try:
        shown = show_rollouts(args.run_dir, msgspec.structs.asdict(event), decode, datasets)
    except RolloutError as exc:
        raise CommandError(f"{args.run_dir}: {exc}", 1) from None
    if not state.behaviours.scored_reward_figures:  # a run started before: its mean counts them as 0
        shown["unscored"] = None
    if args.json:
        print_json(shown)
    else:
        print("\n".join(render(shown)))
    return 0


def _decoder(tokenizer: Any, vocab_size: int) -> Callable[[list[int]], str]:
    """The tokenizer's decode, refusing ids outside the model's vocabulary (a file that could not have
    come from the run's model) in one line instead of an error from inside the tokenizer."""
    from rewind.stores.rollouts import RolloutError

    def decode(ids: list[int]) -> str:
        if ids and max(ids) >= vocab_size:
            raise RolloutError(f"token id {max(ids)} is outside the model's vocabulary ({vocab_size} ids)")
        return tokenizer.decode(ids)

    return decode
