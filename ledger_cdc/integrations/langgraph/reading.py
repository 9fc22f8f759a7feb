"""Reading checkpoints back: a folded thread (or the recent events of one checkpoint) made into
LangGraph's ``CheckpointTuple``, a channel's value rebuilt from its full value and the deltas
appended since, the writes along a checkpoint's ancestors, and listing."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    CheckpointTuple,
    DeltaChannelHistory,
    PendingWrite,
    get_checkpoint_id,
)
from langgraph.checkpoint.serde.types import TASKS

from ledger_cdc.errors import InvalidEventError
from ledger_cdc.events import Blob, CheckpointSaved, Typed
from ledger_cdc.integrations.langgraph.core import SaverCore, configurable, locked
from ledger_cdc.integrations.langgraph.thread import MISSING, Thread, log


def _unreadable(what: str, cp: CheckpointSaved, e: BaseException) -> InvalidEventError:
    return InvalidEventError(
        f"{what} of thread {cp.thread_id!r} cannot be read back: {type(e).__name__}: {str(e)[:200]}"
    )


def _target(t: Thread, ns: str, config: RunnableConfig) -> CheckpointSaved | None:
    """The checkpoint a config names, or the namespace's latest (the greatest id)."""
    wanted = get_checkpoint_id(config)
    if wanted:
        return t.checkpoints.get((ns, str(wanted)))
    ids = [cid for (n, cid) in t.checkpoints if n == ns]
    return t.checkpoints[(ns, max(ids))] if ids else None


class Reading(SaverCore):
    """A saver's reads, on threads as they fold."""

    def _tuple(self, t: Thread, ns: str, cp: CheckpointSaved) -> CheckpointTuple:
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

    def _tuple_of(self, t: Thread, ns: str, cp: CheckpointSaved) -> CheckpointTuple:
        checkpoint: Any = self.serde.loads_typed(cp.checkpoint.pair())
        values: dict[str, Any] = {}
        for ch, version in (checkpoint.get("channel_versions") or {}).items():
            value = self._value(t, ns, ch, str(version))
            if value is not MISSING:
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

    def _migrate_sends(self, t: Thread, ns: str, parent: str, checkpoint: Any) -> None:
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

    @locked
    def _delta_history(
        self, t: Thread, config: RunnableConfig, channels: Sequence[str]
    ) -> dict[str, DeltaChannelHistory]:
        """The writes to ``channels`` along the target's ancestors, oldest first, each channel
        back to the nearest ancestor that stores a value for it (its ``seed``; a stored None is
        no seed, as langgraph-checkpoint-postgres reads an inline None); one fold, no read per
        ancestor."""
        ns = str(configurable(config).get("checkpoint_ns") or "")
        target = _target(t, ns, config)
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
                if value is not MISSING and value is not None:
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

    def _value(self, t: Thread, ns: str, channel: str, version: str) -> Any:
        """A channel's value at a version: a full value, or a base's value and what was appended
        to it since."""
        chain = t.chain(ns, channel, version)
        if chain is None or chain[-1].value.type == "empty":
            return MISSING
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

    def _whole(self, t: Thread, ns: str, blob: Blob) -> Blob:
        """A delta's blob as its full value (left as it is if that cannot be read back)."""
        try:
            value = self._value(t, ns, blob.channel, blob.version)
        except Exception as e:  # whatever a serializer raises: copied as it is
            log.warning("channel %r version %r copied as it is: %s", blob.channel, blob.version, e)
            return blob
        if value is MISSING:
            return blob
        return Blob(blob.channel, blob.version, Typed.packed(self.serde.dumps_typed(value)))

    @locked
    def _get(self, t: Thread, config: RunnableConfig) -> CheckpointTuple | None:
        ns = str(configurable(config).get("checkpoint_ns") or "")
        cp = _target(t, ns, config)
        return None if cp is None else self._tuple(t, ns, cp)

    @locked
    def _list(
        self,
        threads: list[Thread],
        config: RunnableConfig | None,
        filter: dict[str, Any] | None,
        before: RunnableConfig | None,
        limit: int | None,
    ) -> list[CheckpointTuple]:
        conf = configurable(config)
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
