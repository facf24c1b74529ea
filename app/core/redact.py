"""What a URL may show of itself in answers, logs and errors: never its password, query or, for
a webhook, the path that often is its secret (SECURITY.md)."""

from __future__ import annotations

from urllib.parse import urlsplit

MASK = "****"


def mask_url(url: str, *, keep_path: bool = True) -> str:
    """`url` with its password and query masked, and its path too unless `keep_path` (a Redis
    URL's path is a database number; a webhook's may be the secret). Scheme, user, host and port
    stay: what an operator needs to tell which service is meant. Not a URL: masked whole."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return MASK
    if not parts.scheme or not parts.netloc:
        return MASK
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = host if port is None else f"{host}:{port}"
    if parts.username or parts.password:
        user = parts.username or ""
        netloc = f"{user}:{MASK}@{netloc}" if parts.password is not None else f"{user}@{netloc}"
    path = parts.path if keep_path or parts.path in ("", "/") else f"/{MASK}"
    shown = f"{parts.scheme}://{netloc}{path}"
    if parts.query:
        shown += f"?{MASK}"
    if parts.fragment:
        shown += f"#{MASK}"
    return shown
