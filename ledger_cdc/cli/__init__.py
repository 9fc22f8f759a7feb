"""The ``ledger-cdc`` command line: a thin layer over the library. ``base`` defines the group
and what every command shares; the commands are grouped by what they serve: ``app`` the
ledger's database (init, slot, lag), ``run`` the stream's processes (consume, fold),
``server`` a throwaway PostgreSQL (server, demo), ``doctor`` the deployment's preflight,
``ui`` the web view, ``tools`` the others (replay, inspect, verify, runs, outbox, partitions,
…)."""

import signal

from ledger_cdc.cli import app, doctor, run, server, tools, ui  # noqa: F401  (each registers its commands)
from ledger_cdc.cli.base import cli, fail

__all__ = ["cli", "main"]


def main() -> None:
    # Ctrl-C stops a command even when the process was started with SIGINT ignored (a shell's
    # background job, some supervisors), which Python keeps as it found it: a `lag --watch`,
    # `tail` or `ui` would otherwise run on
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        cli(prog_name="ledger-cdc")
    except Exception as e:
        fail(e)
