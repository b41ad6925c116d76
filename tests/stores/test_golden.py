"""A log written by an earlier version of this code must stay readable, event for event.

`golden/run/` was written by `make_golden.py` under schema version 1 (rewind 0.1), `golden/run-v2/`
under schema 2; both are committed as binary, with `golden/config.json`, the default Config of that
day, which their RunStarted carries. Both must decode into today's `golden_events()`: the v1 log's
RunResumed carried the whole restored State, which the upcaster (`rewind.stores.upcasters`) turns into
today's seed. Never regenerate a golden log to make this test pass: a failure means old logs no longer
read, which needs an upcaster (or a default for the new field). When the schema is bumped again, add a
golden log for the new version next to these and keep every test.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import msgspec
import pytest

from rewind.states.config import Config, Sampling
from rewind.states.data_identity import DataIdentity, SourceFile
from rewind.states.events import (
    EVENT_TYPES,
    SCHEMA_VERSION,
    ActivationsCached,
    CheckpointCommitted,
    CheckpointDeleted,
    ConfigChanged,
    EpochStarted,
    Evaluated,
    FadeEnded,
    FadeStarted,
    ForkOrigin,
    NonFiniteLoss,
    OptimizerReset,
    ReferenceRefreshed,
    RolloutsRecorded,
    RunFinished,
    RunResumed,
    RunStarted,
    RunStopped,
    StackAppended,
    StageEntered,
    StepCommitted,
    Validated,
)
from rewind.states.stageform import to_stage_form
from rewind.states.stages import PretrainStage
from rewind.states.state import ForkSeed, Reference
from rewind.stores.codec import FRAME_FORMAT, MAGIC, MAGIC_V1
from rewind.stores.eventlog import EventLog, verify_log

GOLDEN_DIR = Path(__file__).parent / "golden"
GOLDEN_RUN = GOLDEN_DIR / "run"  # schema 1
GOLDEN_RUNS = {
    1: GOLDEN_RUN,
    2: GOLDEN_DIR / "run-v2",
    3: GOLDEN_DIR / "run-v3-f2",
    4: GOLDEN_DIR / "run-v4-f2",
    5: GOLDEN_DIR / "run-v5-f2",
    6: GOLDEN_DIR / "run-v6-f2",
    7: GOLDEN_DIR / "run-v7-f2",
    8: GOLDEN_DIR / "run-v8-f2",
    9: GOLDEN_DIR / "run-v9-f2",
    10: GOLDEN_DIR / "run-v10-f2",
}  # 1, 2: frame format 1
# By frame format: format 2 marks the end of each commit group (stores/codec.py).
GOLDEN_FRAME_RUNS = {1: GOLDEN_DIR / "run-v2", 2: GOLDEN_DIR / "run-v3-f2"}
# Event types a schema version added, which the goldens of older versions cannot hold.
ADDED_IN = {"OptimizerReset": 3, "ActivationsCached": 4, "EpochStarted": 5, "RolloutsRecorded": 9}
GOLDEN_CONFIG = GOLDEN_DIR / "config.json"  # Config() as it was when the log was written
GOLDEN_SEGMENT_BYTES = 1024  # small, so the golden log spans several segments
HASH = "9f2c4e1a" * 8
SHA = "5d41402abc4b2a76b9719d911017c592" * 2
# config_hash(Config()) when the log was written; a literal, since adding a config field with a default
# changes today's hash but must not break reading old logs.
DEFAULT_CONFIG_HASH = "2681743c22da3700b8e183de0efd5455a19104f36fdd23bdbf1b4a1fd5015332"


# The stages the logs of schema 8 on carry (as records; the older ones' config has none, as flat lists).
GOLDEN_STAGES = [
    PretrainStage(name="A", tokens=51200, datasets=[Sampling(name="grammar")], beta=0.0, overlap=0.25),
    PretrainStage(
        tokens=25600,
        datasets=[Sampling(name="reverse", rate=0.75), Sampling(name="grammar", rate=0.25)],
        beta=0.1,
        refresh_reference=True,
        reset_optimizer=True,
    ),
]


def golden_config(version: int = SCHEMA_VERSION) -> Config:
    """The default Config of the day the log was written: its values are what the log holds, even if
    the defaults change later (fields added since decode to their defaults). It was written with the
    flat per-stage lists (empty), which read as no stages; logs of schema 8 on add `GOLDEN_STAGES`."""
    flat = to_stage_form(msgspec.json.decode(GOLDEN_CONFIG.read_bytes()))[0]
    config = msgspec.convert(flat, Config)
    return msgspec.structs.replace(config, stages=GOLDEN_STAGES) if version >= 8 else config


def golden_events(config: Config | None = None, version: int = SCHEMA_VERSION) -> list:
    """One of every event type of schema `version`, with realistic field values, as today's code decodes
    them (a field added since decodes to its default)."""
    config = config if config is not None else golden_config(version)
    newer = version >= 3
    corpus = DataIdentity(
        kind="tokens",
        sources=[SourceFile(path="data/corpus.bin", size=1 << 20, fingerprint=SHA, sha256=SHA)],
        prepared=SHA,
        tokenizer=HASH,
        num_tokens=1 << 19,
    )
    data_on_record = {"data": {"corpus": corpus}, "tokenizer": HASH} if version >= 5 else {}
    checkpoint = CheckpointCommitted(
        checkpoint="00000120-3fa85f64",
        step=120,
        tokens=61440,
        reason="interval",
        manifest_sha256=SHA,
        files={"model.safetensors": SHA, "optimizer.safetensors": SHA},
    )
    # The v1 log stored a whole State here (`restored`); what of it a fork needs is today's seed.
    seed = ForkSeed(
        config_hash=HASH,
        tokens_per_step=512,
        num_stages=2,
        stage=1,
        num_stages_entered=2,
        reference=Reference(stage=1, step=100, checkpoint="00000100-0b1c2d3e"),
        cursors={"grammar": 700, "reverse": 260},
        last_loss=1.875,
        live_checkpoints=[checkpoint],
        last_validated_step=120,  # the upcast's: 0.1's restore point came after that step's validation
    )
    return [
        RunStarted(
            step=0,
            tokens=0,
            config=config,
            config_hash=DEFAULT_CONFIG_HASH,
            rewind_version="0.1.0",
            parent=ForkOrigin(run="runs/base", step=400, checkpoint="00000400-deadbeef", config_hash=HASH),
            features=["lr_warmup_floor", "baseline_evaluation"] if newer else [],
            **data_on_record,
            **({"pretrained": SHA} if version >= 5 else {}),
            **({"device": "cpu", "world_size": 2} if version >= 6 else {}),
        ),
        Evaluated(
            step=0,
            tokens=0,
            boundary=-1,
            scores={"add": 0.0625, "sort": 0.125},
            losses={"add": 4.5},
            **({"bits_per_byte": {"corpus": 1.25}} if version >= 5 else {}),
        ),
        StageEntered(step=0, tokens=0, stage=0),
        StackAppended(step=0, tokens=0, stack=1, num_blocks=2, position="prepend", trunk="lora"),
        *(
            [
                StackAppended(
                    step=0,
                    tokens=0,
                    stack=2,
                    num_blocks=1,
                    growth=1,
                    init="copy",
                    trunk="qlora",
                    precision="nf4",
                    rank=16,
                    trunk_ranks={"0": 8, "1": 4},
                    alpha_per_rank=2.0,
                ),
                ActivationsCached(step=0, tokens=0, version=2, num_steps=40, num_rows=320, path="cache/trunk-2.zarr", num_bytes=1 << 20),
            ]
            if version >= 4
            else []
        ),
        *([EpochStarted(step=0, tokens=0, dataset="corpus", epoch=1)] if version >= 5 else []),
        StepCommitted(
            step=1,
            tokens=512,
            stage=0,
            lr=3e-6,
            beta=0.0,
            loss=5.541263580322266,
            kl=0.0,
            grad_norm=3.25,
            rows=[8, 0],
            cursors={"grammar": 8},
        ),
        *(
            [
                RolloutsRecorded(
                    step=1,
                    tokens=512,
                    stage=0,
                    path=f"rollouts/{SHA}.safetensors",
                    sha256=SHA,
                    num_prompts=2,
                    group_size=4,
                    cursors={"grammar": 8, "add": 2},
                    mean_reward=0.375,
                )
            ]
            if version >= 9
            else []
        ),
        StepCommitted(
            step=2,
            tokens=1024,
            stage=0,
            lr=6e-6,
            beta=0.1,
            loss=float("inf"),
            rows=[8, 0],
            cursors={"grammar": 16},
            skipped=True,
            **({"metrics": {"reward": 0.375, "clipped_low": 0.0625}} if version >= 9 else {}),
        ),
        NonFiniteLoss(
            step=2, tokens=1024, loss=float("inf"), action="skip", quantity="grad_norm" if newer else "loss"
        ),
        Validated(step=2, tokens=1024, losses={"grammar": 5.25, "reverse": 5.5}),
        FadeStarted(step=50, tokens=25600, boundary=0),
        CheckpointCommitted(
            step=100,
            tokens=51200,
            checkpoint="00000100-0b1c2d3e",
            manifest_sha256=SHA,
            files={"model.safetensors": SHA},
            reason="reference",
        ),
        StageEntered(step=100, tokens=51200, stage=1),
        ReferenceRefreshed(step=100, tokens=51200, stage=1, checkpoint="00000100-0b1c2d3e"),
        *([OptimizerReset(step=100, tokens=51200, stage=1, lr_restarted=True)] if newer else []),
        FadeEnded(step=110, tokens=56320, boundary=0),
        CheckpointDeleted(step=120, tokens=61440, checkpoint="00000040-1234abcd"),
        RunStopped(step=120, tokens=61440, reason="interrupted (SIGINT)"),
        RunResumed(
            step=120,
            tokens=61440,
            checkpoint="00000120-3fa85f64",
            superseded_first_seq=15,
            superseded_last_seq=14,
            config_hash=HASH,
            seed=seed,
            **({"device": "cuda:NVIDIA H100 80GB HBM3", "world_size": 1} if version >= 6 else {}),
            **({"num_threads": 3} if version >= 7 else {}),
        ),
        ConfigChanged(
            step=120,
            tokens=61440,
            config=config,
            config_hash=DEFAULT_CONFIG_HASH,
            previous_hash=HASH,
            **data_on_record,
        ),
        RunFinished(step=200, tokens=102400),
    ]


@pytest.mark.parametrize("version", sorted(GOLDEN_RUNS))
def test_the_golden_log_still_reads_event_for_event(version):
    records = list(EventLog.open(GOLDEN_RUNS[version]).records(check=False))
    assert [r.event for r in records] == golden_events(version=version)
    assert [r.seq for r in records] == list(range(len(records)))
    assert {r.version for r in records} == {version}
    assert len({r.segment for r in records}) > 1


@pytest.mark.parametrize("version", sorted(GOLDEN_RUNS))
def test_the_golden_log_verifies_clean_and_covers_every_type(version):
    report = verify_log(GOLDEN_RUNS[version])
    events = golden_events(version=version)
    assert report.ok and report.torn_tail is None and report.next_seq == len(events)
    expected = {name for name in EVENT_TYPES if ADDED_IN.get(name, 1) <= version}
    assert {type(e).__name__ for e in events} == expected


def test_there_is_a_golden_log_of_todays_schema():
    assert SCHEMA_VERSION in GOLDEN_RUNS


@pytest.mark.parametrize("frame_format", sorted(GOLDEN_FRAME_RUNS))
def test_the_golden_log_of_each_frame_format_reads_and_verifies(frame_format):
    run = GOLDEN_FRAME_RUNS[frame_format]
    assert frame_format in GOLDEN_FRAME_RUNS and FRAME_FORMAT in GOLDEN_FRAME_RUNS
    records = list(EventLog.open(run).records(check=False))
    version = 3 if frame_format == 2 else 2
    assert [r.event for r in records][: len(golden_events(version=version))] == golden_events(version=version)
    magic = MAGIC if frame_format == 2 else MAGIC_V1
    segments = {r.segment: (run / "events" / r.segment).read_bytes() for r in records}
    assert all(segments[r.segment][r.offset : r.offset + 4] == magic for r in records)
    report = verify_log(run)
    assert report.ok and report.torn_tail is None and report.next_seq == len(records)


@pytest.mark.parametrize("frame_format", sorted(GOLDEN_FRAME_RUNS))
def test_a_golden_log_of_each_frame_format_stays_appendable(frame_format, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(GOLDEN_FRAME_RUNS[frame_format], run)
    extra = RunFinished(step=300, tokens=153600)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to recover in a golden log
        with EventLog.open(run, "w") as log:
            num_before = log.next_seq
            log.append(extra)
            log.commit()
    records = list(EventLog.open(run).records(check=False))
    assert [r.event for r in records[num_before:]] == [extra] and len(records) == num_before + 1
    last = records[-1]
    data = (run / "events" / last.segment).read_bytes()
    assert data[last.offset : last.offset + 4] == MAGIC  # writers always write today's format
    assert verify_log(run).ok
