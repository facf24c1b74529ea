"""The durable event log: JSON Lines segments, appended before an event is acknowledged.

Layout: `<dir>/events-00000001.jsonl`, `events-00000002.jsonl`, ... A line is either one event
in the canonical form of kvprefetch_client.events (every field present), or a whole accepted batch
`{"events": [...]}` exactly as it was posted (newlines folded into spaces). The batch form is
written when every event of a posted batch was new: it costs nothing to encode, which is a fifth
of the ingest path's time at 1000-event batches. A segment is closed when it passes
`segment_bytes`. Read segments with `read_events` / `iter_log`, which give canonical events
whatever the line's form.

Why JSON Lines and not Parquet: a line is appended and flushed per acknowledged batch, a torn
write after a crash is one partial last line that recovery cuts off, and no footer must be
rewritten. Training converts to a DataFrame once (training/).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from pydantic_core import from_json

from app.core.errors import CorruptLogError, EventLogError
from app.ingest.base import EventLog
from app.state.base import LogPosition
from kvprefetch_client.events import Event, batch_adapter, event_adapter

_SEGMENT = re.compile(r"^events-(\d{8})\.jsonl$")


def segment_path(directory: Path, number: int) -> Path:
    return directory / f"events-{number:08d}.jsonl"


def list_segments(directory: Path) -> list[tuple[int, Path]]:
    if not directory.is_dir():
        return []
    found = []
    for p in directory.iterdir():
        m = _SEGMENT.match(p.name)
        if m:
            found.append((int(m.group(1)), p))
    return sorted(found)


def encode_batch(body: bytes) -> bytes:
    """A posted batch body as one log line.

    JSON forbids raw control characters inside strings, so every CR or LF in a valid body is
    whitespace between tokens, and folding it into a space changes nothing.
    """
    return body.replace(b"\r", b" ").replace(b"\n", b" ") + b"\n"


def encode_events(events: Sequence[Event]) -> bytes:
    """The log's bytes for these events: one canonical JSON object per line."""
    # Each model's own serializer: the same bytes as the union adapter's, at half the cost.
    return b"".join([e.__pydantic_serializer__.to_json(e) + b"\n" for e in events])


class FileEventLog(EventLog):
    """Appends batches of events; one writer per directory (one per service replica)."""

    directory: Path
    keeps_events = True

    def __init__(
        self, directory: Path, *, segment_bytes: int = 64 * 1024 * 1024, fsync: bool = True
    ) -> None:
        self.directory = Path(directory)
        self.segment_bytes = segment_bytes
        self.fsync = fsync
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise EventLogError(
                f"cannot create the event log directory {self.directory}: {exc}"
            ) from exc
        segments = list_segments(self.directory)
        self._number = segments[-1][0] if segments else 1
        path = segment_path(self.directory, self._number)
        self._cut_torn_tail(path)
        self._file = open(path, "ab")  # noqa: SIM115 - held open for the log's lifetime
        self._size = self._file.tell()

    @staticmethod
    def _cut_torn_tail(path: Path) -> None:
        """Drop a partial last line: a batch that was being written when the process died.

        It was never acknowledged (the ack comes after the whole batch is written), so the
        client still holds it and will resend it.
        """
        if not path.exists():
            return
        with open(path, "rb+") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            if size == 0:
                return
            window = 1 << 16
            end = size
            while end > 0:
                start = max(0, end - window)
                f.seek(start)
                chunk = f.read(end - start)
                nl = chunk.rfind(b"\n")
                if nl >= 0:
                    keep = start + nl + 1
                    if keep != size:
                        f.truncate(keep)
                    return
                end = start
            f.truncate(0)

    @property
    def position(self) -> LogPosition:
        return LogPosition(self._number, self._size)

    def append(self, data: bytes) -> LogPosition:
        """Write whole lines and make them durable; returns the position just past them."""
        if not data:
            return self.position
        if self._size and self._size + len(data) > self.segment_bytes:
            self._rotate()
        try:
            self._file.write(data)
            self._file.flush()
            if self.fsync:
                os.fsync(self._file.fileno())
        except OSError as exc:
            self._undo_partial_write()
            raise EventLogError(
                f"cannot append to the event log in {self.directory}: {exc}"
            ) from exc
        self._size += len(data)
        return LogPosition(self._number, self._size)

    def _undo_partial_write(self) -> None:
        """Cut what a failed append left behind, so the next append starts on a whole line."""
        path = segment_path(self.directory, self._number)
        # The buffered bytes are what we are throwing away.
        with contextlib.suppress(OSError):
            self._file.close()
        try:
            with open(path, "rb+") as f:
                f.truncate(self._size)
        except OSError:
            pass  # reopening below cuts any torn tail on the next start anyway
        self._file = open(path, "ab")  # noqa: SIM115

    def _rotate(self) -> None:
        self._file.close()
        self._number += 1
        self._file = open(segment_path(self.directory, self._number), "ab")  # noqa: SIM115
        self._size = 0

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def iter_log(
    directory: Path, after: LogPosition | None = None
) -> Iterator[tuple[LogPosition, Event]]:
    """Every event in the log after `after`, with the position just past its line.

    A line that does not parse as an event raises CorruptLogError naming the file and line. A
    partial last line of the newest segment (a write cut short by a crash) is skipped.
    """
    segments = list_segments(Path(directory))
    for index, (number, path) in enumerate(segments):
        if after is not None and number < after.segment:
            continue
        newest = index == len(segments) - 1
        with open(path, "rb") as f:
            offset = 0
            if after is not None and number == after.segment:
                f.seek(after.offset)
                offset = after.offset
            line_no = 0 if offset == 0 else None
            for raw in f:
                if line_no is not None:
                    line_no += 1
                offset += len(raw)
                if not raw.endswith(b"\n"):
                    if newest:
                        return
                    raise CorruptLogError(str(path), line_no or -1, "line is cut short")
                position = LogPosition(number, offset)
                for event in _parse(raw, path, line_no):
                    yield position, event


def read_events(paths: Sequence[Path]) -> Iterator[Event]:
    """Events from log segments or whole log directories, in file order (for training)."""
    for p in paths:
        p = Path(p)
        if p.is_dir():
            for _, event in iter_log(p):
                yield event
            continue
        try:
            f = open(p, "rb")  # noqa: SIM115
        except OSError as exc:
            raise EventLogError(f"cannot read {p}: {exc}") from exc
        with f:
            for line_no, raw in enumerate(f, start=1):
                if raw.strip():
                    yield from _parse(raw, p, line_no)


def _parse(raw: bytes, path: Path, line_no: int | None) -> list[Event]:
    try:
        # jiter, the parser of the ingest's validate_json, so a posted batch logged as it came
        # reads back: orjson makes integers past 64 bits floats and refuses 1e400, both of which
        # an accepted batch may hold (vLLM's token ids, fields of its events that we ignore).
        doc = from_json(raw)
    except ValueError as exc:
        raise CorruptLogError(str(path), line_no or -1, f"not JSON: {exc}") from exc
    try:
        return _validate(doc)
    except ValidationError as exc:
        legacy = _with_legacy_ids(doc, exc)
        if legacy is not None:
            return legacy
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"][1:]) or "event"
        raise CorruptLogError(str(path), line_no or -1, f"{field}: {first['msg']}") from exc


# The id fields whose rules were tightened after logs were written with looser ones.
_LEGACY_ID_FIELDS = frozenset({"session_id", "instance_id"})


def _validate(doc: Any) -> list[Event]:
    # Lax: lines that older, lenient versions logged as posted may hold "10" for 10.
    if isinstance(doc, dict) and "type" not in doc and "events" in doc:
        return batch_adapter.validate_python(doc, strict=False).events
    return [event_adapter.validate_python(doc, strict=False)]


def _with_legacy_ids(doc: Any, exc: ValidationError) -> list[Event] | None:
    """The events of a line whose only fault is session or instance ids older versions accepted
    and the schema now refuses ('/', '.', control characters): validated with a stand-in id, then
    given their own back. None when the line has other faults."""
    errors = exc.errors()
    if not all(
        e["type"] == "string_pattern_mismatch" and e["loc"][-1] in _LEGACY_ID_FIELDS for e in errors
    ):
        return None
    batch = isinstance(doc, dict) and "type" not in doc and "events" in doc
    originals: dict[tuple[int, str], str] = {}
    for e in errors:
        index = e["loc"][1] if batch else 0
        if not isinstance(index, int):
            return None
        originals[(index, str(e["loc"][-1]))] = e["input"]
    doc = {**doc, "events": list(doc["events"])} if batch else dict(doc)
    for index, name in originals:
        if batch:
            doc["events"][index] = {**doc["events"][index], name: "legacy"}
        else:
            doc[name] = "legacy"
    try:
        events = _validate(doc)
    except ValidationError:
        return None
    for (index, name), value in originals.items():
        events[index] = events[index].model_copy(update={name: value})
    return events
