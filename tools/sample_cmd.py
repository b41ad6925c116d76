"""`rewind sample RUN --prompt TEXT`: the model of a committed checkpoint continues a prompt.

The model is the one a resume from that checkpoint would load (`rewind.engine.model.checkpoint_model.load_model`
under the layout and config the log gives it there: grown stacks, frozen and NF4 trunks, LoRA adapters),
the text goes through the run's tokenizer (RUN/data/tokenizer.json, or UTF-8 bytes), and the draw is
reproducible for a seed (rewind.engine.posttrain.sampling). It stops before the model's end token (`end_token_of`:
the tokenizer's <|endoftext|>, or the "\n" that ends a response of a byte-level model post-trained), unless
--no-stop. Only live checkpoints exist: retention deletes the rest, so `--at-step N` names a step that
still has one. Nothing is written to the run.

`model_at` is shared with `rewind eval`, `end_token_of` with `rewind export --hf`.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any

from rewind.tools.errors import CommandError, UsageError
from rewind.tools.jsonout import print_json

DEFAULT_MAX_TOKENS = 64


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sample", help="continue a prompt with the model of a checkpoint (--prompt TEXT)")
    p.add_argument("run_dir", metavar="RUN")
    add_checkpoint_option(p)
    p.add_argument("--prompt", required=True, metavar="TEXT", help="the text to continue")
    p.add_argument(
        "--max-tokens", type=int, default=None, metavar="K",
        help=f"new tokens at most, up to the model's context (block_size); default {DEFAULT_MAX_TOKENS} or the "
        "context if shorter; fewer when the model ends the text",
    )
    p.add_argument(
        "--temperature", type=float, default=1.0, metavar="T", help="0 = greedy (argmax); default 1.0"
    )
    p.add_argument(
        "--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling: (0, 1], default 1.0 (off)"
    )
    p.add_argument("--seed", type=int, default=0, metavar="S", help="the draw's seed (default 0)")
    p.add_argument(
        "--no-stop", action="store_true",
        help="draw --max-tokens tokens, through the end token; by default the text stops before it: the "
        "tokenizer's <|endoftext|>, or, for a model on UTF-8 bytes that has trained in an sft, dpo or grpo "
        'stage, the "\\n" that ends each response (a pretrained model\'s newlines end nothing)',
    )  # fmt: skip
    p.add_argument(
        "--json", action="store_true", help="one JSON object: prompt, completion, tokens, step, end_token, ..."
    )
    p.set_defaults(run=run)


def add_checkpoint_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--at-step", type=int, metavar="N", help="the checkpoint committed at step N (default: the last one)"
    )


@dataclass
class CheckpointModel:
    """A checkpoint's model, ready to run (CPU, eval mode is the caller's), and what it came from."""

    model: Any  # rewind.engine.model.model.GPT
    config: Any  # the config in force at the checkpoint (rewind.states.config.Config)
    checkpoint: str
    step: int
    state: Any  # the folded state at the checkpoint's restore point (rewind.states.state.State)
    entered: Any = None  # the entry that read it (rewind.engine.run.entry.Entered): eval opens its data


def model_at(run_dir: str, at_step: int | None) -> CheckpointModel:
    """The model of the run's last live checkpoint, or of the one at step `at_step`, built as a resume
    from it would build it: the layout of the restore point the checkpoint makes, the config in force
    there (replay chooses them the same way), computing with the run's kernels and thread count. Files
    are checked against the hashes the log recorded. One line (CommandError) for what stops it."""
    from rewind.engine.run.entry import enter
    from rewind.engine.run.parts import RunError
    from rewind.states.entry import ReadCheckpoint

    try:
        entered = enter(ReadCheckpoint(at_step), run_dir)
    except RunError as exc:
        raise CommandError(str(exc), exc.exit_code) from None
    point = entered.entry.point
    assert point is not None
    return CheckpointModel(
        model=entered.model, config=entered.entry.config, checkpoint=point.checkpoint, step=point.state.step,
        state=point.state, entered=entered,
    )  # fmt: skip


def run_tokenizer(run_dir: str, recorded: str):
    """The run's tokenizer (its tokenizer.json, or bytes), checked against the sha256 the log recorded
    (`recorded`): a tokenizer that is not the run's would turn the model's ids into the wrong text.
    Damaged or changed: one line, exit 1."""
    from rewind.engine.data.tokenizer import TokenizerError, load_run_tokenizer

    try:
        tokenizer = load_run_tokenizer(run_dir)
    except TokenizerError as exc:
        raise CommandError(f"{run_dir}: the run's tokenizer: {exc}", 1) from None
    if tokenizer.identity != recorded:
        found, logged = tokenizer.identity[:12] or "bytes (no tokenizer.json)", recorded[:12] or "bytes"
        raise CommandError(
            f"{run_dir}: the run's tokenizer is not the one it was trained with ({found}; the log records {logged})", 1
        )
    return tokenizer


def end_token_of(config, stage: int, tokenizer) -> int | None:
    """The token a model's text ends with, None for none: the tokenizer's <|endoftext|> where it has one;
    else, for a model that has trained in a post-training stage (`stage`, the checkpoint's, or an earlier
    one reads examples: sft, dpo, grpo or distill), the end of a response, its "\n" (rewind.engine.data.examples.end_token: a
    response is one line there); else none, as a model pretrained on bytes writes lines of text that a newline
    does not end. `tokenizer`: the run's (rewind.engine.data.tokenizer)."""
    from rewind.engine.data.examples import end_token
    from rewind.engine.data.tokenizer import TokenizerError
    from rewind.states.stagekinds import rules_of

    if tokenizer.eos_id is not None:
        return tokenizer.eos_id
    if not any(rules_of(s).reads for s in config.stages[: stage + 1]):  # no stage so far reads examples
        return None
    try:
        return end_token(tokenizer)
    except TokenizerError:  # "\n" is several tokens: such a tokenizer cannot post-train (a run refuses it)
        return None


def refuse_masked(config, what: str) -> None:
    """A masked objective's model does not predict the next token: one line, exit 2."""
    if config.objective.kind != "clm":
        raise UsageError(
            f"the run trains a masked objective ({config.objective.kind}), which does not predict left to "
            f"right: cannot {what}"
        )


def new_token_limit(asked: int | None, block_size: int) -> int:
    """How many new tokens to draw at most: what was asked, within the model's context (a continuation
    longer than block_size would no longer see its own start, and a typo of 10**9 would run for days)."""
    if asked is None:
        return min(DEFAULT_MAX_TOKENS, block_size)
    if asked > block_size:
        raise UsageError(
            f"--max-tokens {asked}: at most the model's context, {block_size} tokens (architecture.block_size)"
        )
    return asked


def run(args: argparse.Namespace) -> int:
    from rewind.engine.posttrain.sampling import NonFiniteLogits, SamplingError, generate

    if args.prompt == "":
        raise UsageError("--prompt '': an empty prompt; give some text to continue")
    if args.max_tokens is not None and args.max_tokens < 0:
        raise UsageError(f"--max-tokens {args.max_tokens}: must be >= 0")
    if not 0.0 <= args.temperature < math.inf:  # NaN fails too
        raise UsageError(f"--temperature {args.temperature}: must be a finite number >= 0 (0 = greedy)")
    if not 0.0 < args.top_p <= 1.0:
        raise UsageError(f"--top-p {args.top_p}: must be in (0, 1]")
    loaded = model_at(args.run_dir, args.at_step)
    refuse_masked(loaded.config, "sample")
    max_tokens = new_token_limit(args.max_tokens, loaded.config.architecture.block_size)
    tokenizer = run_tokenizer(args.run_dir, loaded.state.tokenizer)
    prompt_ids = tokenizer.encode(args.prompt)
    vocab_size = loaded.config.architecture.vocab_size
    outside = sorted({i for i in prompt_ids if i >= vocab_size})
    if outside:
        raise UsageError(
            f"--prompt: token id {outside[0]} is outside the model's vocabulary ({vocab_size} ids); "
            "the text has characters the run never trained on"
        )
    end = None if args.no_stop else end_token_of(loaded.config, loaded.state.stage, tokenizer)
    try:
        tokens = generate(
            loaded.model,
            prompt_ids,
            max_new_tokens=max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            eos_id=end,
        )
    except NonFiniteLogits as exc:
        raise CommandError(f"{args.run_dir}: checkpoint {loaded.checkpoint}: {exc}", 1) from None
    except SamplingError as exc:
        raise UsageError(str(exc)) from None
    completion = tokenizer.decode(tokens)
    if args.json:
        print_json({
            "prompt": args.prompt,
            "completion": completion,
            "tokens": tokens,
            "prompt_tokens": prompt_ids,
            "step": loaded.step,
            "checkpoint": loaded.checkpoint,
            "seed": args.seed,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "max_tokens": max_tokens,
            "end_token": end,  # None: it runs to max_tokens (--no-stop, or a model without an end)
            "stopped": "max_tokens" if len(tokens) == max_tokens else "eos",
        }, indent=None)
    else:
        print(completion)
    return 0
