"""Decode throughput on a captured real ledger stream, against references in the same run.

Starts a throwaway cluster, writes N single-event ledger transactions (Begin, Insert, Commit
each), captures the walsender's pgoutput bytes for them and decodes the same bytes with:

  ours → Structs       Decoder.decode: typed message Structs, raw tuple values
  ours → LedgerEvent   the same plus values loaded (psycopg loaders) and payload decoded (msgspec)
  pypgoutput           its decoders on the same bytes (reference)
  construct            the interpreted grammar on the same bytes (reference)

Prints messages/s (and events/s) of CPU time with the ratios to pypgoutput. Best of --repeat
runs, each reader's runs interleaved with the others' (a machine whose load changes during the
run changes every reader's best alike).

    sh scripts/dev.sh bench decode [--events 30000] [--pg-major 15]
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable

import psycopg
from common import init_db

from ledger_cdc.admin.schema import create_slot
from ledger_cdc.demo.embedded import EmbeddedPostgres
from ledger_cdc.pgoutput import Decoder, Insert, Relation
from ledger_cdc.pgoutput.spec import MESSAGE
from ledger_cdc.stream.ledger import LedgerRowDecoder

WRITE = """
CREATE PROCEDURE bench_write(n int) LANGUAGE plpgsql AS $$
BEGIN
    FOR i IN 1..n LOOP
        INSERT INTO agent_events (session_id, agent_id, event_type, payload)
        VALUES (('00000000-0000-4000-8000-' || lpad((i % 1000)::text, 12, '0'))::uuid,
                'agent-' || (i % 7), 'tool.invoked',
                jsonb_build_object('call_id', 'call-' || i, 'tool', 'search', 'arguments',
                                   jsonb_build_object('q', 'quarterly numbers', 'k', i)));
        COMMIT;
    END LOOP;
END $$;
"""


def capture(events: int, major: int | None) -> tuple[int, list[tuple[int, bytes]]]:
    with EmbeddedPostgres(major=major) as pg:
        init_db(pg.dsn())
        with psycopg.connect(pg.dsn(), autocommit=True) as conn:
            create_slot(conn, "bench")
            conn.execute(WRITE)
            conn.execute("CALL bench_write(%s)", (events,))
            rows = conn.execute(
                "SELECT lsn::text, data FROM pg_logical_slot_get_binary_changes('bench', NULL, "
                "NULL, 'proto_version', '1', 'publication_names', 'agent_pub')"
            ).fetchall()
        out = []
        for lsn, data in rows:
            hi, lo = lsn.split("/")
            out.append(((int(hi, 16) << 32) | int(lo, 16), bytes(data)))
        return pg.major, out


def best(fns: list[Callable[[], int]], repeat: int) -> list[tuple[float, int]]:
    """Each function's best CPU time of ``repeat`` runs (and what it counted), the runs taken
    in turn: one of each, then again. CPU time, not wall time: the decoders are single-threaded
    and CPU-bound, and on a shared machine the wall clock also counts the other processes'
    turns on the core."""
    times: list[list[float]] = [[] for _ in fns]
    counts = [0] * len(fns)
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            gc.collect()
            t0 = time.process_time()
            counts[i] = fn()
            times[i].append(time.process_time() - t0)
    return [(min(t), n) for t, n in zip(times, counts, strict=True)]


def main() -> None:
    ap = argparse.ArgumentParser(description="pgoutput decode throughput")
    ap.add_argument("--events", type=int, default=30000)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--pg-major", type=int, default=None)
    args = ap.parse_args()
    major, stream = capture(args.events, args.pg_major)
    n_msgs = len(stream)

    def ours() -> int:
        d = Decoder()
        dec = d.decode
        for lsn, data in stream:
            dec(data, lsn)
        return n_msgs

    def ours_events() -> int:
        d = Decoder()
        dec = d.decode
        rows: dict[int, LedgerRowDecoder] = {}
        n = 0
        for lsn, data in stream:
            m = dec(data, lsn)
            if type(m) is Insert:
                rows[m.relation_id].event(m.new, lsn)
                n += 1
            elif type(m) is Relation:
                rows[m.relation_id] = LedgerRowDecoder(m)
        return n

    def pypgoutput_ref() -> int:
        from pypgoutput import decoders as pd

        classes = {b"B": pd.Begin, b"C": pd.Commit, b"R": pd.Relation, b"I": pd.Insert}
        for _, data in stream:
            classes[data[:1]](data)
        return n_msgs

    def construct_ref() -> int:
        parse = MESSAGE.parse
        for _, data in stream:
            parse(data, in_stream=False, parallel=False)
        return n_msgs

    (t_ours, _), (t_ev, n_ev), (t_pg, _) = best([ours, ours_events, pypgoutput_ref], args.repeat)
    ((t_c, _),) = best([construct_ref], 1)
    r_ours, r_pg, r_c = n_msgs / t_ours, n_msgs / t_pg, n_msgs / t_c
    print(
        f"PostgreSQL {major}: {n_msgs} pgoutput messages ({n_ev} single-event transactions: "
        "Begin, Insert, Commit)"
    )
    print(f"  ours → Structs        {r_ours:>11,.0f} msg/s   {r_ours / r_pg:5.1f}× pypgoutput")
    r_ev = n_msgs / t_ev
    print(
        f"  ours → LedgerEvent    {r_ev:>11,.0f} msg/s   {r_ev / r_pg:5.1f}× pypgoutput   "
        f"{n_ev / t_ev:>9,.0f} events/s (values loaded, payload typed)"
    )
    print(f"  pypgoutput            {r_pg:>11,.0f} msg/s   1.0× (reference)")
    print(f"  construct grammar     {r_c:>11,.0f} msg/s   {r_c / r_pg:5.2f}× pypgoutput")


if __name__ == "__main__":
    main()
