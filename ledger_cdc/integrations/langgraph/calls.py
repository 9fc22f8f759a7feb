"""External calls at most once per thread (``call_once``): recorded in the thread's session as
the ledger's own ``tool.invoked`` / ``tool.observed``, the result's JSON text kept beside them."""

from __future__ import annotations

import inspect
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
from langchain_core.runnables import RunnableConfig

from ledger_cdc.client.steps import Step, Steps, run
from ledger_cdc.events import ToolInvoked, ToolObserved, register_event_type
from ledger_cdc.integrations.langgraph.core import SaverCore, configurable
from ledger_cdc.integrations.langgraph.thread import AGENT, MISSING, thread_session


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
    (``MISSING`` when there is none)."""
    rows = yield Step(_RESULT, (sid, call_id))
    if not rows or rows[0][0] is None:
        return MISSING
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


class CallOnce(SaverCore):
    """A saver's ``call_once``."""

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
        thread_id = str(configurable(config)["thread_id"])
        sid = thread_session(thread_id)
        ledger = self._sync_ledger()
        with ledger.connection() as conn:
            done = run(conn, _result_steps(sid, call_id))
            if done is MISSING:
                memo = _memo_of(conn, sid, call_id)
                done = MISSING if memo is None else memo.result
        if done is not MISSING:
            return done
        key = f"{thread_id}:{call_id}"
        ledger.append(sid, AGENT, "tool.invoked", ToolInvoked(call_id, tool, arguments or {}, key))
        result = call(idempotency_key=key) if _takes_key(call) else call()
        with ledger.transaction() as tx:
            tx.append(sid, AGENT, "tool.observed", ToolObserved(call_id, result))  # (checks it)
            text = msgspec.json.encode(result).decode()
            tx.append(sid, AGENT, "langgraph.call.result", CallResult(call_id, text))
        return result
