"""The outbox dispatcher: performs the external calls that committed events asked for.

An event that needs the outside world (a webhook, a tool service) is written with an outbox row
in the same transaction (:class:`ledger_cdc.OutboxItem`). The dispatcher claims due rows, calls
each target with the row's idempotency key, and records the outcome — dispatched, or the error
and the time of the next attempt (capped exponential backoff with jitter), the row parked after
``max_attempts`` attempts.

No transaction is open while a call is in flight (a long one would hold back vacuum, and meet
the idle-in-transaction timeouts managed servers set). A claim is a lease: one short statement
takes due rows that nobody holds (``FOR UPDATE SKIP LOCKED`` inside it, so two dispatchers never
take one row) and sets ``claimed_by`` / ``claim_until`` and ``attempts + 1`` — every call is
counted, even one whose dispatcher dies before its outcome is written. While calls are in
flight the dispatcher renews its claims; the outcome is written only where the claim is still
its own. A dispatcher that dies stops renewing: its claims expire after ``claim_seconds`` and
another dispatcher retries those rows, with the same keys. A row claimed ``max_attempts`` times
without an outcome is parked, so a row that kills its dispatchers does not loop for ever.

Why polling rather than the change stream: rows are dispatched whether or not the consumer
runs, retries need a clock the stream does not have, and no extra slot retains WAL. The cost is
an index probe per poll on the partial index of due rows; a full batch is followed at once by
the next.

Guarantee: at least once per row, always with the same idempotency key (``Idempotency-Key``
header for HTTP targets); exactly once in effect for a target that deduplicates by that key. A
second call of one row only happens after its claim expired (its dispatcher died or hung past
the claim without renewing), or after a call that did not return within ``call_timeout`` was
recorded as failed. No order is promised between rows.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import logging
import os
import socket
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

import msgspec
import psycopg

from ledger_cdc import retry
from ledger_cdc.connect import connect
from ledger_cdc.errors import ConfigError, LedgerError, RetryableError, translate
from ledger_cdc.events import READ_MAX_DEPTH, decode_bounded
from ledger_cdc.settings import DAY, check_ranges

__all__ = [
    "ENTRY_POINT_GROUP",
    "DispatchConfig",
    "DispatchMetrics",
    "Dispatcher",
    "HttpTarget",
    "OutboxMessage",
    "Target",
    "load_entry_point_targets",
    "parse_target",
]

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "ledger_cdc.targets"
"""Entry-point group of Python targets: ``name = "package.module:callable"``."""


@dataclass(frozen=True)
class OutboxMessage:
    """What a target receives: one outbox row."""

    id: int
    session_id: uuid.UUID
    event_seq: int
    target: str
    payload: Any
    idempotency_key: str
    attempt: int  # 1 for the first attempt


Target = Callable[[OutboxMessage], object]
"""A target performs the call; returning means success, raising means failure (retried)."""


_MAX_ANSWER = 64 * 1024  # bytes of a 2xx answer read (then dropped): its status is the answer


class _Deadline:
    """Shuts a call's sockets down when its time is up. A socket timeout bounds one read, not
    the call: a target that trickles a byte every second would otherwise hold the call (and
    its claim, renewed meanwhile) for ever."""

    def __init__(self, seconds: float) -> None:
        self.passed = False
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._fire)
        self._timer.daemon = True

    def __enter__(self) -> _Deadline:
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            self._socks.append(sock)
            if self.passed:
                _shut(sock)

    def _fire(self) -> None:
        with self._lock:
            self.passed = True
            for sock in self._socks:
                _shut(sock)


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def _watched(deadline: _Deadline) -> Any:
    """``socket.create_connection`` whose socket the deadline watches from the start (before a
    TLS handshake, which a slow server could trickle too)."""

    def create_connection(*args: Any, **kwargs: Any) -> socket.socket:
        sock = socket.create_connection(*args, **kwargs)
        deadline.watch(sock)
        return sock

    return create_connection


class _HTTPConnection(http.client.HTTPConnection):
    def __init__(self, *args: Any, deadline: _Deadline, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._create_connection = _watched(deadline)


class _HTTPSConnection(http.client.HTTPSConnection):
    def __init__(self, *args: Any, deadline: _Deadline, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._create_connection = _watched(deadline)


class _HTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, deadline: _Deadline) -> None:
        super().__init__()
        self._deadline = deadline

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(functools.partial(_HTTPConnection, deadline=self._deadline), req)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, deadline: _Deadline) -> None:
        super().__init__()
        self._deadline = deadline

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        conn = functools.partial(_HTTPSConnection, deadline=self._deadline)
        return self.do_open(conn, req, context=self._context)  # type: ignore[attr-defined]


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is an answer that is not 2xx: following it would resend the call as a GET
    without its payload (301-303), or to another host, and count that as done."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


class HttpTarget:
    """POST the payload as JSON to ``url`` with ``Idempotency-Key``; any 2xx is success.

    ``timeout`` bounds the whole call (connect, send, answer), not each read. Redirects are
    not followed (a 3xx is a failure, so give the final URL); at most 64 KiB of the answer is
    read. Proxies come from the usual ``http_proxy`` / ``https_proxy`` / ``no_proxy``."""

    def __init__(self, url: str, *, timeout: float = 10.0, headers: Mapping[str, str] = {}):
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"webhook URL must start with http:// or https://, got {url!r}")
        self.url = url
        self.timeout = timeout
        self.headers = dict(headers)

    def __call__(self, msg: OutboxMessage) -> None:
        req = urllib.request.Request(
            self.url,
            data=msgspec.json.encode(msg.payload),
            method="POST",
            headers={
                "Content-Type": "application/json",
                "Idempotency-Key": msg.idempotency_key,
                "X-Ledger-Session": str(msg.session_id),
                "X-Ledger-Outbox-Id": str(msg.id),
                "X-Ledger-Attempt": str(msg.attempt),
                **self.headers,
            },
        )
        with _Deadline(self.timeout) as deadline:
            opener = urllib.request.build_opener(
                _NoRedirect, _HTTPHandler(deadline), _HTTPSHandler(deadline)
            )
            try:
                # a 2xx status is the answer: the body is drained (within the deadline, at
                # most 64 KiB) and dropped
                with (
                    opener.open(req, timeout=self.timeout) as resp,
                    contextlib.suppress(http.client.HTTPException, OSError),
                ):
                    resp.read(_MAX_ANSWER)
            except urllib.error.HTTPError as e:
                body = ""
                with contextlib.suppress(http.client.HTTPException, OSError):
                    body = e.read(200).decode("utf-8", "replace").strip()
                if 300 <= e.code < 400:
                    body = f"redirects are not followed (to {e.headers.get('Location')!r})"
                detail = f": {body}" if body else ""
                raise LedgerError(f"HTTP {e.code} from {self.url}{detail}") from e
            except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
                if deadline.passed:
                    raise LedgerError(f"{self.url}: no answer within {self.timeout:g}s") from e
                reason = getattr(e, "reason", e)
                raise LedgerError(f"{self.url} unreachable: {reason}") from e

    def __repr__(self) -> str:
        return f"HttpTarget({self.url!r})"


def parse_target(spec: str, *, timeout: float = 10.0) -> tuple[str, Target]:
    """``NAME=URL`` (an HTTP webhook) → (name, target)."""
    name, sep, url = spec.partition("=")
    if not sep or not name or not url:
        raise ConfigError(
            f"target {spec!r} is not NAME=URL (e.g. --target tool:search=http://127.0.0.1:8080/)"
        )
    return name, HttpTarget(url, timeout=timeout)


def load_entry_point_targets() -> dict[str, Target]:
    """Python targets registered by installed packages under :data:`ENTRY_POINT_GROUP`."""
    out: dict[str, Target] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            fn = ep.load()
        except Exception as e:
            raise ConfigError(f"entry point {ep.name} = {ep.value} cannot be loaded: {e}") from e
        if not callable(fn):
            raise ConfigError(f"entry point {ep.name} = {ep.value} is not callable")
        out[ep.name] = fn
    return out


@dataclass
class DispatchConfig:
    # a DSN, not a connection: the dispatcher opens its session itself, and again when the
    # server ends it, for as long as it runs
    dsn: str
    targets: dict[str, Target]
    batch_size: int = 32
    concurrency: int = 8
    max_attempts: int = 8
    backoff_base: float = 1.0  # seconds before the 2nd attempt; doubles each time
    backoff_cap: float = 300.0
    poll_interval: float = 0.5  # between polls that found nothing due
    claim_seconds: float = 30.0  # a claim's lease, renewed while its calls are in flight
    # a call not returned by then is recorded as failed and its claim no longer renewed (an
    # HttpTarget ends itself at its own timeout; this bounds a Python target that hangs)
    call_timeout: float = 60.0

    def check(self) -> None:
        """Raise ConfigError for a value out of range (a NaN, a wait too long for the
        platform's clock, a batch of no rows): the dispatcher checks before it starts."""
        ranges: dict[str, tuple[float, float]] = {
            "batch_size": (1, 2**31),
            "concurrency": (1, 2**31),
            "max_attempts": (1, 2**31),
            "backoff_base": (0, DAY),
            "backoff_cap": (0, DAY),
            "poll_interval": (0.01, 3600),
            "claim_seconds": (0.1, DAY),
            "call_timeout": (0.001, DAY),
        }
        check_ranges("dispatcher settings", self, ranges)


@dataclass
class DispatchMetrics:
    dispatched: int = 0
    failures: int = 0
    parked: int = 0
    polls: int = 0
    lost_claims: int = 0  # outcomes not written: the claim had expired and been taken
    parked_rows: list[tuple[int, str, str, str]] = field(
        default_factory=list
    )  # id, target, key, error


_CLAIM = """
UPDATE agent_outbox o
SET claimed_by = %(me)s, claim_until = now() + make_interval(secs => %(lease)s),
    attempts = o.attempts + 1
WHERE o.id IN (
    SELECT id FROM agent_outbox
    WHERE NOT dispatched AND NOT parked AND target = ANY(%(targets)s)
      AND (next_attempt_at IS NULL OR next_attempt_at <= now())
      AND (claim_until IS NULL OR claim_until < now())
      AND attempts < %(max)s
    ORDER BY id
    LIMIT %(n)s
    FOR UPDATE SKIP LOCKED)
RETURNING o.id, o.session_id, o.event_seq, o.target, o.payload::text, o.idempotency_key,
          o.attempts
"""
# rows claimed max_attempts times whose last claim expired without an outcome: parked
_ABANDONED = """
UPDATE agent_outbox SET parked = true, claimed_by = NULL, claim_until = NULL,
    last_error = coalesce(last_error || '; ', '') || 'claimed ' || attempts
                 || ' times without an outcome (its dispatchers died or hung)'
WHERE NOT dispatched AND NOT parked AND target = ANY(%(targets)s) AND attempts >= %(max)s
  AND (claim_until IS NULL OR claim_until < now())
RETURNING id, target, idempotency_key, last_error
"""
_RENEW = """
UPDATE agent_outbox SET claim_until = now() + make_interval(secs => %(lease)s)
WHERE id = ANY(%(ids)s) AND claimed_by = %(me)s AND NOT dispatched
"""
_DONE = """
UPDATE agent_outbox SET dispatched = true, dispatched_at = now(), last_error = NULL,
       next_attempt_at = NULL, claimed_by = NULL, claim_until = NULL
WHERE id = ANY(%(ids)s) AND claimed_by = %(me)s
RETURNING id
"""
_FAILED = """
UPDATE agent_outbox SET last_error = %(err)s,
       next_attempt_at = now() + make_interval(secs => %(delay)s), parked = %(park)s,
       claimed_by = NULL, claim_until = NULL
WHERE id = %(id)s AND claimed_by = %(me)s
RETURNING id
"""
_UNSERVED = """
SELECT target, count(*) FROM agent_outbox
WHERE NOT dispatched AND NOT parked AND target <> ALL(%s) GROUP BY target ORDER BY target
"""


class Dispatcher:
    """Claim due outbox rows, call their targets, record the outcome (see the module doc)."""

    def __init__(self, config: DispatchConfig) -> None:
        config.check()
        if not config.targets:
            raise ConfigError(
                "no targets: give --target NAME=URL or install a package with "
                f"{ENTRY_POINT_GROUP!r} entry points"
            )
        self.config = config
        self.metrics = DispatchMetrics()
        self.name = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._stop = threading.Event()
        # a claim counts as an attempt of every row it takes: it takes no more rows than are
        # called at once, or a dispatcher killed mid-batch would charge attempts to rows it
        # never called, and park them unsent
        self._claim_size = max(1, min(config.batch_size, config.concurrency))
        self._conn: psycopg.Connection[Any] | None = None

    def stop(self) -> None:
        self._stop.set()

    def open(self) -> None:
        """Connect now: at start-up a database that cannot be reached is said at once."""
        self._conn = connect(self.config.dsn, autocommit=True)

    @property
    def conn(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = connect(self.config.dsn, doing="outbox database", autocommit=True)
        return self._conn

    def _sql(self, query: str, params: Any) -> list[tuple[Any, ...]]:
        """One statement, in a transaction of its own; driver errors leave translated."""
        try:
            cur = self.conn.execute(query, params)
            return cur.fetchall() if cur.description is not None else []
        except psycopg.Error as e:
            with contextlib.suppress(Exception):
                self.conn.close()
            raise translate(e, dsn=self.config.dsn, doing="outbox database") from e

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()

    def unserved(self) -> list[tuple[str, int]]:
        """Targets with due rows that this dispatcher has no target for."""
        rows = self._sql(_UNSERVED, (list(self.config.targets),))
        return [(str(t), int(n)) for t, n in rows]

    def _backoff(self, attempts: int) -> float:
        return retry.delay(
            attempts - 1, base=self.config.backoff_base, cap=self.config.backoff_cap, jitter=0.25
        )

    def _call(self, msg: OutboxMessage) -> str | None:
        try:
            self.config.targets[msg.target](msg)
        except Exception as e:  # a target's failure is data: recorded, retried, parked
            return f"{type(e).__name__}: {e}" if not isinstance(e, LedgerError) else str(e)
        return None

    def run_once(self) -> int:
        """Claim one batch of due rows, call their targets (renewing the claims meanwhile),
        record the outcomes; returns the rows claimed."""
        cfg = self.config
        targets = list(cfg.targets)
        self.metrics.polls += 1
        for rid, target, key, err in self._sql(
            _ABANDONED, {"targets": targets, "max": cfg.max_attempts}
        ):
            self.metrics.parked += 1
            self.metrics.parked_rows.append((int(rid), target, key, err))
            log.error("outbox row %s (%s, key %s) parked: %s", rid, target, key, err)
        params = {
            "me": self.name,
            "lease": cfg.claim_seconds,
            "targets": targets,
            "max": cfg.max_attempts,
            "n": self._claim_size,
        }
        rows = self._sql(_CLAIM, params)
        if not rows:
            return 0
        msgs: list[OutboxMessage] = []
        unreadable: dict[int, str] = {}  # row → why its payload cannot be read: parked uncalled
        for r in sorted(rows):
            try:
                # as deep as the writer lets a payload be, and no deeper, on every Python
                payload = decode_bounded(msgspec.json.decode, r[4], READ_MAX_DEPTH)
            except msgspec.DecodeError as e:
                payload, unreadable[int(r[0])] = None, f"payload cannot be read: {e}"
            msgs.append(OutboxMessage(int(r[0]), r[1], int(r[2]), r[3], payload, r[5], int(r[6])))
        called = iter(self._call_all([m for m in msgs if m.id not in unreadable]))
        errors = [unreadable[m.id] if m.id in unreadable else next(called) for m in msgs]
        done = [m.id for m, err in zip(msgs, errors, strict=True) if err is None]
        if done:
            marked = {r[0] for r in self._sql(_DONE, {"ids": done, "me": self.name})}
            self.metrics.dispatched += len(marked)
            self._lost(set(done) - marked)
        for m, err in zip(msgs, errors, strict=True):
            if err is None:
                continue
            park = m.attempt >= cfg.max_attempts or m.id in unreadable  # (no retry reads it)
            got = self._sql(
                _FAILED,
                {
                    "err": err[:2000],
                    "delay": self._backoff(m.attempt),
                    "park": park,
                    "id": m.id,
                    "me": self.name,
                },
            )
            if got:
                self._failed(m, err, park)
            else:
                self._lost({m.id})
        return len(rows)

    def _start(self, msg: OutboxMessage) -> Future[str | None]:
        """One call on a daemon thread of its own: a call abandoned at its deadline must not
        hold a pool's worker, nor the process at exit."""
        fut: Future[str | None] = Future()

        def work() -> None:
            try:
                fut.set_result(self._call(msg))
            except BaseException as e:  # a target's SystemExit is its failure too
                fut.set_result(f"{type(e).__name__}: {e}")

        threading.Thread(target=work, name=f"ledger-dispatch-{msg.id}", daemon=True).start()
        return fut

    def _call_all(self, msgs: list[OutboxMessage]) -> list[str | None]:
        """Call every target at once, renewing this dispatcher's claims until all return or
        ``call_timeout`` passes (those still out are failures). No transaction is open
        meanwhile. A renewal that fails is tried again at once on a new connection (the
        usual cause: the session was terminated), then every few tenths of a second: a claim
        lapses only if the database stays out of reach."""
        futures = [self._start(m) for m in msgs]
        ids = [m.id for m in msgs]
        every = max(0.05, self.config.claim_seconds / 3)
        # a second of grace: a target with a deadline of its own (HttpTarget) says first
        give_up = time.monotonic() + self.config.call_timeout + 1.0
        failing = False
        while (left := give_up - time.monotonic()) > 0:
            _, pending = wait(futures, timeout=min(min(every, 0.2) if failing else every, left))
            if not pending:
                break
            try:
                self._renew(ids)
                failing = False
            except RetryableError as e:  # the claims lapse if this lasts a claim long
                if not failing:
                    log.warning("could not renew outbox claims (%s); retrying", e)
                failing = True
        late = (
            f"no answer within {self.config.call_timeout:g}s (the call may still reach the target)"
        )
        return [f.result() if f.done() else late for f in futures]

    def _renew(self, ids: list[int]) -> None:
        params = {"lease": self.config.claim_seconds, "ids": ids, "me": self.name}
        try:
            self._sql(_RENEW, params)
        except RetryableError:  # most often a terminated session: again, on a new connection
            self._sql(_RENEW, params)

    def _lost(self, ids: set[int]) -> None:
        if ids:
            self.metrics.lost_claims += len(ids)
            log.warning(
                "outcome of outbox row(s) %s not recorded: the claim expired and another "
                "dispatcher took them (they will be called again, with the same keys)",
                ", ".join(map(str, sorted(ids))),
            )

    def _failed(self, m: OutboxMessage, err: str, park: bool) -> None:
        self.metrics.failures += 1
        if park:
            self.metrics.parked += 1
            self.metrics.parked_rows.append((m.id, m.target, m.idempotency_key, err))
            log.error(
                "outbox row %s (%s, key %s) parked after %s attempts: %s",
                m.id,
                m.target,
                m.idempotency_key,
                m.attempt,
                err,
                extra={"fields": {"outbox_id": m.id, "target": m.target, "parked": True}},
            )
        else:
            log.warning(
                "outbox row %s (%s, key %s) attempt %s failed: %s",
                m.id,
                m.target,
                m.idempotency_key,
                m.attempt,
                err,
            )

    def run(self, *, once: bool = False, idle_exit: bool = False) -> DispatchMetrics:
        """Dispatch until stopped (``once``: one pass over what is due now; ``idle_exit``: until
        nothing is due). Database failures that pass are retried with backoff; a permanent one
        (privileges, schema) ends the run with its one-line error."""
        backoff = retry.Backoff(base=0.5, cap=30.0)
        try:
            while not self._stop.is_set():
                try:
                    handled = self.run_once()
                    backoff.succeeded()
                except RetryableError as e:
                    delay = backoff.failed()
                    log.warning("%s; retrying in %.1fs", e, delay)
                    self._stop.wait(delay)
                    continue
                if handled == self._claim_size:
                    continue  # a full batch: more are probably due
                if once or (idle_exit and handled == 0 and not self._pending_retries()):
                    break
                if handled == 0:
                    self._stop.wait(self.config.poll_interval)
        finally:
            self.close()
        return self.metrics

    def _pending_retries(self) -> bool:
        row = self._sql(
            "SELECT EXISTS (SELECT FROM agent_outbox WHERE NOT dispatched AND NOT parked "
            "AND target = ANY(%s))",
            (list(self.config.targets),),
        )
        return bool(row and row[0][0])


def outbox_rows(
    conn: psycopg.Connection[Any], *, parked: bool | None = None, limit: int = 100
) -> list[dict[str, Any]]:
    """Rows for ``ledger-cdc outbox``: newest first."""
    if parked is None:
        where = ""
    else:
        where = "WHERE parked" if parked else "WHERE NOT dispatched AND NOT parked"
    keys = (
        "id",
        "session_id",
        "event_seq",
        "target",
        "idempotency_key",
        "dispatched",
        "parked",
        "attempts",
        "last_error",
        "next_attempt_at",
        "dispatched_at",
        "claimed_by",
        "claim_until",
    )
    query = f"SELECT {', '.join(keys)} FROM agent_outbox {where} ORDER BY id DESC LIMIT %s"  # noqa: S608
    rows = conn.execute(query.encode(), (limit,)).fetchall()
    return [dict(zip(keys, r, strict=True)) for r in rows]


def requeue(conn: psycopg.Connection[Any], ids: Iterable[int]) -> list[int]:
    """Unpark rows (after fixing their target) so they are tried again at once; returns those
    requeued. A dispatched row, and one a dispatcher is calling now (a live claim), are left
    alone: clearing a live claim would let a second dispatcher call it at the same time."""
    cur = conn.execute(
        "UPDATE agent_outbox SET parked = false, attempts = 0, next_attempt_at = NULL, "
        "claimed_by = NULL, claim_until = NULL WHERE id = ANY(%s) AND NOT dispatched "
        "AND (claim_until IS NULL OR claim_until < now()) RETURNING id",
        (list(ids),),
    )
    return sorted(int(r[0]) for r in cur.fetchall())
