"""The journal's on-disk format: a fixed header, then length+CRC32 framed JSON records.

A segment file starts with a 64-byte header: magic `SWJ1`, format version, header size, and a
heartbeat slot (wall and monotonic ns of the last evidence of life, with its own CRC32) that the
writer overwrites in place, so a heartbeat costs one 20-byte `pwrite` and never grows the file.
Records follow, each framed as `b"\\xa5J" | u32 length | u32 crc32(payload) | payload` (payload:
compact JSON of one dict). The writer preallocates the file with zeros ahead of the records, so
an all-zero frame header marks the end of the written data.

The reader never trusts the tail: a frame whose length runs past the end of the file, whose CRC
does not match or whose payload is not a JSON object is reported as a `Corruption` and skipped;
reading resumes at the next offset where a complete, valid frame starts (a torn last record after
a power loss, or garbage appended to the file, costs only those bytes).
"""

from __future__ import annotations

import json
import os
import re
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .names import SEGMENT_SUFFIX

MAGIC = b"SWJ1"
VERSION = 1
HEADER_SIZE = 64
_HEADER = struct.Struct("<4sHH")
HEARTBEAT_OFFSET = 8
_HEARTBEAT = struct.Struct("<qqI")
FRAME_MAGIC = b"\xa5J"
_FRAME = struct.Struct("<2sII")
FRAME_OVERHEAD = _FRAME.size
MAX_RECORD_BYTES = 1 << 20
# <host pid>-<host start time in clock ticks>.<role>.<segment number>.journal
_NAME = re.compile(r"^(\d+)-(\d+)\.(host|watchdog)\.(\d+)\.journal$")


def header() -> bytes:
    """A fresh segment header with an empty heartbeat slot."""
    return _HEADER.pack(MAGIC, VERSION, HEADER_SIZE).ljust(HEADER_SIZE, b"\0")


def heartbeat(wall_ns: int, mono_ns: int) -> bytes:
    """The heartbeat slot's bytes (written at `HEARTBEAT_OFFSET`)."""
    body = struct.pack("<qq", wall_ns, mono_ns)
    return body + struct.pack("<I", zlib.crc32(body))


def encode(record: dict[str, Any]) -> bytes:
    """One framed record."""
    payload = json.dumps(record, separators=(",", ":"), default=str).encode()
    if len(payload) > MAX_RECORD_BYTES:  # the reader would skip it as corrupt
        raise ValueError(f"a journal record of {len(payload)} bytes exceeds {MAX_RECORD_BYTES}")
    return _FRAME.pack(FRAME_MAGIC, len(payload), zlib.crc32(payload)) + payload


def segment_name(pid: int, start_ticks: int, role: str, number: int) -> str:
    return f"{pid}-{start_ticks}.{role}.{number:06d}{SEGMENT_SUFFIX}"


@dataclass(frozen=True)
class SegmentName:
    """What a segment's file name says: whose journal it is, which writer, which segment."""

    pid: int
    start_ticks: int
    role: str
    number: int

    @classmethod
    def parse(cls, name: str) -> SegmentName | None:
        match = _NAME.match(name)
        if match is None:
            return None
        return cls(int(match[1]), int(match[2]), match[3], int(match[4]))


@dataclass(frozen=True)
class Corruption:
    """Bytes the reader skipped: where, how many, and why."""

    path: Path
    offset: int
    length: int
    reason: str


@dataclass
class Segment:
    """Everything readable in one segment file."""

    path: Path
    records: list[dict[str, Any]] = field(default_factory=list)
    heartbeat_wall_ns: int | None = None
    corruption: list[Corruption] = field(default_factory=list)


def _frame_at(data: bytes, offset: int) -> tuple[dict[str, Any] | None, int, str]:
    """The record framed at `offset` and the offset after it, or None and why not."""
    if offset + FRAME_OVERHEAD > len(data):
        return None, offset, "truncated frame header"
    magic, length, crc = _FRAME.unpack_from(data, offset)
    if magic != FRAME_MAGIC:
        return None, offset, "bad frame magic"
    after = offset + FRAME_OVERHEAD + length
    if length > MAX_RECORD_BYTES or after > len(data):
        return None, offset, "truncated record"
    payload = data[offset + FRAME_OVERHEAD : after]
    if zlib.crc32(payload) != crc:
        return None, offset, "CRC mismatch"
    try:
        record = json.loads(payload)
    except ValueError:
        return None, offset, "undecodable payload"
    if not isinstance(record, dict):
        return None, offset, "payload is not an object"
    return record, after, ""


def _resync(data: bytes, start: int) -> int | None:
    """The next offset at or after `start` where a valid frame begins."""
    offset = data.find(FRAME_MAGIC, start)
    while offset != -1:
        if _frame_at(data, offset)[0] is not None:
            return offset
        offset = data.find(FRAME_MAGIC, offset + 1)
    return None


def read_segment(path: Path) -> Segment:
    """Every intact record of one segment file, in order, and the corruption skipped."""
    segment = Segment(path)
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except OSError as exc:
        segment.corruption.append(Corruption(path, 0, 0, f"unreadable: {exc.strerror}"))
        return segment
    if len(data) < HEADER_SIZE or _HEADER.unpack_from(data)[0] != MAGIC:
        segment.corruption.append(Corruption(path, 0, len(data), "bad header"))
        return segment
    wall_ns, _mono_ns, crc = _HEARTBEAT.unpack_from(data, HEARTBEAT_OFFSET)
    if wall_ns and zlib.crc32(data[HEARTBEAT_OFFSET : HEARTBEAT_OFFSET + 16]) == crc:
        segment.heartbeat_wall_ns = wall_ns
    offset = HEADER_SIZE
    end = len(data.rstrip(b"\0"))  # preallocated zeros after the last record are not data
    while offset < end:
        record, after, reason = _frame_at(data, offset)
        if record is not None:
            segment.records.append(record)
            offset = after
            continue
        following = _resync(data, offset + 1)
        stop = end if following is None else following
        segment.corruption.append(Corruption(path, offset, stop - offset, reason))
        offset = stop
    return segment


def list_segments(directory: Path) -> list[tuple[SegmentName, Path]]:
    """The journal segments directly in `directory` (not in `archive/`), by name."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = []
    for name in names:
        parsed = SegmentName.parse(name)
        if parsed is not None:
            found.append((parsed, directory / name))
    return sorted(found, key=lambda item: (item[0].pid, item[0].start_ticks, item[0].role, item[0].number))
