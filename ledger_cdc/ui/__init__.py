"""``ledger-cdc ui``: a local, read-only web view of the ledger — sessions and threads with
their status, one session's timeline a page at a time, the diff of two sessions, and the
slots' health and lag over the last hour. Server-rendered HTML from the standard library's
WSGI server: no JavaScript, no build step. ``store`` reads (read-only transactions), ``pages``
renders (every value escaped), ``web`` gates every request and serves.
"""

from ledger_cdc.ui.store import Store
from ledger_cdc.ui.web import Gate, LagSampler, make_app, serve

__all__ = ["Gate", "LagSampler", "Store", "make_app", "serve"]
