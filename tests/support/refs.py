"""Making a stored context whole from a list of events (what SQL ``ledger_window`` and
``ledger_message`` do against the table)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from ledger_cdc.events import LedgerEvent, ModelResponded, ToolObserved
from ledger_cdc.fold import SessionContext, attach, references


def attach_from(ctx: SessionContext, events: Iterable[Any]) -> SessionContext:
    by_position = {e.position: e for e in events if isinstance(e, LedgerEvent)}
    window, positions = references(ctx)
    messages = None if window is None else by_position[window].payload.messages
    contents: list[str | None] = []
    for p in positions:
        payload = by_position[p].payload
        if isinstance(payload, ModelResponded):
            contents.append(payload.content)
        elif isinstance(payload, ToolObserved):
            result = payload.result  # the message's text: a result not a string as JSON
            text = result if isinstance(result, str) else msgspec.json.encode(result).decode()
            contents.append(payload.error if payload.error is not None else text)
        else:
            contents.append(None)
    attach(ctx, messages, contents)
    return ctx
