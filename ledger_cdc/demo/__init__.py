"""What ``ledger-cdc demo`` runs (``show``, start to end): simulated agents (``agents``), the
crash demonstration (``crash``) and the throwaway local PostgreSQL they run on (``embedded``)."""

from ledger_cdc.demo.agents import (
    DemoReport,
    ledger_rows,
    projections,
    run_agents,
    verify_against_refold,
)

__all__ = ["DemoReport", "ledger_rows", "projections", "run_agents", "verify_against_refold"]
