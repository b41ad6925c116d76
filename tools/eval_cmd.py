"""`rewind eval RUN --dataset NAME`: a checkpoint's figures on a dataset's validation split, on demand.

The rows, the loss and the accuracy are those of a boundary evaluation (rewind.engine.step.evaluation): the
first `--samples` validation rows (default: the run's `training.eval_samples`), the mean masked
cross-entropy, its perplexity, bits per byte from the run's tokenizer's byte length per token, and
answer-token accuracy only for a dataset whose loss mask marks answers (a task, prompt/response pairs).
The datasets are opened as the run reads them (its data home: rewind.engine.data.rundata), so NAME is any
dataset of the run's config; data that changed since the run recorded it is refused, as replay refuses
it. Nothing is written: not the log, not the metrics.
"""

from __future__ import annotations

import argparse
import math

from rewind.tools.errors import CommandError, UsageError
from rewind.tools.jsonout import NON_FINITE_HELP, print_json
from rewind.tools.sample_cmd import CheckpointModel, add_checkpoint_option, model_at, refuse_masked


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="a checkpoint's loss, perplexity, bits per byte (and accuracy) on a dataset")
    p.add_argument("run_dir", metavar="RUN")
    p.add_argument("--dataset", required=True, metavar="NAME", help="a dataset of the run's config")
    add_checkpoint_option(p)
    p.add_argument(
        "--samples", type=int, metavar="K", help="validation rows to score (default: training.eval_samples)"
    )
    p.add_argument("--json", action="store_true", help=f"one JSON object ({NON_FINITE_HELP})")
    p.set_defaults(run=run)


def _finite(value: float | None) -> float | None:
    """JSON has no NaN or inf: those are null."""
    return value if value is not None and math.isfinite(value) else None


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def open_run_data(run_dir: str, loaded: CheckpointModel, name: str):
    """The run's datasets and tokenizer as the run reads them at the checkpoint (the data home the log
    gives it, as replay opens it), for scoring dataset `name`: its data, when it changed since the run
    recorded it, is refused (exit 1); the others are not looked at. Nothing is written to the run:
    documents it never tokenised go to a scratch directory (rewind.engine.run.entry.open_checkpoint_data)."""
    from rewind.engine.run.entry import open_checkpoint_data
    from rewind.engine.run.parts import RunError

    try:
        return open_checkpoint_data(loaded.entered, name)
    except RunError as exc:
        raise CommandError(str(exc), exc.exit_code) from None


def run(args: argparse.Namespace) -> int:
    from rewind.engine.data.datasets import DatasetError
    from rewind.engine.step.evaluation import evaluate_dataset

    if args.samples is not None and args.samples <= 0:
        raise UsageError(f"--samples {args.samples}: must be at least 1")
    loaded = model_at(args.run_dir, args.at_step)
    config = loaded.config
    refuse_masked(config, "score next-token figures")
    if args.dataset not in config.dataset_names():
        known = ", ".join(sorted(config.dataset_names()))
        raise UsageError(f"--dataset {args.dataset}: not a dataset of the run (known: {known})")
    datasets, tokenizer = open_run_data(args.run_dir, loaded, args.dataset)
    num_samples = config.training.eval_samples if args.samples is None else args.samples
    try:
        dataset = datasets[args.dataset]
        figures = evaluate_dataset(loaded.model, dataset, config, num_samples, tokenizer.token_num_bytes())
    except DatasetError as exc:
        raise CommandError(str(exc), 1) from None
    accuracy = figures.accuracy if dataset.has_answers else None
    result = {
        "dataset": args.dataset,
        "step": loaded.step,
        "checkpoint": loaded.checkpoint,
        "samples": min(num_samples, dataset.num_samples("validation")),
        "tokens": figures.num_tokens,
        "bytes": figures.num_bytes,
        "loss": _finite(figures.loss),
        "perplexity": _finite(figures.perplexity),
        "bits_per_byte": _finite(figures.bits_per_byte),
        "accuracy": _finite(accuracy),
    }
    if args.json:
        print_json(result, indent=None)
        return 0
    print(
        f"{args.dataset} at step {loaded.step} (checkpoint {loaded.checkpoint}): {result['samples']} validation "
        f"rows, {figures.num_tokens} target tokens, {figures.num_bytes} bytes"
    )
    print(f"  loss           {_number(result['loss'])}")
    print(f"  perplexity     {_number(result['perplexity'])}")
    print(f"  bits per byte  {_number(result['bits_per_byte'])}")
    if dataset.has_answers:
        print(f"  accuracy       {_number(result['accuracy'])}  (answer tokens)")
    return 0
