"""Acknowledgements of a batch published message by message, and the clock every wait for an
acknowledgement shares.

Every message asks for its acknowledgement on ``<inbox>.<n>`` of the connection's one reply
subscription, where it is counted as it arrives (no future, no message object per publish).
A wait fails when no acknowledgement of any kind has come for ``ack_timeout`` (a hung, killed
or restarted server), however long the batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

import msgspec

from ledger_cdc.errors import JetStreamError
from ledger_cdc.natswire import status_of
from ledger_cdc.sink.jetstream_link import Link, subscribe_raw

__all__ = ["WINDOW", "Acks", "api_error", "no_stream"]

WINDOW = 4000  # publishes awaiting their acknowledgement at once
_CHUNK = 500  # messages written to the connection at a time

Frame = tuple[bytes, bytes, bytes]  # (subject, headers, body)


def api_error(err: dict[str, Any]) -> str:
    """A JetStream API error (``{"code", "err_code", "description"}``) in one line."""
    return f"{err.get('description', '?')} (code {err.get('err_code', '?')})"


def no_stream(prefix: str) -> str:
    """Why a publish was answered 503 (no responders)."""
    return f"no JetStream stream takes the subjects under {prefix!r} (503 no responders)"


class Acks:
    """The acknowledgements of the batch under way: replies to ``<reply>.<n>``, ``n`` from
    ``base`` on (a reply below it answers an earlier, failed batch). :meth:`answered` is the
    clock of progress: any answer, of a fast-ingest batch too, restarts ``ack_timeout``."""

    def __init__(self, ack_timeout: float, prefix: str) -> None:
        self.ack_timeout = ack_timeout
        self._prefix = prefix
        self._reply = b""
        self._next = 0
        self._base = 0
        self._acked = 0
        self._error: str | None = None
        self._want = 0  # _progress is set once this many are acknowledged (or on an error)
        self._last = 0.0  # when the last answer came (monotonic)
        self._progress = asyncio.Event()

    async def subscribe(self, nc: Any) -> None:
        """The reply subscription of a new connection."""
        self._reply = nc.new_inbox().encode()
        await subscribe_raw(
            nc,
            self._reply.decode() + ".*",
            lambda subject, reply, data, headers: self._ack(
                subject.rpartition(b".")[2], data, headers
            ),
            pending=4 * WINDOW + 1000,
        )

    def answered(self) -> None:
        """An answer came: the wait under way goes on from now."""
        self._last = time.monotonic()
        self._progress.set()

    def _ack(self, n: bytes, data: bytes, headers: bytes) -> None:
        if not n.isdigit() or int(n) < self._base:
            return  # a reply to an earlier (failed) batch
        self._acked += 1
        self._last = time.monotonic()
        if status_of(headers) == b"503":
            self._error = self._error or no_stream(self._prefix)
        elif b'"error"' in data[:64]:
            try:
                what = api_error(msgspec.json.decode(data).get("error", {}))
            except (msgspec.DecodeError, AttributeError):
                what = repr(data[:200])
            self._error = self._error or f"JetStream refused a message: {what}"
        if self._acked >= self._want or self._error is not None:
            self._progress.set()

    async def wait(self, done: Callable[[], bool], what: Callable[[], str]) -> None:
        """Until ``done()``; fails when no answer came for ``ack_timeout``, saying ``what()``
        was outstanding."""
        timeout = self.ack_timeout
        began = time.monotonic()
        while not done():
            self._progress.clear()
            left = max(self._last, began) + timeout - time.monotonic()
            if left <= 0:
                raise JetStreamError(
                    f"JetStream did not acknowledge within {timeout:.0f}s ({what()})"
                )
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._progress.wait(), left)

    async def _await(self, upto: int) -> None:
        """Until ``upto`` of this batch's messages are acknowledged."""
        self._want = upto
        await self.wait(
            lambda: self._acked >= upto or self._error is not None,
            lambda: f"{upto - self._acked} of {upto} messages outstanding",
        )
        if self._error is not None:
            raise JetStreamError(self._error)

    async def publish_each(self, link: Link, todo: list[Frame]) -> None:
        """``todo`` in order, each message acknowledged on its own; at most :data:`WINDOW`
        awaited at once."""
        self._base = self._next
        self._acked = 0
        self._error = None
        reply = self._reply + b"."
        frames: list[bytes] = []
        sent = 0
        for subject, hdr, data in todo:  # in order: one connection
            frames.append(
                b"HPUB %b %b%d %d %d\r\n%b%b\r\n"
                % (subject, reply, self._next, len(hdr), len(hdr) + len(data), hdr, data)
            )
            self._next += 1
            sent += 1
            if len(frames) >= _CHUNK:
                await link.write(frames)
                frames = []
                await self._await(sent - WINDOW)  # at most WINDOW unacknowledged
        if frames:
            await link.write(frames)
        await self._await(sent)
