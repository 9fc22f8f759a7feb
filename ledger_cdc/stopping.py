"""SIGINT, SIGTERM and SIGHUP (the terminal closed) turned into a call on a thread of their own.

Python runs a signal handler in the main thread between two bytecodes, possibly while that
thread holds a lock: inside ``threading.Event.set`` called by the previous signal's handler, for
one. A handler that takes the same lock (every ``Event.set`` does) then waits for itself
forever, so a burst of stop signals (a supervisor's and a wrapper's SIGTERM, a double Ctrl-C)
could hang a process that was only asked to stop. The handler installed here takes no lock: it
writes the signal's number to a pipe, and a daemon thread reads it and makes the call.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable

# SIGHUP too: a consumer started from a terminal that closes drains like one asked to stop,
# instead of ending at once (no reload is there to be asked for)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

log = logging.getLogger(__name__)


def on_stop_signals(stop: Callable[[], None]) -> None:
    """From now on, SIGINT, SIGTERM and SIGHUP log "signal N: finishing the current batch" and call
    ``stop()`` on the ``ledger-cdc-signals`` thread, once per signal received (signals that
    arrive together may be counted once). Main thread only, as :func:`signal.signal` is."""
    r, w = os.pipe()
    os.set_blocking(w, False)

    def handler(signum: int, frame: object) -> None:
        with contextlib.suppress(OSError):  # the pipe full: calls are pending already
            os.write(w, bytes((signum,)))

    def relay() -> None:
        while data := os.read(r, 64):
            for signum in data:
                log.info("signal %s: finishing the current batch", signum)
                try:
                    stop()
                except Exception:  # the next signal is still relayed
                    log.exception("stopping on signal %s failed", signum)

    threading.Thread(target=relay, name="ledger-cdc-signals", daemon=True).start()
    for s in STOP_SIGNALS:
        signal.signal(s, handler)


def ignore_stop_signals() -> None:
    """The stop signals ignored from now on: for a process whose work is done and that is
    exiting (the interpreter puts the default handlers back as it finalizes, and a late signal
    would then end it by that signal instead of its own exit status)."""
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
