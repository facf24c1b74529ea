"""What the integrations read out of a framework's request: the session id (from where the
deployment says it is) and a rough prompt size. Plain dicts in, so each framework's own shapes
stay in its module."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# Where a session id is looked for, first match wins: `header:<name>` (case-insensitive),
# `metadata:<key>` (the request body's `metadata`), `user` (the OpenAI `user` field).
DEFAULT_SESSION_FROM = ("header:x-session-id", "metadata:session_id", "user")
# The service's bound on a session id (kvprefetch_client.events.SessionId).
MAX_SESSION_ID_CHARS = 256


def parse_session_from(spec: str | Sequence[str]) -> tuple[str, ...]:
    """`"header:x-session-id,user"` or a list of the same; ValueError on an unknown source."""
    items = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else list(spec)
    out = []
    for item in items:
        kind, _, name = item.partition(":")
        if kind == "user" and not name:
            out.append("user")
        elif kind in ("header", "metadata") and name:
            out.append(f"{kind}:{name.lower() if kind == 'header' else name}")
        else:
            raise ValueError(
                f"unknown session source {item!r}: use header:<name>, metadata:<key> or user"
            )
    if not out:
        raise ValueError("no session source given")
    return tuple(out)


def find_session_id(
    sources: Sequence[str],
    headers: Mapping[str, Any],
    metadata: Mapping[str, Any],
    user: Any,
) -> str | None:
    """The first source that holds a usable id (a non-empty string within the service's bound)."""
    lowered: dict[str, Any] | None = None
    for source in sources:
        if source == "user":
            value = user
        else:
            kind, _, name = source.partition(":")
            if kind == "header":
                if lowered is None:
                    lowered = {str(k).lower(): v for k, v in headers.items()}
                value = lowered.get(name)
            else:
                value = metadata.get(name)
        if isinstance(value, str) and 0 < len(value) <= MAX_SESSION_ID_CHARS:
            return value
    return None


def estimate_prompt_tokens(messages: Any) -> int:
    """About 4 characters a token over the messages' text: the request path has no time for a
    tokenizer, and the finish reports the engine's own count."""
    chars = 0
    if isinstance(messages, list):
        for m in messages:
            content = m.get("content") if isinstance(m, Mapping) else None
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):
                chars += sum(
                    len(p["text"])
                    for p in content
                    if isinstance(p, Mapping) and isinstance(p.get("text"), str)
                )
    return (chars + 3) // 4
