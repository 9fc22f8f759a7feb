"""What a fold produces: the folded state of a session and its parts (no behaviour but the
memo lookups a context can answer by itself).

A :class:`SessionContext` is everything the orchestrator needs to know about a session after a
crash: the context window (``context.loaded``, then model replies and tool results appended), the
tool calls in flight (invoked, never observed) and the completed ones memoised by call id, the
model calls likewise, handoffs, token usage, status and the position reached.

A completed call never changes, so snapshots do not carry the memo: each completed call is one
row of ``agent_memo``, written by the consumer in the batch that folds it, and a snapshot records
``memo_position``, the session position up to which its memo lives there. A context rebuilt from
a snapshot therefore holds only the calls completed after it, and answers memo lookups through
``ledger_cdc.client.recovery.memoised_tool`` / ``memoised_model``.

Two fields are storage hints rather than state: ``window`` (which ``context.loaded`` event the
first messages come from) and ``sources`` (which events later messages were taken from). What
is stored leaves those messages in their events (``ledger_cdc.fold.codec``); ``verify``
compares contexts without the hints.
"""

from __future__ import annotations

import datetime as dt
import enum
import uuid
from typing import Any

import msgspec

from ledger_cdc.errors import MemoNotLoadedError
from ledger_cdc.events import Message, ToolCall

__all__ = [
    "FORMAT_VERSION",
    "PROJECTION_FORMAT",
    "PROJECTION_FORMATS",
    "REDUCER_VERSION",
    "REFERENCE_MIN",
    "RUN_PENDING",
    "RUN_RUNNING",
    "RUN_SUSPENDED",
    "SNAPSHOT_FORMATS",
    "CompletedModel",
    "CompletedTool",
    "ContextWindow",
    "ForkOrigin",
    "Handoff",
    "Lease",
    "MessageSource",
    "PendingModel",
    "PendingTool",
    "RunState",
    "RunStatus",
    "SessionContext",
    "SessionStatus",
    "Signal",
    "TokenUsage",
]

FORMAT_VERSION = 4
"""Version of the snapshot format written. 4: the context window loaded by a ``context.loaded``
event is not copied but referenced (``window``: the event's position; the messages after it are
stored); 3: canonical encoding (object keys sorted) and the quarantine count; 2: the memo is not
in the snapshot but in ``agent_memo`` up to ``memo_position``; 1 held the whole memo."""
SNAPSHOT_FORMATS = (3, 4)
"""Snapshot formats read (3 is 4 without a referenced window)."""
PROJECTION_FORMAT = 2
"""Version of the projection's context format (``agent_sessions.context``) written. 2: as a
snapshot of format 4 (no completed calls: they are in ``agent_memo``; the context window
referenced); 1: the whole context, every completed call and message copied."""
PROJECTION_FORMATS = (1, 2)
"""Projection formats read."""
REFERENCE_MIN = 256
"""A context window, a message taken from an event or a call's result is stored by reference to
its event from this many characters on (a shorter one costs less copied than read back)."""
REDUCER_VERSION = "core-3"
"""Version of the built-in reducers' semantics (bump when a reducer changes its output)."""


class PendingTool(msgspec.Struct, omit_defaults=True, gc=False):
    call_id: str
    tool: str
    arguments: dict[str, Any]
    idempotency_key: str | None
    invoked_seq: int
    attempts: int = 1


class CompletedTool(msgspec.Struct, omit_defaults=True, gc=False):
    call_id: str
    tool: str
    arguments: dict[str, Any]
    idempotency_key: str | None
    result: Any
    error: str | None
    invoked_seq: int
    observed_seq: int


class PendingModel(msgspec.Struct, omit_defaults=True, gc=False):
    request_id: str
    model: str
    prompt_hash: str | None
    idempotency_key: str | None
    requested_seq: int


class CompletedModel(msgspec.Struct, omit_defaults=True, gc=False):
    request_id: str
    model: str
    prompt_hash: str | None
    content: str
    input_tokens: int
    output_tokens: int
    tool_calls: list[ToolCall]
    stop_reason: str | None
    requested_seq: int | None
    responded_seq: int
    idempotency_key: str | None = None


class ForkOrigin(msgspec.Struct, omit_defaults=True, gc=False):
    session_id: uuid.UUID
    upto_seq: int
    upto_position: int


class Lease(msgspec.Struct, omit_defaults=True, gc=False):
    worker: str
    until: dt.datetime  # the leasing event's created_at (server clock) + its ttl
    seq: int
    position: int


class Signal(msgspec.Struct, omit_defaults=True, gc=False):
    name: str
    seq: int
    payload: Any = None
    sender: str | None = None


class _Status(str, enum.Enum):
    """A status: an enum whose members are the strings stored and compared (``"running"``)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    def __hash__(self) -> int:  # as the string: a member finds the same dict and set entries
        return hash(str(self.value))


class SessionStatus(_Status):
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"


class RunStatus(_Status):
    PENDING = "pending"
    RUNNING = "running"
    SUSPENDED = "suspended"
    COMPLETED = "completed"
    FAILED = "failed"


RUN_PENDING, RUN_RUNNING, RUN_SUSPENDED = RunStatus.PENDING, RunStatus.RUNNING, RunStatus.SUSPENDED


class RunState(msgspec.Struct):
    """Coordination state of a run, folded from run.* and signal.* events (no clock is read:
    whether a lease has expired is decided by whoever asks, against the server's clock)."""

    status: RunStatus = RunStatus.RUNNING
    lease: Lease | None = None
    wait_for: list[str] = []
    reason: str | None = None
    inbox: list[Signal] = []  # signals that no suspension has consumed yet
    woken_by: Signal | None = None
    leases: int = 0  # run.leased events, renewals included


class ContextWindow(msgspec.Struct, frozen=True, omit_defaults=True, gc=False):
    """Where a context's first messages come from: the ``context.loaded`` event at ``position``
    in the session, whose ``length`` messages (``chars`` characters of content) open
    ``messages``; later messages were appended by the fold.

    A storage hint, not state: snapshots and projections store the event's position instead of
    its messages (``omitted``: the first ``length`` messages are not in ``messages`` and must be
    read from that event, :func:`ledger_cdc.fold.codec.attach`). ``verify`` compares
    contexts without it. A reducer that changes ``messages`` other than by appending must set
    ``ctx.window = None`` (a window that no longer matches its messages is found out when the
    context is stored, by ``length`` and ``chars``, and the messages are then copied)."""

    position: int
    length: int
    chars: int
    omitted: bool = False


class MessageSource(msgspec.Struct, frozen=True, omit_defaults=True, gc=False, array_like=True):
    """``messages[index]`` is, verbatim, a string of the event at ``position``: a
    ``model.responded``'s ``content``, a ``tool.observed``'s ``error`` or (string) ``result``,
    ``chars`` characters long. A storage hint like :class:`ContextWindow`: a stored context
    leaves a long content in its event (``omitted``: the message's content is empty until read
    back)."""

    index: int
    position: int
    chars: int
    omitted: bool = False


class Handoff(msgspec.Struct, omit_defaults=True, gc=False):
    handoff_id: str
    agent: str  # to (emitted) / from (received)
    seq: int
    message: str = ""


class TokenUsage(msgspec.Struct, omit_defaults=True, gc=False):
    input_tokens: int = 0
    output_tokens: int = 0
    model_calls: int = 0


class SessionContext(msgspec.Struct):
    """The folded state of one session (see the module docstring)."""

    session_id: uuid.UUID
    status: SessionStatus = SessionStatus.RUNNING
    task: str | None = None
    messages: list[Message] = []
    pending_tools: dict[str, PendingTool] = {}
    completed_tools: dict[str, CompletedTool] = {}
    pending_models: dict[str, PendingModel] = {}
    completed_models: dict[str, CompletedModel] = {}
    # calls completed at or below this position are not in completed_tools / completed_models
    # but in agent_memo (a context rebuilt from a snapshot); 0: this context holds its whole memo
    memo_position: int = 0
    handoffs_emitted: list[Handoff] = []
    handoffs_received: list[Handoff] = []
    usage: TokenUsage = msgspec.field(default_factory=TokenUsage)
    agents: list[str] = []
    result: Any = None
    error: str | None = None
    retryable: bool | None = None
    event_count: int = 0
    last_seq: int = 0
    last_position: int = 0
    ignored_events: int = 0
    quarantined: int = 0  # events not folded (see fold_one); their positions still count
    forked_from: ForkOrigin | None = None
    run: RunState | None = None
    extra: dict[str, Any] = {}
    window: ContextWindow | None = None  # where messages[:window.length] come from (a hint)
    sources: list[MessageSource] = []  # the events later messages were taken from (a hint)

    # -- memo: what a restarted worker answers from the ledger instead of calling again ------

    def memoised_tool(
        self, call_id: str | None = None, *, idempotency_key: str | None = None
    ) -> CompletedTool | None:
        """The completed tool call with this call id (or idempotency key: the latest such
        completion), if there is one.

        Raises :class:`MemoNotLoadedError` when the answer may be in ``agent_memo`` instead
        (``memo_position > 0``): use
        ``ledger_cdc.client.recovery.memoised_tool(conn, ctx, …)`` then."""
        found: CompletedTool | None = None
        if call_id is not None:
            found = self.completed_tools.get(call_id)
        elif idempotency_key is not None:  # the latest completion with this key
            for done in self.completed_tools.values():
                if done.idempotency_key == idempotency_key and (
                    found is None or done.observed_seq > found.observed_seq
                ):
                    found = done
        else:
            return None
        if found is None and self.memo_position:
            raise self._not_loaded("tool", call_id or idempotency_key)
        return found

    def memoised_model(
        self,
        request_id: str | None = None,
        *,
        idempotency_key: str | None = None,
        prompt_hash: str | None = None,
    ) -> CompletedModel | None:
        """The completed model call with this request id (or idempotency key, or prompt hash:
        the latest such response), if there is one. Raises :class:`MemoNotLoadedError` as
        :meth:`memoised_tool` does."""
        found: CompletedModel | None = None
        if request_id is not None:
            found = self.completed_models.get(request_id)
        elif idempotency_key is None and prompt_hash is None:
            return None
        else:
            for done in self.completed_models.values():
                if (
                    (idempotency_key is not None and done.idempotency_key == idempotency_key)
                    or (prompt_hash is not None and done.prompt_hash == prompt_hash)
                ) and (found is None or done.responded_seq > found.responded_seq):
                    found = done
        if found is None and self.memo_position:
            raise self._not_loaded("model", request_id or idempotency_key or prompt_hash)
        return found

    def _not_loaded(self, kind: str, what: str | None) -> MemoNotLoadedError:
        fn = "memoised_tool" if kind == "tool" else "memoised_model"
        return MemoNotLoadedError(
            f"session {self.session_id}: {kind} call {what!r} is not among the calls completed "
            f"after position {self.memo_position}, and this context does not hold the ones "
            f"before (they are in agent_memo): look it up with "
            f"ledger_cdc.client.recovery.{fn}(conn, ctx, ...), or rebuild with memo=True"
        )
