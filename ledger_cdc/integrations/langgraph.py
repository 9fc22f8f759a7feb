"""A LangGraph checkpoint saver on the ledger: every checkpoint and every pending write is one
append-only ledger event of the thread's session.

    from ledger_cdc.integrations.langgraph import LedgerSaver
    graph = builder.compile(checkpointer=LedgerSaver.from_dsn(dsn))

A thread is a ledger session (its id: ``uuid5(LANGGRAPH_NAMESPACE, thread_id)``), so a graph's
history is in the same log as the agent's other events, in commit order, replayable and
verifiable like them. Three standard event types (``ledger_cdc.events``: every reader knows them
without importing LangGraph; no reducer folds them):

- ``langgraph.checkpoint``: the checkpoint (serialised by the saver's ``serde``, channel values
  apart), its metadata, its parent, and the values of the channels whose version it bumps — of a
  list channel that only grew (a message list), just the items appended since its previous
  version, with a full value at least every 32 versions: storage grows with what changed;
- ``langgraph.writes``: one ``put_writes`` call (task id and path, each write with its index);
- ``langgraph.thread.deleted``: ``delete_thread`` — the ledger refuses UPDATE and DELETE, so the
  thread's earlier events are hidden from the saver, not erased (archive them with partitions).
  A delta stored after it may still name a hidden version as its base (a saver in another process
  went on from the checkpoint it stored, not knowing of the deletion): the base is read through
  the deletion, as its writer had it in hand; a hidden checkpoint or value is never answered.

Reads fold a thread's events in position order with LangGraph's own rules (as its in-memory
saver): the latest event for a checkpoint id wins; a channel's value is the one stored for the
version the checkpoint names; a regular write keeps its first value for a (task, index), a special
one (error, interrupt, …) its last; pending writes come in (task path, task id, index) order.
Sync and async methods share one implementation (SQL steps run by ``client.steps``).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import threading
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import msgspec
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    WRITES_IDX_MAP,
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    DeltaChannelHistory,
    PendingWrite,
    get_checkpoint_id,
    get_checkpoint_metadata,
)
from langgraph.checkpoint.serde.base import SerializerProtocol
from langgraph.checkpoint.serde.types import TASKS

from ledger_cdc.client.steps import Step, Steps, run, run_async
from ledger_cdc.client.writer import AsyncLedger, Ledger
from ledger_cdc.errors import ConfigError, InvalidEventError
from ledger_cdc.events import (
    READ_MAX_DEPTH,
    Blob,
    CheckpointSaved,
    CheckpointsHidden,
    ThreadDeleted,
    ToolInvoked,
    ToolObserved,
    Typed,
    Write,
    WritesPut,
    decode_bounded,
    register_event_type,
)
from ledger_cdc.integrations.langgraph_store import (
    _check_row_factory,
    _migrate_async,
    _PoolKwargs,
)

__all__ = ["LANGGRAPH_NAMESPACE", "AsyncLedgerSaver", "LedgerSaver", "thread_session"]

log = logging.getLogger(__name__)
LANGGRAPH_NAMESPACE = uuid.UUID("5f0e0c3a-8d1b-5a44-9a3e-6c6564676572")
AGENT = "langgraph"
_FULL_EVERY = 32  # a full value at least every this many versions of a list channel
_LAST_CHANNELS = 4096  # list channels whose last value a saver remembers (for deltas)
_MISSING = object()
_THREADS_KEPT = 256  # threads a saver keeps folded (a read fetches only their new events)


def thread_session(thread_id: str) -> uuid.UUID:
    """The ledger session of a LangGraph thread."""
    return uuid.uuid5(LANGGRAPH_NAMESPACE, str(thread_id))


_EVENTS: dict[str, type[msgspec.Struct]] = {
    "langgraph.checkpoint": CheckpointSaved,
    "langgraph.writes": WritesPut,
    "langgraph.thread.deleted": ThreadDeleted,
    "langgraph.checkpoints.hidden": CheckpointsHidden,
}
_decoders = {name: msgspec.json.Decoder(t) for name, t in _EVENTS.items()}

_THREAD = (
    "SELECT position, event_type, payload::text FROM agent_events "
    "WHERE session_id = %s AND position > %s AND event_type LIKE 'langgraph.%%' "
    "ORDER BY position"
)
_ALL = (
    "SELECT session_id, position, event_type, payload::text FROM agent_events "
    "WHERE event_type LIKE 'langgraph.%%' ORDER BY session_id, position"
)


def _unreadable(what: str, cp: CheckpointSaved, e: BaseException) -> InvalidEventError:
    return InvalidEventError(
        f"{what} of thread {cp.thread_id!r} cannot be read back: {type(e).__name__}: {str(e)[:200]}"
    )


@dataclass
class _Thread:
    """One thread as its events fold (events before its last deletion are skipped)."""

    thread_id: str = ""
    position: int = 0  # the last position folded (a saver keeps threads and reads only what is new)
    # (ns, checkpoint id) → the latest checkpoint event for it
    checkpoints: dict[tuple[str, str], CheckpointSaved] = field(default_factory=dict)
    blobs: dict[tuple[str, str, str], Blob] = field(default_factory=dict)  # ns, channel, version
    # the blobs a deletion hid: only ever the base of a delta stored after it
    hidden: dict[tuple[str, str, str], Blob] = field(default_factory=dict)
    # (ns, checkpoint id) → (task id, index) → (task path, channel, value)
    writes: dict[tuple[str, str], dict[tuple[str, int], tuple[str, str, Typed]]] = field(
        default_factory=dict
    )

    def fold(self, event_type: str, text: str) -> None:
        dec = _decoders.get(event_type)
        if dec is None:  # a type of a newer version: not this saver's to read
            return
        try:
            ev = decode_bounded(dec.decode, text, READ_MAX_DEPTH)
        # as every reader does: one bad row (one nested deeper than the consumer reads too)
        # is skipped
        except msgspec.DecodeError as e:
            log.warning(
                "thread %r: a %s event that does not fit, skipped: %s",
                self.thread_id,
                event_type,
                e,
            )
            return
        if isinstance(ev, ThreadDeleted):
            self.checkpoints.clear()
            self.hidden.update(self.blobs)
            self.blobs.clear()
            self.writes.clear()
        elif isinstance(ev, CheckpointSaved):
            self.thread_id = ev.thread_id
            self.checkpoints[(ev.ns, ev.checkpoint_id)] = ev
            for b in ev.blobs:
                self.blobs[(ev.ns, b.channel, b.version)] = b
        elif isinstance(ev, CheckpointsHidden):
            for ns, cid in ev.checkpoints:
                self.checkpoints.pop((ns, cid), None)
                self.writes.pop((ns, cid), None)
        elif isinstance(ev, WritesPut):
            self.thread_id = ev.thread_id
            table = self.writes.setdefault((ev.ns, ev.checkpoint_id), {})
            for w in ev.writes:
                key = (ev.task_id, w.idx)
                if w.idx >= 0 and key in table:
                    continue  # a regular write keeps its first value
                table[key] = (ev.task_path, w.channel, w.value)

    def base(self, key: tuple[str, str, str]) -> Blob | None:
        """The blob a delta names as its base: visible, or hidden by a deletion the delta's
        writer had not seen (it had the base's value in hand)."""
        return self.blobs.get(key) or self.hidden.get(key)

    def on_hidden(self, ns: str, blob: Blob) -> bool:
        """Whether a delta's chain of bases passes through a blob a deletion hid."""
        seen = 0
        while blob.base is not None and seen <= _FULL_EVERY:
            key = (ns, blob.channel, blob.base)
            if key not in self.blobs:
                return key in self.hidden
            blob, seen = self.blobs[key], seen + 1
        return False

    def fold_rows(self, rows: list[tuple[Any, ...]]) -> _Thread:
        for position, event_type, text in rows:
            if position > self.position:  # in order, once (two readers may fetch the same)
                self.fold(event_type, text)
                self.position = position
        return self


def _fold_rows(rows: list[tuple[Any, ...]]) -> _Thread:
    return _Thread().fold_rows(rows)


def _thread_steps(thread_id: str, after: int = 0) -> Steps[list[tuple[Any, ...]]]:
    """The thread's events after ``after``, in position order."""
    rows = yield Step(_THREAD, (thread_session(thread_id), after))
    return rows


def _all_steps() -> Steps[list[_Thread]]:
    rows = yield Step(_ALL, ())
    out: list[_Thread] = []
    current: Any = None
    part: list[tuple[Any, ...]] = []
    for sid, position, event_type, text in rows:
        if sid != current and part:
            out.append(_fold_rows(part))
            part = []
        current = sid
        part.append((position, event_type, text))
    if part:
        out.append(_fold_rows(part))
    return [t for t in out if t.thread_id]


def _hidden_for_runs(
    serde: SerializerProtocol, threads: list[_Thread], run_ids: Sequence[str]
) -> list[tuple[str, CheckpointsHidden]]:
    """Per thread, the checkpoints whose metadata ``run_id`` is one of ``run_ids``."""
    wanted = set(run_ids)
    out = []
    for t in threads:
        hide = [
            key
            for key, cp in t.checkpoints.items()
            if serde.loads_typed(cp.metadata.pair()).get("run_id") in wanted
        ]
        if hide:
            out.append((t.thread_id, CheckpointsHidden(t.thread_id, hide, "runs deleted")))
    return out


def _memo_of(conn: Any, sid: uuid.UUID, call_id: str) -> Any:
    """The completed call ``call_id`` of a session, if there is one (from its rebuilt context,
    or agent_memo past its snapshot)."""
    from ledger_cdc.client.recovery import memoised_tool, rebuild_context
    from ledger_cdc.errors import NoSuchSessionError

    try:
        ctx = rebuild_context(conn, sid)
    except NoSuchSessionError:
        return None
    return memoised_tool(conn, ctx, call_id)


class CallResult(msgspec.Struct, frozen=True):
    """A ``call_once`` result as JSON text, in the order the call returned its keys."""

    call_id: str
    text: str


register_event_type("langgraph.call.result", CallResult)
_RESULT = (
    "SELECT payload->>'text' FROM agent_events "
    "WHERE session_id = %s AND event_type = 'langgraph.call.result' "
    "AND payload->>'call_id' = %s ORDER BY position DESC LIMIT 1"
)


def _result_steps(sid: uuid.UUID, call_id: str) -> Steps[Any]:
    """The result ``call_once`` stored for ``call_id``, decoded from its text in order
    (``_MISSING`` when there is none)."""
    rows = yield Step(_RESULT, (sid, call_id))
    if not rows or rows[0][0] is None:
        return _MISSING
    return msgspec.json.decode(rows[0][0])


def _takes_key(call: Callable[..., Any]) -> bool:
    """Whether ``call`` accepts a keyword ``idempotency_key``."""
    try:
        params = inspect.signature(call).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: called as it is
        return False
    return any(
        (p.name == "idempotency_key" and p.kind != p.POSITIONAL_ONLY) or p.kind == p.VAR_KEYWORD
        for p in params
    )


_F = TypeVar("_F", bound=Callable[..., Any])


def _locked(method: _F) -> _F:
    """Run under the saver's lock: a read iterates threads folded in this saver, which another
    of the process's threads may be folding new events into."""

    @functools.wraps(method)
    def locked(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return cast(_F, locked)


def _ledgers(ledger: Any, aledger: Any) -> tuple[Ledger | None, AsyncLedger | None]:
    """What a saver was given, as writers: a Ledger or AsyncLedger, or a psycopg connection or
    pool of either kind (as langgraph-checkpoint-postgres's savers take them; autocommit, the
    default row factory), in either argument."""
    import psycopg
    from psycopg_pool import AsyncConnectionPool, ConnectionPool

    sync: Ledger | None = None
    aio: AsyncLedger | None = None
    for given in (ledger, aledger):
        if given is None:
            continue
        if isinstance(given, (psycopg.Connection, psycopg.AsyncConnection)):
            _check_row_factory(given)
        elif isinstance(given, (ConnectionPool, AsyncConnectionPool)):
            _check_row_factory(_PoolKwargs(given))
        if isinstance(given, Ledger):
            sync = given
        elif isinstance(given, psycopg.Connection):
            sync = Ledger(conn=given)
        elif isinstance(given, ConnectionPool):
            sync = Ledger(pool=given)
        elif isinstance(given, AsyncLedger):
            aio = given
        elif isinstance(given, psycopg.AsyncConnection):
            aio = AsyncLedger(given)
        elif isinstance(given, AsyncConnectionPool):
            aio = AsyncLedger(pool=given)
        else:
            raise ConfigError(
                f"a saver takes a Ledger, an AsyncLedger, or a psycopg connection or pool, "
                f"not {type(given).__name__}"
            )
    return sync, aio


def _configurable(config: RunnableConfig | None) -> dict[str, Any]:
    return dict((config or {}).get("configurable") or {})


class LedgerSaver(BaseCheckpointSaver[str]):
    """LangGraph's ``BaseCheckpointSaver`` on the ledger (see the module docstring).

    Give it a :class:`~ledger_cdc.Ledger` (sync methods) and/or an
    :class:`~ledger_cdc.AsyncLedger` (async methods), or a DSN (:meth:`from_dsn`: both, on
    pools of their own)."""

    def __init__(
        self,
        ledger: Ledger | AsyncLedger | Any = None,
        aledger: AsyncLedger | Any = None,
        *,
        serde: SerializerProtocol | None = None,
    ) -> None:
        super().__init__(serde=serde)
        self.ledger, self.aledger = _ledgers(ledger, aledger)
        self._dsn: str | None = None
        self._opening: asyncio.Lock | None = None
        self._threads: OrderedDict[str, _Thread] = OrderedDict()  # folded threads, by use
        self._lock = threading.Lock()
        # (thread, ns, channel) → (version, value, deltas since a full value) of list channels,
        # as stored by this saver's appends that committed
        self._last: OrderedDict[tuple[str, str, str], tuple[str, list[Any], int]] = OrderedDict()
        # (thread, ns, checkpoint id) → the channel versions of a checkpoint this saver stored:
        # a delta is written only against the version its parent names (stored, in its line)
        self._versions: OrderedDict[tuple[str, str, str], dict[str, str]] = OrderedDict()

    @classmethod
    def from_dsn(cls, dsn: str, *, serde: SerializerProtocol | None = None) -> LedgerSaver:
        """A saver on pools of its own (the async one opened on first use)."""
        saver = cls(Ledger(dsn), serde=serde)
        saver._dsn = dsn
        return saver

    @classmethod
    @contextmanager
    def from_conn_string(
        cls, conn_string: str, *, serde: SerializerProtocol | None = None
    ) -> Iterator[LedgerSaver]:
        """As langgraph-checkpoint-postgres's savers: ``with LedgerSaver.from_conn_string(dsn)
        as saver: ...`` (closed on the way out)."""
        saver = cls.from_dsn(conn_string, serde=serde)
        try:
            yield saver
        finally:
            saver.close()

    def setup(self) -> None:
        """Prepare the schema: the ledger's migrations (idempotent; ``ledger-cdc init`` does
        the same, with the publication and roles)."""
        from ledger_cdc.admin.schema import migrate

        with self._sync_ledger().connection() as conn:
            migrate(conn)

    async def _async_ledger(self) -> AsyncLedger:
        if self.aledger is None:
            if self._dsn is None:
                raise ConfigError(
                    "LedgerSaver needs an AsyncLedger for its async methods: "
                    "LedgerSaver(ledger, aledger) or LedgerSaver.from_dsn(dsn)"
                )
            if self._opening is None:
                self._opening = asyncio.Lock()
            async with self._opening:  # one pool, however many coroutines ask at once
                if self.aledger is None:
                    self.aledger = await AsyncLedger.connect(self._dsn)
        return self.aledger

    def _sync_ledger(self) -> Ledger:
        if self.ledger is None:
            raise ConfigError(
                "LedgerSaver needs a Ledger for its sync methods: LedgerSaver(ledger, aledger) "
                "or LedgerSaver.from_dsn(dsn)"
            )
        return self.ledger

    def close(self) -> None:
        if self.ledger is not None:
            self.ledger.close()

    async def aclose(self) -> None:
        if self.aledger is not None:
            await self.aledger.close()
        self.close()

    # -- versions -------------------------------------------------------------------------------

    def get_next_version(self, current: str | None, channel: None) -> str:
        """Versions compare as strings: a zero-padded counter and a random tie-break (LangGraph's
        own scheme, 21 characters instead of 49: every checkpoint names each channel's)."""
        if current is None:
            n = 0
        elif isinstance(current, int):
            n = current
        else:
            n = int(str(current).split(".")[0])
        return f"{n + 1:012}.{uuid.uuid4().int % 10**8:08}"

    # -- the events a write appends ---------------------------------------------------------------

    def _checkpoint_event(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> tuple[str, CheckpointSaved, RunnableConfig, Callable[[], None]]:
        """The event, the config to return, and what to remember once the append committed
        (remembered before, a put that failed and was retried wrote a delta against a version
        never stored)."""
        conf = _configurable(config)
        thread_id = str(conf["thread_id"])
        ns = str(conf.get("checkpoint_ns") or "")
        c: dict[str, Any] = dict(checkpoint)
        values: dict[str, Any] = c.pop("channel_values", None) or {}
        parent = conf.get("checkpoint_id")
        with self._lock:
            base = None if parent is None else self._versions.get((thread_id, ns, str(parent)))
        made = [
            (k, self._blob((thread_id, ns, k), str(v), values, base))
            for k, v in new_versions.items()
        ]
        blobs = [blob for _, (blob, _) in made]
        versions = {str(k): str(v) for k, v in (checkpoint.get("channel_versions") or {}).items()}

        def stored() -> None:
            with self._lock:
                for k, (_, last) in made:
                    key = (thread_id, ns, k)
                    if last is None:
                        self._last.pop(key, None)
                    else:
                        self._last[key] = last
                        self._last.move_to_end(key)
                self._versions[(thread_id, ns, str(checkpoint["id"]))] = versions
                for table in (self._last, self._versions):
                    while len(table) > _LAST_CHANNELS:
                        table.popitem(last=False)

        ev = CheckpointSaved(
            thread_id,
            ns,
            str(checkpoint["id"]),
            conf.get("checkpoint_id"),
            Typed.of(self.serde.dumps_typed(c)),
            Typed.of(self.serde.dumps_typed(get_checkpoint_metadata(config, metadata))),
            blobs,
        )
        out: RunnableConfig = {
            "configurable": {
                "thread_id": thread_id,
                "checkpoint_ns": ns,
                "checkpoint_id": checkpoint["id"],
            }
        }
        return thread_id, ev, out, stored

    def _writes_event(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str,
    ) -> tuple[str, WritesPut]:
        conf = _configurable(config)
        thread_id = str(conf["thread_id"])
        ev = WritesPut(
            thread_id,
            str(conf.get("checkpoint_ns") or ""),
            str(conf["checkpoint_id"]),
            task_id,
            task_path,
            [
                Write(WRITES_IDX_MAP.get(ch, i), ch, Typed.of(self.serde.dumps_typed(v)))
                for i, (ch, v) in enumerate(writes)
            ],
        )
        return thread_id, ev

    # -- reads ------------------------------------------------------------------------------------

    def _tuple(self, t: _Thread, ns: str, cp: CheckpointSaved) -> CheckpointTuple:
        """The checkpoint as LangGraph takes it; InvalidEventError if what the ledger holds for
        it cannot be read back (bad base64, a serde tag this version lacks, a wrong shape)."""
        try:
            return self._tuple_of(t, ns, cp)
        except Exception as e:  # whatever a serializer raises
            raise _unreadable(f"checkpoint {cp.checkpoint_id!r}", cp, e) from e

    def _metadata(self, cp: CheckpointSaved) -> dict[str, Any]:
        try:
            meta = self.serde.loads_typed(cp.metadata.pair())
        except Exception as e:  # whatever a serializer raises
            raise _unreadable(f"the metadata of checkpoint {cp.checkpoint_id!r}", cp, e) from e
        if not isinstance(meta, dict):
            raise InvalidEventError(
                f"the metadata of checkpoint {cp.checkpoint_id!r} is not a mapping"
            )
        return meta

    def _tuple_of(self, t: _Thread, ns: str, cp: CheckpointSaved) -> CheckpointTuple:
        checkpoint: Any = self.serde.loads_typed(cp.checkpoint.pair())
        values: dict[str, Any] = {}
        for ch, version in (checkpoint.get("channel_versions") or {}).items():
            value = self._value(t, ns, ch, str(version))
            if value is not _MISSING:
                values[ch] = value
        checkpoint["channel_values"] = values
        if checkpoint.get("v", 4) < 4 and cp.parent_id:
            self._migrate_sends(t, ns, cp.parent_id, checkpoint)
        writes = t.writes.get((ns, cp.checkpoint_id), {})
        ordered = sorted(writes.items(), key=lambda kv: (kv[1][0], kv[0][0], kv[0][1]))
        pending = [
            (task_id, ch, self.serde.loads_typed(value.pair()))
            for (task_id, _), (_, ch, value) in ordered
        ]
        parent: RunnableConfig | None = None
        if cp.parent_id:
            parent = {
                "configurable": {
                    "thread_id": cp.thread_id,
                    "checkpoint_ns": ns,
                    "checkpoint_id": cp.parent_id,
                }
            }
        return CheckpointTuple(
            config={
                "configurable": {
                    "thread_id": cp.thread_id,
                    "checkpoint_ns": ns,
                    "checkpoint_id": cp.checkpoint_id,
                }
            },
            checkpoint=checkpoint,
            metadata=self.serde.loads_typed(cp.metadata.pair()),
            parent_config=parent,
            pending_writes=pending,
        )

    def _migrate_sends(self, t: _Thread, ns: str, parent: str, checkpoint: Any) -> None:
        """A checkpoint LangGraph wrote before format 4 kept its pending sends as its parent's
        TASKS writes: they become its TASKS channel, as langgraph-checkpoint-postgres reads
        them (in task path, task id, index order)."""
        sends = sorted(
            ((path, task_id, idx), value)
            for (task_id, idx), (path, ch, value) in t.writes.get((ns, parent), {}).items()
            if ch == TASKS
        )
        if not sends:
            return
        checkpoint["channel_values"][TASKS] = [self.serde.loads_typed(v.pair()) for _, v in sends]
        versions = checkpoint.setdefault("channel_versions", {})
        versions[TASKS] = max(versions.values()) if versions else self.get_next_version(None, None)

    @_locked
    def _delta_history(
        self, t: _Thread, config: RunnableConfig, channels: Sequence[str]
    ) -> dict[str, DeltaChannelHistory]:
        """The writes to ``channels`` along the target's ancestors, oldest first, each channel
        back to the nearest ancestor that stores a value for it (its ``seed``; a stored None is
        no seed, as langgraph-checkpoint-postgres reads an inline None); one fold, no read per
        ancestor."""
        ns = str(_configurable(config).get("checkpoint_ns") or "")
        wanted = get_checkpoint_id(config)
        if wanted:
            target = t.checkpoints.get((ns, str(wanted)))
        else:
            ids = [cid for (n, cid) in t.checkpoints if n == ns]
            target = t.checkpoints[(ns, max(ids))] if ids else None
        collected: dict[str, list[PendingWrite]] = {ch: [] for ch in channels}
        seeds: dict[str, Any] = {}
        remaining = set(channels)
        cursor = None if target is None else target.parent_id
        seen: set[str] = set()
        while cursor is not None and remaining and cursor not in seen:
            seen.add(cursor)
            cp = t.checkpoints.get((ns, cursor))
            if cp is None:
                break
            writes = t.writes.get((ns, cursor), {})
            ordered = sorted(writes.items(), key=lambda kv: (kv[1][0], kv[0][0], kv[0][1]))
            for (task_id, _), (_, ch, value) in reversed(ordered):
                if ch in remaining:
                    collected[ch].append((task_id, ch, self.serde.loads_typed(value.pair())))
            versions = self.serde.loads_typed(cp.checkpoint.pair()).get("channel_versions") or {}
            for ch in list(remaining):
                if ch not in versions:
                    continue
                value = self._value(t, ns, ch, str(versions[ch]))
                if value is not _MISSING and value is not None:
                    seeds[ch] = value
                    remaining.discard(ch)
            cursor = cp.parent_id
        out: dict[str, DeltaChannelHistory] = {}
        for ch in channels:
            entry: DeltaChannelHistory = {"writes": list(reversed(collected[ch]))}
            if ch in seeds:
                entry["seed"] = seeds[ch]
            out[ch] = entry
        return out

    def _value(self, t: _Thread, ns: str, channel: str, version: str) -> Any:
        """A channel's value at a version: a full value, or a base's value and what was appended
        to it since (a chain no longer than _FULL_EVERY)."""
        chain: list[Blob] = []
        v: str | None = version
        while v is not None:
            # the version a checkpoint names is a visible one; a base may be hidden
            blob = t.base((ns, channel, v)) if chain else t.blobs.get((ns, channel, v))
            if blob is None or len(chain) > _FULL_EVERY:
                return _MISSING
            chain.append(blob)
            v = blob.base
        if chain[-1].value.type == "empty":
            return _MISSING
        value = self.serde.loads_typed(chain[-1].value.pair())
        for blob in reversed(chain[:-1]):
            added = self.serde.loads_typed(blob.value.pair())
            if not (isinstance(value, (list, tuple)) and isinstance(added, (list, tuple))):
                raise InvalidEventError(  # this saver appends to lists only
                    f"channel {channel!r} version {blob.version!r} appends to a value that is "
                    "not a list"
                )
            value = list(value) + list(added)
        return value

    def _whole(self, t: _Thread, ns: str, blob: Blob) -> Blob:
        """A delta's blob as its full value (left as it is if that cannot be read back)."""
        try:
            value = self._value(t, ns, blob.channel, blob.version)
        except Exception as e:  # whatever a serializer raises: copied as it is
            log.warning("channel %r version %r copied as it is: %s", blob.channel, blob.version, e)
            return blob
        if value is _MISSING:
            return blob
        return Blob(blob.channel, blob.version, Typed.of(self.serde.dumps_typed(value)))

    def _blob(
        self,
        key: tuple[str, str, str],
        version: str,
        values: dict[str, Any],
        base: dict[str, str] | None,
    ) -> tuple[Blob, tuple[str, list[Any], int] | None]:
        """The blob of a new version of a channel (thread, ns, channel) — the items appended
        since the version the parent checkpoint names, when this saver stored that one and the
        channel is a list that only grew — and what to remember of it once stored."""
        channel = key[2]
        if channel not in values:
            return Blob(channel, version, Typed.of(("empty", b""))), None
        value = values[channel]
        with self._lock:
            prev = self._last.get(key)
        if (
            prev is not None
            and base is not None
            and base.get(channel) == prev[0]
            and isinstance(value, list)
            and prev[2] < _FULL_EVERY
            and len(value) >= len(prev[1])
            and value[: len(prev[1])] == prev[1]
        ):
            tail = value[len(prev[1]) :]
            blob = Blob(channel, version, Typed.of(self.serde.dumps_typed(tail)), prev[0])
            return blob, (version, list(value), prev[2] + 1)
        blob = Blob(channel, version, Typed.of(self.serde.dumps_typed(value)))
        return blob, ((version, list(value), 0) if isinstance(value, list) else None)

    def _forget(self, thread_id: str) -> None:
        with self._lock:
            for table in (self._last, self._versions):
                for key in [k for k in table if k[0] == thread_id]:
                    del table[key]

    @_locked
    def _get(self, t: _Thread, config: RunnableConfig) -> CheckpointTuple | None:
        conf = _configurable(config)
        ns = str(conf.get("checkpoint_ns") or "")
        wanted = get_checkpoint_id(config)
        if wanted:
            cp = t.checkpoints.get((ns, str(wanted)))
        else:
            ids = [cid for (n, cid) in t.checkpoints if n == ns]
            cp = t.checkpoints[(ns, max(ids))] if ids else None
        return None if cp is None else self._tuple(t, ns, cp)

    @_locked
    def _list(
        self,
        threads: list[_Thread],
        config: RunnableConfig | None,
        filter: dict[str, Any] | None,
        before: RunnableConfig | None,
        limit: int | None,
    ) -> list[CheckpointTuple]:
        conf = _configurable(config)
        ns_wanted = conf.get("checkpoint_ns")
        id_wanted = get_checkpoint_id(config) if config else None
        before_id = get_checkpoint_id(before) if before else None
        out: list[CheckpointTuple] = []
        if limit is not None and limit <= 0:  # none, as LangGraph's in-memory saver
            return out
        for t in threads:
            namespaces = sorted({n for n, _ in t.checkpoints})
            for ns in namespaces:
                if ns_wanted is not None and ns != ns_wanted:
                    continue
                ids = sorted((cid for n, cid in t.checkpoints if n == ns), reverse=True)
                for cid in ids:
                    if id_wanted and cid != id_wanted:
                        continue
                    if before_id and not cid < before_id:
                        continue
                    cp = t.checkpoints[(ns, cid)]
                    try:
                        if filter:
                            meta = self._metadata(cp)
                            if not all(meta.get(k) == v for k, v in filter.items()):
                                continue
                        found = self._tuple(t, ns, cp)
                    except InvalidEventError as e:  # one unreadable checkpoint: not the list
                        log.warning("list: %s; skipped", e)
                        continue
                    out.append(found)
                    if limit is not None and len(out) >= limit:
                        return out
        return out

    def _threads_steps(self, config: RunnableConfig | None) -> Steps[list[_Thread]]:
        thread_id = _configurable(config).get("thread_id")
        if thread_id is None:
            return (yield from _all_steps())
        cached = self._cached(str(thread_id))
        rows = yield from _thread_steps(str(thread_id), cached.position)
        t = self._folded(str(thread_id), cached, rows)
        return [t] if t.thread_id else []

    def _cached(self, thread_id: str) -> _Thread:
        with self._lock:
            t = self._threads.get(thread_id)
            if t is None:
                t = self._threads[thread_id] = _Thread()
                while len(self._threads) > _THREADS_KEPT:
                    self._threads.popitem(last=False)
            self._threads.move_to_end(thread_id)
            return t

    def _folded(self, thread_id: str, t: _Thread, rows: list[tuple[Any, ...]]) -> _Thread:
        if any(r[1] == "langgraph.thread.deleted" for r in rows):  # by another saver, maybe
            self._forget(thread_id)
        with self._lock:
            return t.fold_rows(rows)

    def _thread_read(self, thread_id: str) -> Steps[_Thread]:
        """One thread, brought up to date: only the events after what this saver folded."""
        cached = self._cached(thread_id)
        rows = yield from _thread_steps(thread_id, cached.position)
        return self._folded(thread_id, cached, rows)

    # -- sync -----------------------------------------------------------------------------------

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        thread_id = str(_configurable(config)["thread_id"])
        with self._sync_ledger().connection() as conn:
            t = run(conn, self._thread_read(thread_id))
        return self._get(t, config)

    def get_delta_channel_history(
        self, *, config: RunnableConfig, channels: Sequence[str]
    ) -> Mapping[str, DeltaChannelHistory]:
        if not channels:
            return {}
        thread_id = str(_configurable(config)["thread_id"])
        with self._sync_ledger().connection() as conn:
            t = run(conn, self._thread_read(thread_id))
        return self._delta_history(t, config, channels)

    async def aget_delta_channel_history(
        self, *, config: RunnableConfig, channels: Sequence[str]
    ) -> Mapping[str, DeltaChannelHistory]:
        if not channels:
            return {}
        thread_id = str(_configurable(config)["thread_id"])
        ledger = await self._async_ledger()
        async with ledger.connection() as conn:
            t = await run_async(conn, self._thread_read(thread_id))
        return self._delta_history(t, config, channels)

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> Iterator[CheckpointTuple]:
        with self._sync_ledger().connection() as conn:
            threads = run(conn, self._threads_steps(config))
        yield from self._list(threads, config, filter, before, limit)

    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        thread_id, ev, out, stored = self._checkpoint_event(
            config, checkpoint, metadata, new_versions
        )
        self._sync_ledger().append(thread_session(thread_id), AGENT, "langgraph.checkpoint", ev)
        stored()
        return out

    def put_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        thread_id, ev = self._writes_event(config, writes, task_id, task_path)
        self._sync_ledger().append(thread_session(thread_id), AGENT, "langgraph.writes", ev)

    def delete_thread(self, thread_id: str) -> None:
        self._forget(str(thread_id))
        self._sync_ledger().append(
            thread_session(thread_id),
            AGENT,
            "langgraph.thread.deleted",
            ThreadDeleted(str(thread_id)),
        )

    def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Hide the checkpoints (and their writes) whose metadata ``run_id`` is one of these."""
        with self._sync_ledger().connection() as conn:
            threads = run(conn, _all_steps())
        for thread_id, ev in _hidden_for_runs(self.serde, threads, run_ids):
            self._sync_ledger().append(
                thread_session(thread_id), AGENT, "langgraph.checkpoints.hidden", ev
            )

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Every visible checkpoint and write of one thread, appended again to another (the
        source is untouched)."""
        with self._sync_ledger().connection() as conn:
            t = run(conn, self._thread_read(str(source_thread_id)))
        with self._lock:  # ``t`` is shared with this saver's other threads
            copied = _copied(t, str(target_thread_id), functools.partial(self._whole, t))
        for event_type, ev in copied:
            self._sync_ledger().append(thread_session(target_thread_id), AGENT, event_type, ev)

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """``keep_latest``: hide all but the latest checkpoint of each namespace; ``delete``:
        as :meth:`delete_thread`. An append either way; erase with partitions (archive)."""
        for thread_id in thread_ids:
            if strategy == "delete":
                self.delete_thread(thread_id)
                continue
            with self._sync_ledger().connection() as conn:
                t = run(conn, self._thread_read(str(thread_id)))
            with self._lock:
                ev = _pruned(t, strategy)
            if ev is not None:
                self._sync_ledger().append(
                    thread_session(thread_id), AGENT, "langgraph.checkpoints.hidden", ev
                )

    # -- external calls at most once ------------------------------------------------------------

    def call_once(
        self,
        config: RunnableConfig,
        call_id: str,
        tool: str,
        call: Callable[..., Any],
        *,
        arguments: dict[str, Any] | None = None,
    ) -> Any:
        """Run a node's external call (a payment, an email, a paid model) at most once per
        thread and ``call_id``, whatever happens to the worker.

        LangGraph re-runs a node whose writes were not saved: a worker killed after the call
        but before the graph moved on calls again on resume. Here the call is recorded in the
        thread's session as the ledger's own ``tool.invoked`` / ``tool.observed`` (idempotency
        key ``<thread>:<call_id>``); once observed, a re-run answers from the ledger. The
        result must be JSON; it comes back as the call returned it, object keys in their order
        (the result's JSON text is kept beside ``tool.observed``, in a ``langgraph.call.result``
        event of the same transaction: jsonb alone would reorder them). A call invoked but never
        observed (the worker died during it) is called again with the same key: a ``call`` that
        takes a keyword ``idempotency_key`` (or ``**kwargs``) is given it, to pass to the
        service; one that takes no argument is called as it is."""
        thread_id = str(_configurable(config)["thread_id"])
        sid = thread_session(thread_id)
        ledger = self._sync_ledger()
        with ledger.connection() as conn:
            done = run(conn, _result_steps(sid, call_id))
            if done is _MISSING:
                memo = _memo_of(conn, sid, call_id)
                done = _MISSING if memo is None else memo.result
        if done is not _MISSING:
            return done
        key = f"{thread_id}:{call_id}"
        ledger.append(sid, AGENT, "tool.invoked", ToolInvoked(call_id, tool, arguments or {}, key))
        result = call(idempotency_key=key) if _takes_key(call) else call()
        with ledger.transaction() as tx:
            tx.append(sid, AGENT, "tool.observed", ToolObserved(call_id, result))  # (checks it)
            text = msgspec.json.encode(result).decode()
            tx.append(sid, AGENT, "langgraph.call.result", CallResult(call_id, text))
        return result

    # -- async ----------------------------------------------------------------------------------

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        thread_id = str(_configurable(config)["thread_id"])
        ledger = await self._async_ledger()
        async with ledger.connection() as conn:
            t = await run_async(conn, self._thread_read(thread_id))
        return self._get(t, config)

    async def alist(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[CheckpointTuple]:
        ledger = await self._async_ledger()
        async with ledger.connection() as conn:
            threads = await run_async(conn, self._threads_steps(config))
        for item in self._list(threads, config, filter, before, limit):
            yield item

    async def aput(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        thread_id, ev, out, stored = self._checkpoint_event(
            config, checkpoint, metadata, new_versions
        )
        ledger = await self._async_ledger()
        await ledger.append(thread_session(thread_id), AGENT, "langgraph.checkpoint", ev)
        stored()
        return out

    async def aput_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        thread_id, ev = self._writes_event(config, writes, task_id, task_path)
        ledger = await self._async_ledger()
        await ledger.append(thread_session(thread_id), AGENT, "langgraph.writes", ev)

    async def adelete_thread(self, thread_id: str) -> None:
        self._forget(str(thread_id))
        ledger = await self._async_ledger()
        await ledger.append(
            thread_session(thread_id),
            AGENT,
            "langgraph.thread.deleted",
            ThreadDeleted(str(thread_id)),
        )

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        ledger = await self._async_ledger()
        async with ledger.connection() as conn:
            threads = await run_async(conn, _all_steps())
        for thread_id, ev in _hidden_for_runs(self.serde, threads, run_ids):
            await ledger.append(
                thread_session(thread_id), AGENT, "langgraph.checkpoints.hidden", ev
            )

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        ledger = await self._async_ledger()
        async with ledger.connection() as conn:
            t = await run_async(conn, self._thread_read(str(source_thread_id)))
        with self._lock:  # ``t`` is shared with this saver's other threads
            copied = _copied(t, str(target_thread_id), functools.partial(self._whole, t))
        for event_type, ev in copied:
            await ledger.append(thread_session(target_thread_id), AGENT, event_type, ev)

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        ledger = await self._async_ledger()
        for thread_id in thread_ids:
            if strategy == "delete":
                await self.adelete_thread(thread_id)
                continue
            async with ledger.connection() as conn:
                t = await run_async(conn, self._thread_read(str(thread_id)))
            with self._lock:
                ev = _pruned(t, strategy)
            if ev is not None:
                await ledger.append(
                    thread_session(thread_id), AGENT, "langgraph.checkpoints.hidden", ev
                )


class AsyncLedgerSaver(LedgerSaver):
    """The same saver, built for async code: ``async with AsyncLedgerSaver.from_conn_string(dsn)
    as saver`` (an :class:`~ledger_cdc.AsyncLedger` pool; its sync methods are not used)."""

    @classmethod
    @asynccontextmanager
    async def from_conn_string(  # type: ignore[override]
        cls, conn_string: str, *, serde: SerializerProtocol | None = None
    ) -> AsyncIterator[AsyncLedgerSaver]:
        saver = cls(None, await AsyncLedger.connect(conn_string), serde=serde)
        try:
            yield saver
        finally:
            await saver.aclose()

    async def setup(self) -> None:  # type: ignore[override]
        """Prepare the schema (the ledger's migrations, idempotent), whatever the saver was
        made from (a DSN, a connection, a pool)."""
        ledger = await self._async_ledger()
        async with ledger.connection() as conn:
            await _migrate_async(conn, ledger)


def _copied(t: _Thread, target: str, whole: Callable[[str, Blob], Blob]) -> list[tuple[str, Any]]:
    """The events that give ``target`` the visible checkpoints and writes of ``t``; a delta on a
    base a deletion hid is copied whole (by ``whole``): the target holds no hidden values."""
    out: list[tuple[str, Any]] = []
    blobs_sent: set[str] = set()
    for (ns, cid), cp in sorted(t.checkpoints.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        versions_blobs = []
        if ns not in blobs_sent:  # a namespace's values travel once, with its first checkpoint
            blobs_sent.add(ns)
            versions_blobs = [
                whole(ns, b) if t.on_hidden(ns, b) else b
                for (bns, _, _), b in t.blobs.items()
                if bns == ns
            ]
        out.append(
            (
                "langgraph.checkpoint",
                CheckpointSaved(
                    target, ns, cid, cp.parent_id, cp.checkpoint, cp.metadata, versions_blobs
                ),
            )
        )
        by_task: dict[tuple[str, str], list[Write]] = {}
        for (task_id, idx), (path, ch, value) in t.writes.get((ns, cid), {}).items():
            by_task.setdefault((task_id, path), []).append(Write(idx, ch, value))
        for (task_id, path), writes in by_task.items():
            out.append(("langgraph.writes", WritesPut(target, ns, cid, task_id, path, writes)))
    return out


def _pruned(t: _Thread, strategy: str) -> CheckpointsHidden | None:
    if strategy != "keep_latest":
        raise ConfigError(f"unknown prune strategy {strategy!r} (keep_latest or delete)")
    latest: dict[str, str] = {}
    for ns, cid in t.checkpoints:
        if cid > latest.get(ns, ""):
            latest[ns] = cid
    hide = [(ns, cid) for ns, cid in t.checkpoints if cid != latest[ns]]
    return CheckpointsHidden(t.thread_id, hide, "pruned") if hide else None
