"""Tenants: who a job belongs to for fair share and rate limits, and each API key's policy.

A tenant is the owner tag of a job (the SHA-256 of the API key that created it, never the key itself), or ``-``
for jobs without an owner (auth off, or pushed straight into Redis). Each key's policy (its fair-share weight,
requests and tokens per minute, unfinished jobs at most, and a short name for metrics and logs) comes from
``Settings.api_key_policies`` with the server-wide defaults for what a key does not set. The queue enforces the
policy inside ``submit.lua`` and ``claim.lua`` (docs/protocol.md, "Tenants").
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

ANONYMOUS = "anonymous"  # the name of the tenant without a key (auth off)


def owner_of(api_key: str) -> str:
    """The owner tag stored with a job: SHA-256 of the key, hex (64 chars; JobSubmission allows 128)."""
    return hashlib.sha256(api_key.encode()).hexdigest()


class KeyPolicy(BaseModel):
    """One API key's limits and weight as configured; unset fields take the server-wide defaults."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,64}$",
                             description="shown in metrics and logs; default key-<first 8 hex of its hash>")
    rpm: int | None = Field(None, ge=0, description="requests per minute; 0 = unlimited")
    tpm: int | None = Field(None, ge=0, description="tokens per minute (prompt + max_tokens); 0 = unlimited")
    max_jobs: int | None = Field(None, ge=0, description="queued and running jobs at once; 0 = unlimited")
    weight: float | None = Field(None, gt=0, le=1_000_000, description="fair-share weight within a priority")


@dataclass(frozen=True)
class TenantPolicy:
    """A tenant's resolved policy: what ``submit.lua`` enforces (0 = unlimited)."""

    name: str
    rpm: int = 0
    tpm: int = 0
    max_jobs: int = 0
    weight: float = 1.0

    @property
    def has_limits(self) -> bool:
        return bool(self.rpm or self.tpm or self.max_jobs)


class TenantPolicies:
    """Every configured key's policy by owner tag, and the defaults for any other tenant."""

    def __init__(self, policies: Mapping[str, KeyPolicy], default: KeyPolicy) -> None:
        self._default = default
        self._by_owner = {owner_of(key): self._resolve(owner_of(key), policy) for key, policy in policies.items()}

    def _resolve(self, owner: str | None, policy: KeyPolicy) -> TenantPolicy:
        d = self._default
        name = policy.name or (f"key-{owner[:8]}" if owner else ANONYMOUS)
        return TenantPolicy(name=name, rpm=_pick(policy.rpm, d.rpm), tpm=_pick(policy.tpm, d.tpm),
                            max_jobs=_pick(policy.max_jobs, d.max_jobs),
                            weight=policy.weight if policy.weight is not None else d.weight or 1.0)

    def of(self, owner: str | None) -> TenantPolicy:
        """The policy of the tenant ``owner`` (None: the tenant without a key)."""
        if owner is not None and owner in self._by_owner:
            return self._by_owner[owner]
        return self._resolve(owner, KeyPolicy())


def _pick(value: int | None, default: int | None) -> int:
    return value if value is not None else (default or 0)
