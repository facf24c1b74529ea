"""The root of kvprefetch's exception tree: `KvpError`, the base of every error raised on purpose.

It lives here, in the light package, because the light package cannot import the service (`app`)
while the service imports this package: the root has to sit on the side both can see. The
service builds the rest of the tree on it (app/core/errors.py lists the whole of it), so a caller
catches every kvprefetch error, client-side or service-side, with one `except KvpError`.
"""

from __future__ import annotations


class KvpError(Exception):
    """Base of every error kvprefetch raises on purpose."""
