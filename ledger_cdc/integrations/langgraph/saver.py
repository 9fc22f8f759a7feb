"""``LedgerSaver``: LangGraph's ``BaseCheckpointSaver`` on the ledger, its sync and async
methods over one implementation (reads in ``reading``, the events a write appends in
``writing``, what both share in ``core``; see the package docstring)."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    DeltaChannelHistory,
)
from langgraph.checkpoint.serde.base import SerializerProtocol

from ledger_cdc.client.steps import run, run_async
from ledger_cdc.client.writer import AsyncLedger
from ledger_cdc.events import ThreadDeleted
from ledger_cdc.integrations.langgraph.calls import CallOnce
from ledger_cdc.integrations.langgraph.core import configurable
from ledger_cdc.integrations.langgraph.reading import Reading
from ledger_cdc.integrations.langgraph.thread import (
    AGENT,
    all_steps,
    copied,
    hidden_for_runs,
    pruned,
    thread_session,
)
from ledger_cdc.integrations.langgraph.writing import Writing
from ledger_cdc.integrations.langgraph_store import _migrate_async


class LedgerSaver(Reading, Writing, CallOnce):
    """LangGraph's ``BaseCheckpointSaver`` on the ledger (see the package docstring).

    Give it a :class:`~ledger_cdc.Ledger` (sync methods) and/or an
    :class:`~ledger_cdc.AsyncLedger` (async methods), or a DSN (:meth:`from_dsn`: both, on
    pools of their own)."""

    # -- sync -----------------------------------------------------------------------------------

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        with self._sync_ledger().connection() as conn:
            t = run(conn, self._tuple_read(config))
        return self._get(t, config)

    def get_delta_channel_history(
        self, *, config: RunnableConfig, channels: Sequence[str]
    ) -> Mapping[str, DeltaChannelHistory]:
        if not channels:
            return {}
        thread_id = str(configurable(config)["thread_id"])
        with self._sync_ledger().connection() as conn:
            t = run(conn, self._thread_read(thread_id))
        return self._delta_history(t, config, channels)

    async def aget_delta_channel_history(
        self, *, config: RunnableConfig, channels: Sequence[str]
    ) -> Mapping[str, DeltaChannelHistory]:
        if not channels:
            return {}
        thread_id = str(configurable(config)["thread_id"])
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
            threads = run(conn, all_steps())
        for thread_id, ev in hidden_for_runs(self.serde, threads, run_ids):
            self._sync_ledger().append(
                thread_session(thread_id), AGENT, "langgraph.checkpoints.hidden", ev
            )

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Every visible checkpoint and write of one thread, appended again to another (the
        source is untouched)."""
        with self._sync_ledger().connection() as conn:
            t = run(conn, self._thread_read(str(source_thread_id)))
        with self._lock:  # ``t`` is shared with this saver's other threads
            events = copied(t, str(target_thread_id), functools.partial(self._whole, t))
        for event_type, ev in events:
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
                ev = pruned(t, strategy)
            if ev is not None:
                self._sync_ledger().append(
                    thread_session(thread_id), AGENT, "langgraph.checkpoints.hidden", ev
                )

    # -- async ----------------------------------------------------------------------------------

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        ledger = await self._async_ledger()
        async with ledger.connection() as conn:
            t = await run_async(conn, self._tuple_read(config))
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
            threads = await run_async(conn, all_steps())
        for thread_id, ev in hidden_for_runs(self.serde, threads, run_ids):
            await ledger.append(
                thread_session(thread_id), AGENT, "langgraph.checkpoints.hidden", ev
            )

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        ledger = await self._async_ledger()
        async with ledger.connection() as conn:
            t = await run_async(conn, self._thread_read(str(source_thread_id)))
        with self._lock:  # ``t`` is shared with this saver's other threads
            events = copied(t, str(target_thread_id), functools.partial(self._whole, t))
        for event_type, ev in events:
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
                ev = pruned(t, strategy)
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
