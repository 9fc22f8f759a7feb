"""The stop watchdog that ``consume`` and ``fold`` run (``cli.runner.watch_stop``), in a process
of its own: a stop held past its timeout (here by a wait that never returns, as a libpq call on
a server that stopped answering) ends the process with status 4 and one line saying why; work
that finishes in time is left to end as it would, however long the process runs after it."""

from __future__ import annotations

import subprocess
import sys
import time

from tests.support.cdc import ROOT

CHILD = """
import logging, sys, threading, time
from ledger_cdc.cli.runner import watch_stop

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
timeout, what = float(sys.argv[1]), sys.argv[2]
stopped, done = threading.Event(), threading.Event()
watch_stop(stopped.wait, done, timeout, "a test holding it", "a rerun reads again")
stopped.set()  # (a signal's stop)
if what == "hang":
    threading.Event().wait()  # never returns
done.set()
time.sleep(3 * timeout)  # what the process does after its work: not the watchdog's to cut
print("ended on its own", flush=True)
"""


def _child(what: str, timeout: float = 1.0) -> tuple[subprocess.CompletedProcess[str], float]:
    began = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-c", CHILD, str(timeout), what],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    return r, time.monotonic() - began


def test_a_stop_held_past_its_timeout_ends_the_process_with_status_4() -> None:
    r, took = _child("hang")
    assert r.returncode == 4, r.stderr
    assert took < 30
    lines = [ln for ln in r.stderr.splitlines() if "stopping" in ln]
    assert lines == [
        "ERROR stopping: not done 1s after the stop (a test holding it); exiting now with what "
        "it holds unconfirmed, which a rerun reads again"
    ], r.stderr


def test_a_stop_done_in_time_is_left_alone() -> None:
    r, _ = _child("finish")
    assert r.returncode == 0, r.stderr
    assert "ended on its own" in r.stdout
    assert "stopping" not in r.stderr
