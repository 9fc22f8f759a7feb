"""The settings of a JetStream sink, from its URL:
``nats://h1:4222[,nats://h2:4222…][?stream=LEDGER&prefix=ledger&replicas=3&duplicate_window=120]``.
Every option is checked here, so that a bad URL stops the command that was given it, in one
line, before anything connects."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from ledger_cdc.errors import ConfigError

__all__ = ["JetStreamSettings"]


def _flag(value: str) -> bool:
    low = value.strip().lower()
    if low in ("true", "1", "on", "yes"):
        return True
    if low in ("false", "0", "off", "no"):
        return False
    raise ValueError(value)


def _seconds_between(low: float, high: float) -> Callable[[str], float]:
    def parse(value: str) -> float:
        v = float(value)
        if not (math.isfinite(v) and low <= v <= high):
            raise ValueError(value)
        return v

    return parse


def _replicas(value: str) -> int:
    v = int(value)
    if not 1 <= v <= 5:  # JetStream's own bounds
        raise ValueError(value)
    return v


def _stream_name(value: str) -> str:
    if (
        not value
        or len(value) > 255
        or not (value.isascii() and value.isprintable())
        or any(c in value for c in " .*>/\\$")
    ):
        raise ValueError(value)
    return value


def _subject_prefix(value: str) -> str:
    tokens = value.split(".")
    if (
        any(not t or any(c in t for c in " *>") for t in tokens)
        or not (value.isascii() and value.isprintable())
        or value.startswith("$")  # $JS, $SYS: the server's own subjects
        or len(value) > 200
    ):
        raise ValueError(value)
    return value


# URL option → (parser, what it must be)
_OPTIONS: dict[str, tuple[Callable[[str], Any], str]] = {
    "stream": (_stream_name, "a stream name (no spaces, dots, wildcards or slashes)"),
    "prefix": (_subject_prefix, "a subject prefix (dot-separated tokens, no wildcards)"),
    "replicas": (_replicas, "a whole number from 1 to 5"),
    # (the server refuses a window under 100 ms)
    "duplicate_window": (_seconds_between(0.1, 86_400 * 365), "seconds, from 0.1 to a year"),
    "ack_timeout": (_seconds_between(0.1, 3600), "seconds, from 0.1 to 3600"),
    "batched": (_flag, "true or false"),
}


@dataclass(frozen=True)
class JetStreamSettings:
    servers: list[str]
    stream: str = "LEDGER"
    prefix: str = "ledger"
    replicas: int = 1
    duplicate_window: float = 120.0
    ack_timeout: float = 10.0
    # fast-ingest batches for batches of FAST_MIN messages or more (the stream is given
    # allow_batched); false: every message acknowledged on its own, the stream left as it is
    batched: bool = True
    # the options the URL gave: only those are imposed on a stream that exists (one made by
    # an operator with 3 replicas is not cut back to the default 1 by a URL that says nothing)
    given: frozenset[str] = frozenset()

    @classmethod
    def from_url(cls, url: str, option: str = "--sink") -> JetStreamSettings:
        """``nats://h1:4222[,nats://h2:4222…][?stream=LEDGER&replicas=3&duplicate_window=120]``"""
        base, _, query = url.partition("?")
        servers = [u.strip() for u in base.split(",") if u.strip()]
        bad = [s for s in servers if not s.startswith(("nats://", "tls://"))]
        if not servers or bad:
            raise ConfigError(f"{option} {url!r}: expected nats://host:port[,nats://host:port…]")
        kw: dict[str, Any] = {}
        pairs = (item.partition("=") for item in query.split("&") if item)
        for key, value in ((unquote(k), unquote(v)) for k, _, v in pairs):  # "+" stays "+"
            if key in kw:
                raise ConfigError(f"{option} {url!r}: {key} given twice")
            if key not in _OPTIONS:
                raise ConfigError(
                    f"{option} {url!r}: unknown option {key!r} (use {', '.join(_OPTIONS)})"
                )
            parse, what = _OPTIONS[key]
            try:
                kw[key] = parse(value)
            except ValueError:
                raise ConfigError(f"{option} {url!r}: {key}={value!r} is not {what}") from None
        return cls(servers, **kw, given=frozenset(kw))
