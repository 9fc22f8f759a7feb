"""Sessions named as their framework names them: a LangGraph thread, an OpenAI Agents session
id, a Pydantic AI run id — each is one ledger session, ``uuid5`` of the framework's namespace
and the name (``ledger_cdc.integrations`` writes them so). Naming one needs no framework
installed: the namespaces are repeated here, and a test holds them equal to the integrations'.

:func:`resolve` turns what a user typed (a session UUID, ``thread:ID``, ``openai:ID``,
``pydantic:ID``, or a bare name looked up in all three) into a :class:`Named` session, and says
in one line (:class:`~ledger_cdc.errors.NoSuchSessionError`) when the ledger holds no such one.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import psycopg

from ledger_cdc.errors import NoSuchSessionError

__all__ = [
    "KINDS",
    "LANGGRAPH_NAMESPACE",
    "OPENAI_NAMESPACE",
    "PYDANTIC_NAMESPACE",
    "Named",
    "parse_name",
    "resolve",
    "session_of",
]

LANGGRAPH_NAMESPACE = uuid.UUID("5f0e0c3a-8d1b-5a44-9a3e-6c6564676572")
OPENAI_NAMESPACE = uuid.UUID("0b1c6f0e-3f1a-5d2e-8f44-6f70656e6169")
PYDANTIC_NAMESPACE = uuid.UUID("3d3f1c55-9a0b-5e7c-a1d2-707964616e74")

KINDS: dict[str, tuple[uuid.UUID, str]] = {
    "thread": (LANGGRAPH_NAMESPACE, "LangGraph thread"),
    "openai": (OPENAI_NAMESPACE, "OpenAI Agents session"),
    "pydantic": (PYDANTIC_NAMESPACE, "Pydantic AI run"),
}
"""Prefix of a name (``thread:ticket-7``) → (namespace, what it names)."""


def session_of(kind: str, name: str) -> uuid.UUID:
    """The ledger session of a framework's name (``kind``: a key of :data:`KINDS`)."""
    return uuid.uuid5(KINDS[kind][0], str(name))


@dataclass(frozen=True)
class Named:
    """A session and the name it was given by: ``kind`` is ``session`` (a UUID), ``thread``,
    ``openai`` or ``pydantic``, or ``name`` (a bare name, to look up in all three)."""

    kind: str
    name: str
    session_id: uuid.UUID | None = None  # known without a look-up (a UUID, a prefixed name)
    checkpoint_ns: str | None = None  # LangGraph's namespace within the thread

    def __str__(self) -> str:
        if self.kind == "session":
            return self.name
        if self.kind == "name":
            return repr(self.name)
        return f"{KINDS[self.kind][1]} {self.name!r}"

    @property
    def label(self) -> str:
        """How to show the session: its framework name where it has one, else its id."""
        return str(self.session_id) if self.kind in ("session", "name") else str(self)


def parse_name(text: str, kind: str | None = None) -> Named:
    """What a user typed, before any look-up: a UUID, ``KIND:NAME``, or a bare name (``kind``
    given: a name of that kind, as ``--thread ID`` gives it)."""
    if kind is not None:
        return Named(kind, text, session_of(kind, text))
    try:
        return Named("session", str(uuid.UUID(text)), uuid.UUID(text))
    except ValueError:
        pass
    prefix, sep, rest = text.partition(":")
    if sep and prefix in KINDS and rest:
        return Named(prefix, rest, session_of(prefix, rest))
    return Named("name", text)


_EXISTS = "SELECT session_id FROM agent_events WHERE session_id = ANY(%s) GROUP BY session_id"


def resolve(conn: psycopg.Connection[Any], named: Named) -> Named:
    """``named`` with its session id: a bare name becomes the thread, OpenAI Agents session or
    Pydantic AI run the ledger has of that name. NoSuchSessionError (one line) when a framework
    name has no events; a UUID is passed through (the command says if it has none)."""
    if named.kind == "session":
        return named
    if named.kind != "name":
        assert named.session_id is not None
        if not conn.execute(_EXISTS, ([named.session_id],)).fetchall():
            raise NoSuchSessionError(
                f"no {named} in the ledger (its session {named.session_id} has no events): "
                "check the name"
            )
        return named
    candidates = {session_of(k, named.name): k for k in KINDS}
    found = [candidates[r[0]] for r in conn.execute(_EXISTS, (list(candidates),)).fetchall()]
    if not found:
        raise NoSuchSessionError(
            f"{named.name!r} is neither a session id (a UUID) nor a LangGraph thread, OpenAI "
            "Agents session or Pydantic AI run in the ledger: check the name"
        )
    if len(found) > 1:
        which = " and ".join(f"{k}:{named.name}" for k in sorted(found))
        raise NoSuchSessionError(f"{named.name!r} names more than one session: say which, {which}")
    kind = found[0]
    return Named(kind, named.name, session_of(kind, named.name), named.checkpoint_ns)
