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
  version: storage grows with what changed. At least every 32 checkpoints of a namespace (and
  the first a saver stores there) it carries every channel's full value instead;
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
A saver keeps the threads it folded and reads only their new events. A checkpoint of a thread it
does not keep (a process resuming after a crash) is read from the thread's recent events only
(``recent``): back from the head to the checkpoint (the latest is then the one put last), its
writes, and the values it names, down to the nearest full value. Sync and async methods share
one implementation (SQL steps run by ``client.steps``).

Modules: ``saver`` (the public methods), ``reading`` and ``writing`` (a checkpoint read back,
the events a write appends), ``recent`` (a checkpoint from its thread's recent events),
``thread`` (a thread as its events fold), ``core`` (what sync and async share), ``calls``
(``call_once``).
"""

from ledger_cdc.integrations.langgraph.calls import CallResult as CallResult
from ledger_cdc.integrations.langgraph.saver import AsyncLedgerSaver, LedgerSaver
from ledger_cdc.integrations.langgraph.thread import LANGGRAPH_NAMESPACE, thread_session

__all__ = ["LANGGRAPH_NAMESPACE", "AsyncLedgerSaver", "LedgerSaver", "thread_session"]
