"""What the saver's sync and async methods share: the writers it was given (or opened from a
DSN), the threads it keeps folded, and the SQL steps of its reads, which ``client.steps`` runs
on either kind of connection."""

from __future__ import annotations

import asyncio
import functools
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Self, TypeVar, cast

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import BaseCheckpointSaver, get_checkpoint_id
from langgraph.checkpoint.serde.base import SerializerProtocol

from ledger_cdc.client.steps import Steps
from ledger_cdc.client.writer import AsyncLedger, Ledger
from ledger_cdc.errors import ConfigError
from ledger_cdc.integrations.langgraph.recent import newer_steps, recent_steps
from ledger_cdc.integrations.langgraph.thread import Thread, all_steps, thread_steps
from ledger_cdc.integrations.langgraph_store import _check_row_factory, _PoolKwargs

_THREADS_KEPT = 256  # threads a saver keeps folded (a read fetches only their new events)

_F = TypeVar("_F", bound=Callable[..., Any])


def locked(method: _F) -> _F:
    """Run under the saver's lock: a read iterates threads folded in this saver, which another
    of the process's threads may be folding new events into."""

    @functools.wraps(method)
    def run_locked(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return cast(_F, run_locked)


def configurable(config: RunnableConfig | None) -> dict[str, Any]:
    return dict((config or {}).get("configurable") or {})


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


class SaverCore(BaseCheckpointSaver[str]):
    """The writers, the folded threads and the caches of list values a saver keeps."""

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
        self._threads: OrderedDict[str, Thread] = OrderedDict()  # folded threads, by use
        self._lock = threading.Lock()
        # (thread, ns, channel) → (version, value, deltas since a full value) of list channels,
        # as stored by this saver's appends that committed
        self._last: OrderedDict[tuple[str, str, str], tuple[str, list[Any], int]] = OrderedDict()
        # (thread, ns, checkpoint id) → the channel versions of a checkpoint this saver stored:
        # a delta is written only against the version its parent names (stored, in its line)
        self._versions: OrderedDict[tuple[str, str, str], dict[str, str]] = OrderedDict()
        # (thread, ns) → checkpoints this saver stored since one with every channel's full value
        self._since_full: OrderedDict[tuple[str, str], int] = OrderedDict()
        # (thread, ns, checkpoint id asked for) → (the thread's last LangGraph event then, what
        # the checkpoint's recent events gave) of threads it does not keep folded
        self._recent: OrderedDict[tuple[str, str, str | None], tuple[int, Thread]] = OrderedDict()

    @classmethod
    def from_dsn(cls, dsn: str, *, serde: SerializerProtocol | None = None) -> Self:
        """A saver on pools of its own (the async one opened on first use)."""
        saver = cls(Ledger(dsn), serde=serde)
        saver._dsn = dsn
        return saver

    @classmethod
    @contextmanager
    def from_conn_string(
        cls, conn_string: str, *, serde: SerializerProtocol | None = None
    ) -> Iterator[Self]:
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

    # -- reads ----------------------------------------------------------------------------------

    def _forget(self, thread_id: str) -> None:
        with self._lock:
            tables: list[OrderedDict[Any, Any]] = [self._last, self._versions, self._since_full]
            tables.append(self._recent)
            for table in tables:
                for key in [k for k in table if k[0] == thread_id]:
                    del table[key]

    def _cached(self, thread_id: str) -> Thread:
        with self._lock:
            t = self._threads.get(thread_id)
            if t is None:
                t = self._threads[thread_id] = Thread()
                while len(self._threads) > _THREADS_KEPT:
                    self._threads.popitem(last=False)
            self._threads.move_to_end(thread_id)
            return t

    def _folded(self, thread_id: str, t: Thread, rows: list[tuple[Any, ...]]) -> Thread:
        if any(r[1] == "langgraph.thread.deleted" for r in rows):  # by another saver, maybe
            self._forget(thread_id)
        with self._lock:
            return t.fold_rows(rows)

    def _thread_read(self, thread_id: str) -> Steps[Thread]:
        """One thread, brought up to date: only the events after what this saver folded."""
        cached = self._cached(thread_id)
        rows = yield from thread_steps(thread_id, cached.position)
        return self._folded(thread_id, cached, rows)

    def _tuple_read(self, config: RunnableConfig) -> Steps[Thread]:
        """What a read of one checkpoint needs: the thread brought up to date when this saver
        keeps it folded; else only the checkpoint's recent events (kept while no LangGraph event
        follows them: the ledger is append-only), or the whole thread when they do not answer
        for it."""
        conf = configurable(config)
        thread_id = str(conf["thread_id"])
        wanted = get_checkpoint_id(config)
        key = (thread_id, str(conf.get("checkpoint_ns") or ""), str(wanted) if wanted else None)
        with self._lock:
            kept = thread_id in self._threads
            seen = self._recent.get(key)
        if not kept:
            if seen is not None and not (yield from newer_steps(thread_id, seen[0])):
                return seen[1]
            recent, head = yield from recent_steps(self.serde, *key)
            if recent is not None:
                with self._lock:
                    self._recent[key] = (head, recent)
                    self._recent.move_to_end(key)
                    while len(self._recent) > _THREADS_KEPT:
                        self._recent.popitem(last=False)
                return recent
        return (yield from self._thread_read(thread_id))

    def _threads_steps(self, config: RunnableConfig | None) -> Steps[list[Thread]]:
        thread_id = configurable(config).get("thread_id")
        if thread_id is None:
            return (yield from all_steps())
        t = yield from self._thread_read(str(thread_id))
        return [t] if t.thread_id else []
