"""The events a write appends: a checkpoint with the values of the channels it bumps (of a list
that only grew, the items appended since its previous version), and a task's pending writes.
Every ``FULL_EVERY`` checkpoints of a namespace (and the first a saver stores there), a
checkpoint carries every channel's full value, so a read of any checkpoint finds its values
among the recent events (``recent``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    WRITES_IDX_MAP,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    get_checkpoint_metadata,
)

from ledger_cdc.events import Blob, CheckpointSaved, Typed, Write, WritesPut
from ledger_cdc.integrations.langgraph.core import SaverCore, configurable
from ledger_cdc.integrations.langgraph.thread import FULL_EVERY

_LAST_CHANNELS = 4096  # list channels whose last value a saver remembers (for deltas)


class Writing(SaverCore):
    """A saver's writes, as the events they append."""

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
        conf = configurable(config)
        thread_id = str(conf["thread_id"])
        ns = str(conf.get("checkpoint_ns") or "")
        c: dict[str, Any] = dict(checkpoint)
        values: dict[str, Any] = c.pop("channel_values", None) or {}
        versions = {str(k): str(v) for k, v in (checkpoint.get("channel_versions") or {}).items()}
        parent = conf.get("checkpoint_id")
        with self._lock:
            base = None if parent is None else self._versions.get((thread_id, ns, str(parent)))
            since = self._since_full.get((thread_id, ns))
        full = since is None or since + 1 >= FULL_EVERY  # every channel, each value whole
        bumped = {str(k): str(v) for k, v in new_versions.items()}
        made = [
            (k, self._blob((thread_id, ns, k), v, values, None if full else base))
            for k, v in ({**versions, **bumped} if full else bumped).items()
        ]
        blobs = [blob for _, (blob, _) in made]

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
                self._since_full[(thread_id, ns)] = 0 if since is None or full else since + 1
                self._since_full.move_to_end((thread_id, ns))
                for table in (self._last, self._versions, self._since_full):
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
        conf = configurable(config)
        thread_id = str(conf["thread_id"])
        ev = WritesPut(
            thread_id,
            str(conf.get("checkpoint_ns") or ""),
            str(conf["checkpoint_id"]),
            task_id,
            task_path,
            [
                Write(WRITES_IDX_MAP.get(ch, i), ch, Typed.packed(self.serde.dumps_typed(v)))
                for i, (ch, v) in enumerate(writes)
            ],
        )
        return thread_id, ev

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
            and prev[2] < FULL_EVERY
            and len(value) >= len(prev[1])
            and value[: len(prev[1])] == prev[1]
        ):
            tail = value[len(prev[1]) :]
            blob = Blob(channel, version, Typed.packed(self.serde.dumps_typed(tail)), prev[0])
            return blob, (version, list(value), prev[2] + 1)
        blob = Blob(channel, version, Typed.packed(self.serde.dumps_typed(value)))
        return blob, ((version, list(value), 0) if isinstance(value, list) else None)
