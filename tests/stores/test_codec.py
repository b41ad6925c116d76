"""Frames and schema evolution: upcasters for old versions, a clear refusal for newer ones."""

from __future__ import annotations

import google_crc32c
import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rewind.states import events as events_module
from rewind.states.events import SCHEMA_VERSION, StepCommitted
from rewind.stores import codec, fsio
from rewind.stores.codec import (
    HEADER_SIZE,
    MAGIC,
    RESIDUE,
    BadFrame,
    EventDecoder,
    FrameEncoder,
    encode_frame,
    mark_end_of_group,
    parse_frame,
)
from rewind.stores.eventlog import (
    EVENTS_DIR,
    EventLog,
    UnsupportedSchemaError,
    read_events,
    segment_name,
    verify_log,
)
from rewind.stores.segparse import parse_segment
from tests.stores.samples import events_strategy

# How a StepCommitted looked in a (made-up) schema version 0: "learning_rate" instead of "lr", and
# no "beta" yet. The upcaster 0 -> 1 below is what a real schema bump would register.
OLD_STEP = {"type": "StepCommitted", "step": 3, "tokens": 96, "stage": 0, "learning_rate": 0.01, "loss": 2.0}
NEW_STEP = StepCommitted(step=3, tokens=96, stage=0, lr=0.01, beta=0.0, loss=2.0)


def upcast_0_to_1(raw: dict) -> dict:
    if raw.get("type") == "StepCommitted":
        raw = {**raw, "lr": raw.pop("learning_rate"), "beta": 0.0}
    return raw


def write_frames(run_url: str, frames: list[bytes]) -> None:
    events_dir = fsio.filesystem(run_url).join(EVENTS_DIR)
    events_dir.makedirs()
    events_dir.join(segment_name(0)).write_atomic(b"".join(frames))


@given(event=events_strategy(), seq=st.integers(0, 2**64 - 1))
def test_a_framed_event_decodes_to_itself(event, seq):
    buffer = bytearray(b"junk")
    size = FrameEncoder().append(buffer, seq, event)
    frame = bytes(buffer[4:])
    assert size == len(frame) and frame.startswith(MAGIC)
    assert parse_frame(frame, 0) == (seq, SCHEMA_VERSION, HEADER_SIZE, len(frame) - 4, len(frame), False)
    unclosed = parse_segment("s", frame, seq=seq, decoder=EventDecoder())  # a commit that never returned
    assert unclosed.items == [] and unclosed.bad[0] == 0 and unclosed.next_seq == seq
    mark_end_of_group(buffer, 4)  # what commit() does to the last frame it writes
    frame = bytes(buffer[4:])
    assert parse_frame(frame, 0) == (seq, SCHEMA_VERSION, HEADER_SIZE, len(frame) - 4, len(frame), True)
    assert frame[HEADER_SIZE:] == bytes(buffer[4 + HEADER_SIZE :]) and len(frame) == size  # header only
    parsed = parse_segment("s", frame, seq=seq, decoder=EventDecoder())
    assert parsed.items[0].event == event and parsed.bad is None and parsed.next_seq == seq + 1


def test_parse_frame_says_what_is_wrong():
    frame = encode_frame(7, msgspec.msgpack.encode(NEW_STEP))
    with pytest.raises(BadFrame, match="incomplete record header"):
        parse_frame(frame[:10], 0)
    with pytest.raises(BadFrame, match="incomplete record"):
        parse_frame(frame[:-1], 0)
    with pytest.raises(BadFrame, match="no record starts here"):
        parse_frame(b"x" + frame, 0)
    with pytest.raises(BadFrame, match="CRC mismatch"):
        parse_frame(frame[:-1] + bytes([frame[-1] ^ 1]), 0)


def test_an_old_version_is_upcast_then_converted(run_url, monkeypatch):
    write_frames(run_url, [encode_frame(0, msgspec.msgpack.encode(OLD_STEP), version=0)])
    with pytest.raises(UnsupportedSchemaError, match="no upcaster from 0 to 1"):
        read_events(run_url)
    monkeypatch.setitem(codec.UPCASTERS, 0, upcast_0_to_1)
    records = list(EventLog.open(run_url).records())
    assert [(r.version, r.event) for r in records] == [(0, NEW_STEP)]
    with EventLog.open(run_url, "w") as log:  # new records are written with today's version
        log.append(NEW_STEP)
        log.commit()
    assert [r.version for r in EventLog.open(run_url).records()] == [0, SCHEMA_VERSION]
    assert verify_log(run_url).ok


def test_upcasters_chain_over_several_versions(run_url, monkeypatch):
    monkeypatch.setattr(events_module, "SCHEMA_VERSION", 3)  # pretend the code is two bumps newer
    monkeypatch.setitem(codec.UPCASTERS, 0, upcast_0_to_1)
    monkeypatch.setitem(codec.UPCASTERS, 1, lambda raw: {**raw, "kl": raw.get("kl", 0.0) + 1.0})
    monkeypatch.setitem(codec.UPCASTERS, 2, lambda raw: {**raw, "kl": raw["kl"] * 10})
    step = msgspec.msgpack.encode(NEW_STEP)
    write_frames(
        run_url,
        [
            encode_frame(0, msgspec.msgpack.encode(OLD_STEP), version=0),
            encode_frame(1, step, version=1),
            encode_frame(2, step, version=2),
            encode_frame(3, step, version=3),
        ],
    )
    assert [e.kl for e in read_events(run_url)] == [10.0, 10.0, 0.0, 0.0]


def test_a_version_newer_than_the_code_is_refused_with_its_location(run_url):
    step = msgspec.msgpack.encode(NEW_STEP)
    first = encode_frame(0, step)
    write_frames(run_url, [first, encode_frame(1, step, version=SCHEMA_VERSION + 1)])
    with pytest.raises(
        UnsupportedSchemaError, match=f"at byte {len(first)}: written with schema version {SCHEMA_VERSION + 1}"
    ) as info:
        read_events(run_url)
    assert (info.value.segment, info.value.offset) == (segment_name(0), len(first))
    assert "unsupported schema" in verify_log(run_url).problems[0].message
    with pytest.raises(UnsupportedSchemaError):
        EventLog.open(run_url, "w")  # never append to a log this code cannot fully read


def test_a_field_added_with_a_default_stays_readable():
    class StepCommittedV2(StepCommitted, frozen=True, kw_only=True, tag="StepCommitted"):
        clip_fraction: float = 0.0

    newer = StepCommittedV2(step=1, tokens=2, stage=0, lr=0.1, beta=0.0, loss=1.0, clip_fraction=0.25)
    frame = encode_frame(0, msgspec.msgpack.encode(newer))
    assert parse_segment("s", frame, seq=0, decoder=EventDecoder()).items[0].event == StepCommitted(
        step=1, tokens=2, stage=0, lr=0.1, beta=0.0, loss=1.0
    )


@given(events=st.lists(events_strategy(), max_size=8))
def test_intact_frames_check_as_a_whole_and_one_by_one(events):
    frames = [encode_frame(seq, msgspec.msgpack.encode(e)) for seq, e in enumerate(events)]
    data = b"".join(frames)
    assert google_crc32c.extend(RESIDUE, data) == RESIDUE  # the reader's one-call check
    offset = 0
    for seq, frame in enumerate(frames):
        assert parse_frame(data, offset).seq == seq  # and each frame alone
        offset += len(frame)
