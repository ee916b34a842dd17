"""Optional Bearer API keys, and job ownership by key.

With ``settings.api_keys`` empty the API is open and jobs have no owner. With keys, every ``/v1`` request needs
``Authorization: Bearer <key>``; a job records a hash of the key that created it (never the key itself, since
job records are readable by anyone with Redis access) and only that key can read, stream or cancel it.
"""

from __future__ import annotations

import hmac

from fastapi import Request

from api.errors import APIError
from shared.config import Settings
from shared.tenants import owner_of


def _bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization")
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def authenticate(request: Request, settings: Settings) -> str | None:
    """The caller's owner tag (None when auth is off); a 401 for a missing or unknown key.

    Every configured key is compared in constant time, so timing does not reveal a prefix of a valid key.
    """
    if not settings.api_keys:
        return None
    token = _bearer_token(request)
    if token is not None:
        matches = [hmac.compare_digest(token.encode(), key.encode()) for key in settings.api_keys]
        if any(matches):
            return owner_of(token)
    message = "missing API key" if token is None else "invalid API key"
    raise APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def can_access(owner: str | None, job_owner: str | None) -> bool:
    """Whether the caller ``owner`` may see a job created by ``job_owner`` (equal tags, or both open)."""
    if owner is None or job_owner is None:
        return owner == job_owner
    return hmac.compare_digest(owner, job_owner)
