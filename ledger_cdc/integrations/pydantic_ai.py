"""The Pydantic AI harness's ``StepStore`` on the ledger: run records, step events, snapshots
and tool effects as append-only events of the run's session.

    from ledger_cdc.integrations.pydantic_ai import LedgerStepStore
    store = LedgerStepStore(ledger)                     # ledger: an AsyncLedger
    agent = Agent(model, capabilities=[StepPersistence(store=store)])

A run is a ledger session (``uuid5(PYDANTIC_NAMESPACE, run_id)``). ``append_event`` is deduplicated
by the event's idempotency key by the ledger itself (its unique index per session, not a read
first), so a replayed step is stored once. A tool effect is two events in one transaction: the
harness's record (``pydantic.tool.effect``) and the ledger's own ``tool.invoked`` (started) or
``tool.observed`` (completed, failed), so the fold knows the call: ``list_unresolved_tool_effects``
is answered from the calls the fold holds in flight, ``rebuild_context`` and the memo see
completed calls, and ``inspect``/``replay``/``verify`` show the run like any session. Snapshots
follow the harness's rules (a key seen or below the run's high-water sequence is not stored
again; ``max_snapshots_per_run`` keeps the newest, the newest overall and the newest complete),
applied as the run's events are read.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Iterable
from dataclasses import fields
from datetime import datetime
from typing import Any

import msgspec
from pydantic_ai.messages import ModelMessagesTypeAdapter
from pydantic_ai_harness.step_persistence._types import (
    ContinuableSnapshot,
    RunRecord,
    StepEvent,
    ToolEffectRecord,
)

from ledger_cdc.client.recovery import rebuild_context_async
from ledger_cdc.client.steps import Step, Steps, run_async
from ledger_cdc.client.writer import AsyncLedger
from ledger_cdc.errors import IdempotencyConflictError, InvalidEventError, NoSuchSessionError
from ledger_cdc.events import (
    READ_MAX_DEPTH,
    HarnessRecord,
    ToolInvoked,
    ToolObserved,
    decode_bounded,
)

__all__ = ["PYDANTIC_NAMESPACE", "LedgerStepStore", "run_session"]

log = logging.getLogger(__name__)
PYDANTIC_NAMESPACE = uuid.UUID("3d3f1c55-9a0b-5e7c-a1d2-707964616e74")
AGENT = "pydantic-ai"

_RUN = (
    "SELECT position, event_type, payload::text FROM agent_events "
    "WHERE session_id = %s AND event_type = ANY(%s) ORDER BY position"
)
_RUNS = (
    "SELECT session_id, position, payload::text FROM agent_events "
    "WHERE event_type = 'pydantic.run.registered' ORDER BY session_id, position"
)
_record = msgspec.json.Decoder(HarnessRecord)


def _validate_max_snapshots(value: object) -> None:
    """The harness's own check of the retention bound, with its words (its stores refuse a
    bound that is not an int with one message, one below 1 with another)."""
    if value is None:
        return
    if not isinstance(value, int):
        raise ValueError(f"max_snapshots_per_run must be an int >= 1 or None, got {value!r}")
    if value < 1:
        raise ValueError(f"max_snapshots_per_run must be >= 1 or None, got {value!r}")


def run_session(run_id: str) -> uuid.UUID:
    """The ledger session of a harness run."""
    return uuid.uuid5(PYDANTIC_NAMESPACE, str(run_id))


def _to_json(obj: Any) -> dict[str, Any]:
    out = {}
    for f in fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, datetime):
            v = v.isoformat()
        elif f.name == "messages":
            v = msgspec.json.decode(ModelMessagesTypeAdapter.dump_json(v))
        out[f.name] = v
    return out


def _from_json(cls: Any, data: Any) -> Any:
    """A stored record as ``cls``: fields it does not declare are left out (a newer writer);
    one that cannot be made (a field missing or of the wrong shape) is InvalidEventError."""
    try:
        kw = {f.name: data[f.name] for f in fields(cls) if f.name in data}
        for name, v in kw.items():
            if name in ("timestamp", "started_at", "ended_at") and isinstance(v, str):
                kw[name] = datetime.fromisoformat(v)
            elif name == "messages" and v is not None:
                kw[name] = ModelMessagesTypeAdapter.validate_python(v)
        return cls(**kw)
    except Exception as e:  # whatever a record's constructor or validator raises
        raise InvalidEventError(
            f"a stored {cls.__name__} cannot be read back: {type(e).__name__}: {str(e)[:200]}"
        ) from e


def _readable(cls: Any, texts: Iterable[str]) -> list[Any]:
    """The records that read back; one that does not is logged and skipped, not the list."""
    out = []
    for text in texts:
        try:
            out.append(_from_json(cls, decode_bounded(_record.decode, text, READ_MAX_DEPTH).record))
        except (InvalidEventError, msgspec.DecodeError) as e:
            log.warning("%s; skipped", str(e)[:500])
    return out


def _rows_steps(run_id: str, kinds: list[str]) -> Steps[list[tuple[Any, ...]]]:
    rows = yield Step(_RUN, (run_session(run_id), kinds))
    return rows


def _sequence(key: str) -> int | None:
    prefix, sep, _ = key.partition(":")
    if not sep:
        return None
    try:
        n = int(prefix)
    except ValueError:
        return None
    return n if n >= 0 else None


def _snapshots(rows: list[tuple[Any, ...]], keep: int | None) -> list[ContinuableSnapshot]:
    """The run's snapshots as the harness keeps them (its key and retention rules, replayed in
    the order the snapshots were appended)."""
    snaps: list[ContinuableSnapshot] = []
    high: tuple[int, set[str]] | None = None
    snap: ContinuableSnapshot
    for snap in _readable(ContinuableSnapshot, (t for _, _, t in rows)):
        key = snap.idempotency_key
        if key is not None:
            seq = _sequence(key)
            if (
                seq is not None
                and high is not None
                and (seq < high[0] or (seq == high[0] and key in high[1]))
            ):
                continue
            if any(s.idempotency_key == key for s in snaps):
                continue
            if seq is not None:
                if high is None or seq > high[0]:
                    high = (seq, {key})
                else:
                    high[1].add(key)
        snaps.append(snap)
        if keep is not None and len(snaps) > keep:
            retained = set(range(len(snaps) - keep, len(snaps)))
            complete = [i for i, s in enumerate(snaps) if s.state == "complete"]
            if complete:
                retained.add(complete[-1])
            snaps = [s for i, s in enumerate(snaps) if i in retained]
    return snaps


class LedgerStepStore:
    """The harness's ``StepStore`` protocol on an :class:`~ledger_cdc.AsyncLedger`."""

    def __init__(self, ledger: AsyncLedger, *, max_snapshots_per_run: int | None = None) -> None:
        _validate_max_snapshots(max_snapshots_per_run)
        self.ledger = ledger
        self.max_snapshots_per_run = max_snapshots_per_run

    async def _rows(self, run_id: str, *kinds: str) -> list[tuple[Any, ...]]:
        async with self.ledger.connection() as conn:
            return await run_async(conn, _rows_steps(run_id, list(kinds)))

    async def _append(self, run_id: str, kind: str, obj: Any, key: str | None = None) -> None:
        await self.ledger.append(
            run_session(run_id), AGENT, kind, HarnessRecord(_to_json(obj)), idempotency_key=key
        )

    # -- runs -----------------------------------------------------------------------------------

    async def register_run(self, record: RunRecord) -> None:
        await self._append(record.run_id, "pydantic.run.registered", record)

    async def get_run(self, *, run_id: str) -> RunRecord | None:
        rows = await self._rows(run_id, "pydantic.run.registered")
        if not rows:
            return None
        records: list[RunRecord] = _readable(RunRecord, (t for _, _, t in rows))
        return records[-1] if records else None  # (the latest that reads back)

    async def list_runs(
        self, *, parent_run_id: str | None = None, conversation_id: str | None = None
    ) -> list[RunRecord]:
        async with self.ledger.connection() as conn:
            rows = await (await conn.execute(_RUNS)).fetchall()
        latest: dict[Any, str] = {}
        for sid, _, text in rows:
            latest[sid] = text  # the last registration of each run wins
        records: list[RunRecord] = _readable(RunRecord, latest.values())
        return sorted(
            (
                r
                for r in records
                if (parent_run_id is None or r.parent_run_id == parent_run_id)
                and (conversation_id is None or r.conversation_id == conversation_id)
            ),
            key=lambda r: r.started_at,
        )

    # -- step events ----------------------------------------------------------------------------

    async def append_event(self, event: StepEvent) -> None:
        # the same key with other content: the first one stands (as the harness does)
        with contextlib.suppress(IdempotencyConflictError):
            await self._append(event.run_id, "pydantic.step", event, event.idempotency_key)

    async def list_events(self, *, run_id: str) -> list[StepEvent]:
        rows = await self._rows(run_id, "pydantic.step")
        return _readable(StepEvent, (t for _, _, t in rows))

    # -- snapshots ------------------------------------------------------------------------------

    async def save_snapshot(self, snapshot: ContinuableSnapshot) -> None:
        await self._append(snapshot.run_id, "pydantic.snapshot", snapshot)

    async def _snapshots(self, run_id: str) -> list[ContinuableSnapshot]:
        rows = await self._rows(run_id, "pydantic.snapshot")
        return _snapshots(rows, self.max_snapshots_per_run)

    async def latest_snapshot(
        self, *, run_id: str, include_interrupted: bool = False
    ) -> ContinuableSnapshot | None:
        snaps = _snapshots(
            await self._rows(run_id, "pydantic.snapshot"), self.max_snapshots_per_run
        )
        for snap in reversed(snaps):
            if include_interrupted or snap.state == "complete":
                return snap
        return None

    async def list_snapshots(
        self, *, run_id: str, include_interrupted: bool = False
    ) -> list[ContinuableSnapshot]:
        snaps = _snapshots(
            await self._rows(run_id, "pydantic.snapshot"), self.max_snapshots_per_run
        )
        return [s for s in snaps if include_interrupted or s.state == "complete"]

    # -- tool effects ---------------------------------------------------------------------------

    async def record_tool_effect(self, record: ToolEffectRecord) -> None:
        """The harness's record and the ledger's own tool event, in one transaction."""
        sid = run_session(record.run_id)
        kind: str
        payload: ToolInvoked | ToolObserved
        if record.status == "started":
            kind, payload = (
                "tool.invoked",
                ToolInvoked(
                    record.tool_call_id, record.tool_name, idempotency_key=record.idempotency_key
                ),
            )
        else:
            error = (record.effect_summary or "failed") if record.status == "failed" else None
            kind, payload = (
                "tool.observed",
                ToolObserved(record.tool_call_id, record.effect_summary, error),
            )
        async with self.ledger.transaction() as tx:
            await tx.append(sid, AGENT, "pydantic.tool.effect", HarnessRecord(_to_json(record)))
            await tx.append(sid, AGENT, kind, payload)

    async def _effects(self, run_id: str) -> dict[str, ToolEffectRecord]:
        rows = await self._rows(run_id, "pydantic.tool.effect")
        out: dict[str, ToolEffectRecord] = {}
        r: ToolEffectRecord
        for r in _readable(ToolEffectRecord, (t for _, _, t in rows)):
            out[r.tool_call_id] = r  # the latest record of a call wins
        return out

    async def get_tool_effect(self, *, run_id: str, tool_call_id: str) -> ToolEffectRecord | None:
        return (await self._effects(run_id)).get(tool_call_id)

    async def list_unresolved_tool_effects(self, *, run_id: str) -> list[ToolEffectRecord]:
        """The calls the fold holds in flight (invoked, never observed), with their records."""
        async with self.ledger.connection() as conn:
            try:
                ctx = await rebuild_context_async(conn, run_session(run_id))
            except NoSuchSessionError:
                return []
        effects = await self._effects(run_id)
        return [effects[c] for c in ctx.pending_tools if c in effects]
