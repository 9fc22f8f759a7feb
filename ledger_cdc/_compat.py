"""The module paths of the flat layout, kept importable.

``ledger_cdc.replay`` is ``ledger_cdc.client.recovery`` (the same module object, so patches and
``isinstance`` checks agree), and so on for every module that moved into its layer's package.
Registered by ``ledger_cdc/__init__``; new code imports the new paths.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import CodeType, ModuleType
from typing import Any, cast

MOVED = {
    "ledger_cdc.replay": "ledger_cdc.client.recovery",
    "ledger_cdc.writer": "ledger_cdc.client.writer",
    "ledger_cdc.runs": "ledger_cdc.client.runs",
    "ledger_cdc.dispatch": "ledger_cdc.client.dispatch",
    "ledger_cdc.tail": "ledger_cdc.client.tail",
    "ledger_cdc.schema": "ledger_cdc.admin.schema",
    "ledger_cdc.verify": "ledger_cdc.admin.verify",
    "ledger_cdc.health": "ledger_cdc.admin.health",
    "ledger_cdc.partitions": "ledger_cdc.admin.partitions",
    "ledger_cdc.timeline": "ledger_cdc.admin.timeline",
    "ledger_cdc.importer": "ledger_cdc.admin.importer",
    "ledger_cdc.embedded": "ledger_cdc.demo.embedded",
    "ledger_cdc.crashdemo": "ledger_cdc.demo.crash",
    "ledger_cdc.jetstream": "ledger_cdc.sink.jetstream",
    "ledger_cdc.cli_tools": "ledger_cdc.cli.tools",
    "ledger_cdc.runner": "ledger_cdc.cli.runner",
    "ledger_cdc.stream.rows": "ledger_cdc.stream.ledger",
    "ledger_cdc.pgoutput.values": "ledger_cdc.stream.values",
}


class _Alias:
    """A meta path finder and loader (duck-typed: importlib.abc costs 40 ms of start-up)."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        moved = importlib.util.find_spec(MOVED[fullname])
        origin = None if moved is None else moved.origin
        return importlib.machinery.ModuleSpec(fullname, cast(Any, self), origin=origin)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module is the one at its new path, already executed."""

    def get_code(self, fullname: str) -> CodeType | None:
        """For ``python -m <old path>``: the code of the module at its new path."""
        spec = importlib.util.find_spec(MOVED[fullname])
        loader = None if spec is None else spec.loader
        get = getattr(loader, "get_code", None)
        return None if get is None or spec is None else get(spec.name)


def install() -> None:
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.append(_Alias())
