"""8 worker processes race for 100 pending runs; one is SIGKILLed while it holds leases. Every
run is leased once (twice for those taken over after the kill), finishes once, and every tool
call reaches the HTTP target under its one idempotency key."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import uuid

from ledger_cdc.client.runs import submit
from tests.support.cdc import ROOT, ConsumerProcess, until, wait_caught_up
from tests.support.cli import Output
from tests.support.harness import Database
from tests.support.httptarget import Target


def _worker(db: Database, name: str, url: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.support.runworker",
            db.dsn,
            name,
            url,
            "--ttl",
            "2",
            "--concurrency",
            "4",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def test_workers_race_and_take_over_the_runs_of_a_killed_worker(db: Database) -> None:
    runs = [uuid.uuid4() for _ in range(100)]
    with ConsumerProcess(db.dsn, "--create-slot") as consumer, Target(delay=0.3) as target:
        with db.connect() as conn:
            until(
                lambda: (
                    conn.execute(
                        "SELECT EXISTS (SELECT FROM pg_replication_slots WHERE active)"
                    ).fetchone()
                    == (True,)
                )
            )
            for sid in runs:
                submit(conn, sid)
        wait_caught_up(db.dsn)
        first = _worker(db, "w0", target.url)
        workers = [first]
        try:
            with db.connect() as conn:

                def held() -> list[uuid.UUID]:
                    return [
                        s
                        for (s,) in conn.execute(
                            "SELECT session_id FROM agent_events e WHERE event_type = 'tool.invoked' "
                            "AND agent_id = 'w0' AND NOT EXISTS (SELECT FROM agent_events d WHERE "
                            "d.session_id = e.session_id AND d.event_type = 'task.completed')"
                        )
                    ]

                until(lambda: len(held()) >= 2, timeout=30)
                workers += [_worker(db, f"w{i}", target.url) for i in range(1, 8)]
                outputs = [Output(w.stdout) for w in workers[1:] if w.stdout is not None]
                until(lambda: target.first_request.is_set(), timeout=30)
                first.send_signal(signal.SIGKILL)  # mid-call: its leases are left to expire
                first.wait(10)
                in_flight = set(held())  # invoked by w0, never completed
                assert in_flight, "the killed worker held no run"

                def finished() -> int:
                    row = conn.execute(
                        "SELECT count(*) FROM agent_events WHERE event_type = 'task.completed'"
                    ).fetchone()
                    return int(row[0]) if row else 0

                def idle() -> bool:  # no live worker holds a run it leased
                    return all(
                        o.text.count("\nleased ") == o.text.count("\ndone ") for o in outputs
                    )

                # every run completed, and every run a live worker leased is done with: nothing
                # is still racing to complete one again
                until(lambda: finished() >= 100 and idle(), timeout=120)
                assert finished() == 100  # each run completed once
                leases = collections.defaultdict(list)
                for sid, worker in conn.execute(
                    "SELECT session_id, agent_id FROM agent_events WHERE event_type = 'run.leased' "
                    "ORDER BY seq"
                ):
                    leases[sid].append(worker)
                completed_by = dict(
                    conn.execute(
                        "SELECT session_id, agent_id FROM agent_events WHERE event_type = 'task.completed'"
                    ).fetchall()
                )
                orphaned = {s for s in runs if leases[s][0] == "w0" and completed_by[s] != "w0"}
                assert in_flight <= orphaned
                for sid in runs:
                    holders = leases[sid]
                    if sid in orphaned:  # taken over once, by a live worker
                        assert holders[0] == "w0" and len(holders) == 2 and holders[1] != "w0", (
                            holders
                        )
                    else:
                        assert len(holders) == 1, holders
                # one key per run; only calls in flight at the kill were sent twice
                keys = {f"{sid}:tool" for sid in runs}
                assert set(target.seen) == keys
                twice = {k for k, n in target.seen.items() if n > 1}
                assert all(n <= 2 for n in target.seen.values())
                assert twice <= {f"{sid}:tool" for sid in orphaned}
                retried = {
                    s
                    for (s,) in conn.execute(
                        "SELECT session_id FROM agent_events WHERE idempotency_key LIKE '%%#retry-1'"
                    )
                }
                assert retried == in_flight  # each take-over of a call in flight logged its retry
        finally:
            for w in workers:
                if w.poll() is None:
                    w.kill()
                w.wait(10)
        assert consumer.alive()
