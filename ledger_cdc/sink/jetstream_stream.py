"""The JetStream stream a publisher writes to: made, or checked and brought to the URL's
settings, when a connection begins; and what it already holds, so that a publisher restarted
past the duplicate window does not publish again what a crashed one stored.

What it holds is read from the stream's messages (:mod:`ledger_cdc.natswire` says how): the
last message's ``Ledger-High-Lsn`` (the highest commit LSN the stream may hold), and, for a
subject whose messages may be there, its last message's position.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

from ledger_cdc.errors import ConfigError
from ledger_cdc.natswire import (
    MSG_ID,
    Message,
    high_lsn,
    msg_id_position,
    published_by,
    stream_subjects,
)
from ledger_cdc.sink.jetstream_link import first_line
from ledger_cdc.sink.jetstream_settings import JetStreamSettings

__all__ = ["StreamHeads", "batching", "ensure_stream", "high_water"]

log = logging.getLogger(__name__)

_LOOKUPS = 4000  # subjects looked up at once


async def ensure_stream(js: Any, s: JetStreamSettings) -> Any:
    """The stream's info, once it exists with our subjects and the URL's settings: made if
    missing (a forming cluster may refuse to for a while: the next publish tries again)."""
    from nats.js.api import StreamConfig
    from nats.js.errors import NotFoundError

    subjects = stream_subjects(s.prefix)
    try:
        info = await js.stream_info(s.stream)
    except NotFoundError:
        return await js.add_stream(
            StreamConfig(
                name=s.stream,
                subjects=subjects,
                num_replicas=s.replicas,
                duplicate_window=s.duplicate_window,
                allow_batched=s.batched or None,
            )
        )
    return await _reconcile(js, s, info, subjects)


async def _reconcile(js: Any, s: JetStreamSettings, info: Any, subjects: list[str]) -> Any:
    """An existing stream whose settings differ from what the URL gives (replicas, duplicate
    window: those it names; our subjects, always) is updated to them, or refused with what
    differs. Returns its info."""
    config = info.config
    have = {
        "replicas": config.num_replicas,
        "duplicate_window": float(config.duplicate_window or 0),
        "subjects": sorted(config.subjects or []),
    }
    want = {
        "replicas": s.replicas if "replicas" in s.given else have["replicas"],
        "duplicate_window": (
            s.duplicate_window if "duplicate_window" in s.given else have["duplicate_window"]
        ),
        "subjects": sorted(set(have["subjects"]) | set(subjects)),
    }
    differs = {k: (have[k], want[k]) for k in have if have[k] != want[k]}
    if not differs:
        return info
    try:
        info = await js.update_stream(
            dataclasses.replace(
                config,
                num_replicas=want["replicas"],
                duplicate_window=want["duplicate_window"],
                subjects=want["subjects"],
            )
        )
        log.info("JetStream stream %s updated: %s", s.stream, differs)
        return info
    except Exception as e:
        what = ", ".join(f"{k} {have!r} → {want!r}" for k, (have, want) in differs.items())
        raise ConfigError(
            f"JetStream stream {s.stream!r} exists with other settings ({what}) and the "
            f"server refused to update it ({first_line(e)}): change the URL's options to "
            "match, or update the stream yourself"
        ) from e


async def batching(js: Any, s: JetStreamSettings, info: Any) -> bool:
    """Whether batches go as fast-ingest batches: the URL wants them (``batched``, true by
    default) and the stream takes them. An existing stream that does not is asked to (a server
    before 2.14 knows no such setting: its answer leaves it out, and every batch is then
    published message by message); with ``batched=false`` it is left as it is."""
    if getattr(info.config, "allow_batched", None):
        return s.batched
    if not s.batched:
        return False
    try:
        info = await js.update_stream(dataclasses.replace(info.config, allow_batched=True))
    except Exception as e:
        log.info(
            "JetStream stream %s does not take batched publishes (%s): every message is "
            "acknowledged on its own",
            s.stream,
            first_line(e),
        )
        return False
    return bool(getattr(info.config, "allow_batched", None))


async def high_water(js: Any, stream: str, slot: str) -> int | None:
    """The high LSN the stream's last message carries (0 for an empty stream; None when it
    carries none, or when another slot published it: shards share a stream, and one that is
    behind marks only what it knows, below what this slot may have stored)."""
    from nats.js.errors import NotFoundError

    info = await js.stream_info(stream)
    last = int(getattr(info.state, "last_seq", 0) or 0)
    if last == 0:
        return 0
    try:
        msg = await js.get_msg(stream, seq=last)
    except NotFoundError:
        return None
    headers = msg.headers or {}
    if not published_by(headers.get(MSG_ID, ""), slot):
        return None
    return high_lsn(headers)


class StreamHeads:
    """What the stream holds, as far as this connection knows: for each subject the last
    position it holds (read once, then kept up with what is acknowledged), and ``high``, the
    highest commit LSN it may hold (None: not known, every subject is looked up). A message of a
    later commit cannot be in the stream, so only the others need their subject's head. Forgotten
    with the connection: another publisher may have written since."""

    def __init__(self) -> None:
        self.heads: dict[bytes, int] = {}
        self.high: int | None = None
        self.read = 0  # subjects whose last message was read

    def forget(self) -> None:
        self.heads = {}
        self.high = None

    def holds(self, subject: bytes, position: int) -> bool:
        """Whether the stream holds ``position`` on ``subject`` (published before a crash)."""
        return 0 < position <= self.heads.get(subject, 0)

    async def learn(self, js: Any, stream: str, msgs: list[Message], timeout: float) -> None:
        """The heads of the subjects of those of ``msgs`` that may be in the stream already."""
        high = self.high
        maybe = (m[0] for m in msgs if high is None or m[4] <= high)
        unknown = [s for s in dict.fromkeys(maybe) if s not in self.heads]
        for i in range(0, len(unknown), _LOOKUPS):
            part = unknown[i : i + _LOOKUPS]
            heads = await asyncio.wait_for(
                asyncio.gather(*(_head(js, stream, s) for s in part)), timeout
            )
            self.heads.update(zip(part, heads, strict=True))
            self.read += len(part)

    def stored(self, msgs: list[Message]) -> None:
        """All of ``msgs`` acknowledged: the stream holds them now."""
        heads = self.heads
        for subject, _, _, position, _ in msgs:
            if position > heads.get(subject, 0):
                heads[subject] = position
        if self.high is not None:
            self.high = max(self.high, max(m[4] for m in msgs))


async def _head(js: Any, stream: str, subject: bytes) -> int:
    """The last position the stream holds on ``subject`` (0: none), from its last message's
    ``Nats-Msg-Id``."""
    from nats.js.errors import NotFoundError

    try:
        msg = await js.get_last_msg(stream, subject.decode())
    except NotFoundError:
        return 0
    return msg_id_position((msg.headers or {}).get(MSG_ID, ""))
