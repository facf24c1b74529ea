"""Scopes as route dependencies: each endpoint declares the scopes that may call it.

`Depends(requires(Scope.INGEST))` authenticates the bearer token, checks its scopes and charges the
caller's request rate limit; the principal it returns names the caller for the events limit too.
Endpoints without one are open (health, and metrics and the dashboard unless
KVP_PROTECT_OBSERVABILITY): tests/api/test_auth.py checks every route is one or the other.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from app.api.errors import Error, HttpError
from app.core.ratelimit import Limiter, retry_after
from app.core.security import LOCAL, Principal, Scope

_bearer = HTTPBearer(auto_error=False, description="A token from KVP_*_TOKEN or KVP_TOKENS_FILE")


class Refused(HttpError):
    """401 or 403 (field `authorization`), or 429 (field `rate_limit`)."""

    def __init__(self, status_code: int, message: str, headers: dict[str, str]) -> None:
        super().__init__(
            status_code, "authorization" if status_code != 429 else "rate_limit", message, headers
        )


def client_key(request: Request, principal: Principal) -> str:
    """Whom a rate limit counts: the token's name, or the address when authentication is off."""
    if principal is not LOCAL:
        return f"token:{principal.name}"
    return f"addr:{request.client.host if request.client else 'unknown'}"


async def charge(
    request: Request, principal: Principal, limiter: Limiter, what: str, cost: float
) -> None:
    """Spend `cost` of the caller's `what` (requests, events) or refuse with 429."""
    if not limiter.enabled:
        return
    wait = await limiter.spend(client_key(request, principal), cost)
    if wait > 0:
        raise Refused(
            429,
            f"over this client's rate of {what} "
            f"(KVP_RATE_LIMIT_{what.upper()}_PER_SECOND); retry after the wait",
            {"Retry-After": retry_after(wait)},
        )


def requires(*scopes: Scope) -> Callable[..., Awaitable[Principal]]:
    async def authorize(
        request: Request,
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    ) -> Principal:
        tokens = request.app.state.tokens
        if not tokens.enabled:
            principal = LOCAL
        else:
            challenge = {"WWW-Authenticate": 'Bearer realm="kvprefetch"'}
            if credentials is None:
                raise Refused(
                    401, "a bearer token is required: Authorization: Bearer <token>", challenge
                )
            found = tokens.authenticate(credentials.credentials)
            if found is None:
                raise Refused(401, "the bearer token is not valid", challenge)
            if not found.allows(scopes):
                needed = " or ".join(str(s) for s in scopes)
                raise Refused(
                    403,
                    f"this endpoint needs the {needed} scope; token {found.name!r} has "
                    f"{', '.join(sorted(found.scopes))}",
                    {
                        "WWW-Authenticate": 'Bearer realm="kvprefetch", '
                        'error="insufficient_scope", '
                        f'scope="{" ".join(str(s) for s in scopes)}"'
                    },
                )
            principal = found
        await charge(request, principal, request.app.state.request_limiter, "requests", 1.0)
        return principal

    # Read by the route audit test; a function object takes the attribute, its type does not say so.
    authorize.scopes = frozenset(scopes)  # type: ignore[attr-defined]
    return authorize


_read = requires(Scope.READ)


async def _observability(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> Principal | None:
    """Open unless KVP_PROTECT_OBSERVABILITY: then any token (the read scope)."""
    if not request.app.state.settings.protect_observability:
        return None
    return await _read(request, credentials)


_observability.scopes = frozenset({Scope.READ})  # type: ignore[attr-defined]

ReadScope = Depends(_read)
IngestScope = Depends(requires(Scope.INGEST))
AgentScope = Depends(requires(Scope.AGENT))
AdminScope = Depends(requires(Scope.ADMIN))
ObservabilityScope = Depends(_observability)
# The orders routes: the same dependency as their router's, so FastAPI runs it once.
AgentCaller = Annotated[Principal, AgentScope]
# POST /v1/events: agents post their order progress and block residency through it too.
EventsCaller = Annotated[Principal, Depends(requires(Scope.INGEST, Scope.AGENT))]

# For `responses=`: what any scoped endpoint may answer besides its own codes.
AUTH_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: {"model": Error, "description": "No bearer token, or not a valid one."},
    403: {"model": Error, "description": "The token lacks the scope this endpoint needs."},
    429: {"model": Error, "description": "Over this client's rate limit; see Retry-After."},
}
