"""The Lua scripts of the job protocol, read once from package data (``shared/lua/*.lua``, shipped in the wheel
through ``[tool.setuptools.package-data]``) and registered on a Redis client.

Every state transition of a job is one script, so it is atomic on the server whatever the clients do.
``lib.lua`` holds helpers the transition scripts share (Redis time, key derivation, emit/finish/requeue); it is
prepended to each of them. ``submit.lua`` and the worker-registry scripts need no helpers and stay
self-contained, so another backend can ``EVAL`` the shipped ``submit.lua`` exactly as it is on disk (and
``lib.lua`` + ``cancel.lua`` to cancel; both read the service's settings from ``ts:config``).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

from redis.asyncio import Redis
from redis.commands.core import AsyncScript

LIB = "lib"
SELF_CONTAINED = frozenset({"submit", "register", "deregister"})


def lua_source(name: str) -> str:
    """The text of ``shared/lua/<name>.lua`` as shipped (what other backends EVAL)."""
    return resources.files("shared").joinpath("lua", f"{name}.lua").read_text(encoding="utf-8")


def script_source(name: str) -> str:
    """The text Redis runs for ``name``: the file itself, with ``lib.lua`` prepended unless self-contained."""
    text = lua_source(name)
    return text if name in SELF_CONTAINED else f"{lua_source(LIB)}\n{text}"


@dataclass(frozen=True)
class Scripts:
    """One registered script per transition. Calls run EVALSHA and reload the script after a Redis restart."""

    submit: AsyncScript
    claim: AsyncScript
    renew: AsyncScript
    publish: AsyncScript
    publish_step: AsyncScript
    complete: AsyncScript
    fail: AsyncScript
    release: AsyncScript
    cancel: AsyncScript
    rollback: AsyncScript
    reap: AsyncScript
    expire: AsyncScript
    register: AsyncScript
    deregister: AsyncScript

    @classmethod
    def load(cls, redis: Redis) -> Scripts:
        """Read every script once and register it on ``redis`` (nothing is sent until the first call)."""
        names = cls.__dataclass_fields__
        return cls(**{name: redis.register_script(script_source(name)) for name in names})
