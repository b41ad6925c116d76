"""Longer run logs for the tests of the streaming readers and commands: a three-stage config of any
length (`long_config`) for `rewind.states.strategies.simulate_run` to make the events of, crashes and
resumes included, and `write_run` to put events into a log with the segment size a test wants.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from rewind.states.config import Config
from rewind.states.config_reading import loads_config
from rewind.states.events import Event, StepCommitted
from rewind.stores.eventlog import EventLog

# examples/tiny.toml stretched to any number of steps of 256 tokens, with the duties a long run has.
LONG_CONFIG = """
[run]
name = "long"
seed = 7

[architecture]
block_size = 32
vocab_size = 256
num_layers = 2
num_heads = 2
d_model = 32

[training]
batch_size = 8
tokens = [{tokens_a}, {tokens_b}, {tokens_b}]
datasets = [
    [{{ name = "grammar", rate = 1.0 }}],
    [{{ name = "reverse", rate = 1.0 }}],
    [{{ name = "sort", rate = 0.5 }}, {{ name = "reverse", rate = 0.5 }}],
]
evaluations = ["reverse", "sort"]
validation_steps = 1

[training.fade]
overlap = 0.5
curve = "linear"

[optimization]
lr = 3e-3
schedule = "cosine"
warmup_pct = 0.05

[optimization.kl]
betas = [0.0, 0.2, 0.2]
reference_update_stages = [1]

[logging]
report_interval = 100
validation_interval = {validation_interval}
checkpoint_interval = {checkpoint_interval}
keep_last_checkpoints = 3
"""
TOKENS_PER_STEP = 256


def long_config(num_steps: int) -> Config:
    """Three stages over `num_steps` steps (half of them in stage 0, a quarter in each of the others),
    a checkpoint every twentieth of the run and a validation every hundredth."""
    quarter = num_steps // 4
    return loads_config(
        LONG_CONFIG.format(
            tokens_a=(num_steps - 2 * quarter) * TOKENS_PER_STEP,
            tokens_b=quarter * TOKENS_PER_STEP,
            validation_interval=max(1, num_steps // 100),
            checkpoint_interval=max(1, num_steps // 20),
        )
    )


def write_run(
    run_dir: str | Path, events: Iterable[Event], *, commit_every: int = 100, segment_bytes: int | None = None
) -> int:
    """Append `events` to a new log at `run_dir`, committing every `commit_every` steps (as the engine
    groups its commits), in segments of `segment_bytes` (the log's default if None); returns the
    number of records."""
    count = 0
    sizing = {} if segment_bytes is None else {"segment_bytes": segment_bytes}
    with EventLog.open(run_dir, "w", **sizing) as log:
        for event in events:
            if isinstance(event, StepCommitted) and event.step % commit_every == 0:
                log.commit()
            log.append(event)
            count += 1
        log.commit()
    return count
