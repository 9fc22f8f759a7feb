"""Writer throughput under each ``synchronous_commit`` choice, on the ledger's own workload.

8 pgbench clients insert single-event ledger transactions (position trigger and hash chain
included, fsync on) for ``--seconds`` per mode, with the consumer streaming the slot meanwhile,
as in production. Modes: ``on`` (wait for the local WAL flush — and for a synchronous standby if
one is configured), ``local`` (the local flush only), ``off`` (no wait: a server crash can lose
the last ~3× wal_writer_delay of acknowledged commits, never corrupt or reorder them). The
reference is ``on``, measured in the same run.

    sh scripts/dev.sh bench commit_modes [--seconds 8] [--pg-major 15]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from common import PGBENCH_SCRIPT, ROOT, init_db, pgbench_argv

from ledger_cdc.demo.embedded import EmbeddedPostgres


def main() -> None:
    ap = argparse.ArgumentParser(description="synchronous_commit benchmark")
    ap.add_argument("--seconds", type=int, default=8)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--pg-major", type=int, default=None)
    args = ap.parse_args()
    with (
        EmbeddedPostgres(major=args.pg_major, fsync=True) as pg,
        tempfile.TemporaryDirectory() as tmp,
    ):
        dsn = pg.dsn()
        init_db(dsn, slot="agent_slot")
        script = Path(tmp) / "insert.sql"
        script.write_text(PGBENCH_SCRIPT)
        os.chmod(tmp, 0o755)
        os.chmod(script, 0o644)
        consumer = subprocess.Popen(
            [sys.executable, "-m", "ledger_cdc", "consume", "--dsn", dsn, "--log-format", "text"],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        results = {}
        try:
            for mode in ("on", "local", "off"):
                argv = pgbench_argv(pg, script, args.clients, args.seconds)
                env = {**os.environ, "PGOPTIONS": f"-c synchronous_commit={mode}"}
                res = subprocess.run(argv, capture_output=True, text=True, check=True, env=env)
                m = re.search(r"tps = ([\d.]+)", res.stdout)
                lat = re.search(r"latency average = ([\d.]+) ms", res.stdout)
                results[mode] = (
                    float(m.group(1)) if m else float("nan"),
                    float(lat.group(1)) if lat else float("nan"),
                )
        finally:
            consumer.terminate()
            consumer.wait(30)
    ref = results["on"][0]
    print(
        f"PostgreSQL {pg.major}: {args.clients} clients, single-event transactions, fsync on, "
        f"{args.seconds} s per mode, consumer streaming"
    )
    for mode, (tps, lat) in results.items():
        print(
            f"synchronous_commit={mode:<5}  {tps:8,.0f} txn/s  latency {lat:6.2f} ms  "
            f"{tps / ref:4.2f}x of 'on'"
        )


if __name__ == "__main__":
    main()
