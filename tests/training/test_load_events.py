"""training.dataset.load_events: the traffic of a log, in event-time order."""

from __future__ import annotations

from pathlib import Path

from app.ingest.eventlog import encode_events
from kvprefetch_client.events import ModelChanged, RequestRouted
from training.dataset import load_events


def test_the_services_records_of_itself_are_not_traffic(tmp_path: Path) -> None:
    """A model change, stamped by the service's clock long after the traffic, is left out: a
    time split of the log cuts the traffic's span, not one the record widened."""
    routed = [
        RequestRouted(
            event_id=f"r{i}",
            ts=float(i),
            session_id="s",
            request_id=f"q{i}",
            instance_id="gpu-0",
            prompt_tokens=10,
        )
        for i in range(3)
    ]
    record = ModelChanged(event_id="m", ts=1e9, slot="shadow", action="cleared")
    log = tmp_path / "events.jsonl"
    log.write_bytes(encode_events([routed[2], record, routed[0], routed[1], routed[0]]))
    events = load_events(log)
    assert [e.event_id for e in events] == ["r0", "r1", "r2"]
