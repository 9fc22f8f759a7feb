"""The ``ledger-cdc`` command line: a thin layer over the library. ``base`` defines the group
and what every command shares; ``app`` holds the core commands (init, demo, consume, lag,
slot), ``doctor`` the deployment's preflight, ``server`` a throwaway PostgreSQL, ``tools`` the
others (replay, inspect, verify, runs, outbox, partitions, …)."""

from ledger_cdc.cli import app, doctor, server, tools, ui  # noqa: F401  (each registers its commands)
from ledger_cdc.cli.base import cli, fail

__all__ = ["cli", "main"]


def main() -> None:
    try:
        cli(prog_name="ledger-cdc")
    except Exception as e:
        fail(e)
