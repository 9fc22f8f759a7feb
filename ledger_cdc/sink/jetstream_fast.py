"""Fast-ingest batches (JetStream batch publishing, ADR-50, nats-server 2.14+, a stream with
``allow_batched``): the server acknowledges every few hundred messages instead of each, stores
the batch in order up to its first gap ("fail" mode: a gap ends the batch), and counts what it
stored in its final acknowledgement, which is checked.

The messages of a batch ask for their answers on ``<inbox>.<batch id>.<flow>.fail.<n>.<op>.$FI``
(``op`` 0 starts the batch, 1 appends to it, 2 stores the last message and commits). The server
acknowledges every ``flow`` messages at most (it may ask for fewer, as other batches come and
go); at most :data:`_OUTSTANDING` acknowledgements are awaited at once. A batch smaller than
:data:`FAST_MIN` is published message by message instead: a fast batch costs one round trip more
(the server's first answer is awaited before the rest is sent).
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import msgspec

from ledger_cdc.errors import JetStreamError
from ledger_cdc.natswire import status_of
from ledger_cdc.sink.jetstream_acks import Acks, Frame, api_error, no_stream
from ledger_cdc.sink.jetstream_link import Link, subscribe_raw

__all__ = ["FAST_MIN", "FastBatch", "FastIngest"]

log = logging.getLogger(__name__)

FAST_MIN = 64
_FLOW = 500
_OUTSTANDING = 4
_DISABLED = 10205  # err_code: batch publish is disabled on the stream


class FastBatch:
    """The state of a fast-ingest batch under way, as its answers update it (:meth:`answer`)."""

    def __init__(self, bid: bytes) -> None:
        self.bid = bid
        self.started = False  # the server answered the first message
        self.refused: str | None = None  # … by refusing it: why (nothing was stored)
        self.disabled = False  # … because the stream takes no batches
        self.flow = 1  # the server acknowledges every this many messages
        self.acked = 0  # every message up to this one is stored
        self.final: int | None = None  # messages stored, from the final acknowledgement
        self.error: str | None = None
        self.sent = 0  # messages written (or about to be)

    def room(self) -> bool:
        """Whether what is written leaves few enough acknowledgements outstanding."""
        return self.sent - self.acked <= self.flow * _OUTSTANDING or self.error is not None

    def fail(self, why: str) -> None:
        self.error = self.error or why

    def check(self) -> None:
        if self.error is not None:
            raise JetStreamError(self.error)

    def answer(self, data: bytes) -> None:
        """An answer: a flow acknowledgement (every message up to its ``seq`` is stored), a gap
        or an error (the batch ends), or the final publish acknowledgement (``count`` messages
        stored, duplicates included)."""
        try:
            answer = msgspec.json.decode(data)
            if not isinstance(answer, dict):
                raise TypeError
            kind = answer.get("type")
            error = answer.get("error")
            if kind == "ack":
                self.started = True
                self.acked = max(self.acked, int(answer["seq"]))
                self.flow = max(1, min(_FLOW, int(answer["msgs"])))
            elif kind == "gap":
                self.fail(
                    f"JetStream expected message {answer.get('last_seq')} of a batch and got "
                    f"{answer.get('seq')}: the batch ends there"
                )
            elif kind == "err" or isinstance(error, dict):
                self._refused(error if isinstance(error, dict) else {})
            else:
                self.final = int(answer["count"])
                self.started = True
        except (msgspec.DecodeError, TypeError, KeyError, ValueError):
            self.fail(f"JetStream answered a batch with {data[:200]!r}")

    def _refused(self, err: dict[str, Any]) -> None:
        what = api_error(err)
        if not self.started:  # the start refused: nothing of the batch was stored
            self.started = True
            self.refused = what
            self.disabled = err.get("err_code") == _DISABLED
        else:
            self.fail(f"JetStream refused a message of a batch: {what}")


class FastIngest:
    """A connection's fast-ingest batches: the inbox their answers come to, the batch under
    way, and whether the stream takes them (``on``: read when the connection began, turned off
    when the stream refuses a batch because it no longer does)."""

    def __init__(self, acks: Acks, stream: str, prefix: str) -> None:
        self._acks = acks
        self._stream = stream
        self._prefix = prefix
        self.on = False
        self._inbox = b""
        self._batch: FastBatch | None = None
        self.batches = 0  # batches published as fast-ingest batches
        self.published = 0  # messages in them

    async def subscribe(self, nc: Any) -> None:
        """The answer subscription of a new connection."""
        self._inbox = nc.new_inbox().encode()
        await subscribe_raw(
            nc,
            self._inbox.decode() + ".>",
            lambda subject, reply, data, headers: self._answer(subject, data, headers),
            pending=1000,
        )

    def _answer(self, subject: bytes, data: bytes, headers: bytes) -> None:
        st = self._batch
        start = len(self._inbox) + 1
        if st is None or subject[start : start + len(st.bid)] != st.bid:
            return  # an answer to an earlier batch
        self._acks.answered()
        if status_of(headers) == b"503":
            st.fail(no_stream(self._prefix))
        else:
            st.answer(data)

    async def publish(self, link: Link, todo: list[Frame]) -> bool:
        """``todo`` (at least 2 messages) as one batch. False when the server refused the
        batch's start (nothing was stored): batching turned off on the stream (then ``on`` is
        cleared), too many batches in flight, …"""
        st = self._batch = FastBatch(uuid.uuid4().hex.encode())
        try:
            return await self._send(link, todo, st)
        finally:
            if self._batch is st:  # (not a later batch's: a cancelled one ends here at once)
                self._batch = None

    async def _send(self, link: Link, todo: list[Frame], st: FastBatch) -> bool:
        n = len(todo)
        prefix = b"%b.%b.%d.fail." % (self._inbox, st.bid, _FLOW)
        frame = b"HPUB %b " + prefix.replace(b"%", b"%%") + b"%d.%d.$FI %d %d\r\n%b%b\r\n"
        wait = self._acks.wait

        async def send(first: int, end: int, op: int) -> None:
            """Messages first … end-1, once few enough acknowledgements are outstanding."""
            st.sent = end - 1
            await wait(st.room, lambda: f"{st.sent - st.acked} of {n} messages")
            st.check()
            await link.write(
                [
                    frame % (subject, i, op, len(h), len(h) + len(d), h, d)
                    for i, (subject, h, d) in enumerate(todo[first - 1 : end - 1], first)
                ]
            )

        # the server's first answer: batching is on, and how often it acknowledges
        await send(1, 2, 0)
        await wait(lambda: st.started or st.error is not None, lambda: "a batch's start")
        if st.refused is not None:
            self._refused(st)
            return False
        st.check()
        i = 2
        while i < n:  # messages 2 … n-1, as many at a time as the server acknowledges at once
            end = min(n, i + st.flow)  # (its flow changes as other batches come and go)
            await send(i, end, 1)
            i = end
        await send(n, n + 1, 2)  # the last alone: it commits the batch
        await wait(
            lambda: st.final is not None or st.error is not None,
            lambda: f"the end of a batch of {n} messages, {st.acked} acknowledged",
        )
        st.check()
        if st.final != n:
            raise JetStreamError(f"JetStream stored {st.final} of a batch of {n} messages")
        self.batches += 1
        self.published += n
        return True

    def _refused(self, st: FastBatch) -> None:
        if st.disabled:
            log.info(
                "JetStream stream %s no longer takes batched publishes: every message is "
                "acknowledged on its own",
                self._stream,
            )
            self.on = False
        else:  # (e.g. too many batches in flight on the stream): this one goes without
            log.info("JetStream refused a batch's start (%s): sent one by one", st.refused)
