"""JetStream fan-out against real nats-server processes: crash of the consumer, and a three-node
cluster with a replicated stream that loses a node mid-run. A durable consumer receives every
event exactly once, per session in position order."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import psycopg

from ledger_cdc.jetstream import JetStreamPublisher, JetStreamSettings
from ledger_cdc.replay import load_events
from tests.cdc import ConsumerProcess, Writers, until, wait_caught_up
from tests.conftest import Database
from tests.natsserver import NatsServer, cluster, read_all, wait_jetstream


def _check_exactly_once(db: Database, servers: list[str]) -> int:
    msgs = read_all(servers, "ledger.events.*")
    got = [json.loads(m.data) for m in msgs]
    keys = [(g["session_id"], g["position"]) for g in got]
    assert len(keys) == len(set(keys)), "an event was delivered twice"
    with psycopg.connect(db.dsn) as conn:
        want = {
            (str(e.session_id), e.position)
            for e in load_events(conn)
            if not isinstance(e, Exception)
        }
    assert set(keys) == want, f"missing {len(want - set(keys))}, extra {len(set(keys) - want)}"
    order: dict[str, list[int]] = defaultdict(list)
    for sid, pos in keys:
        order[sid].append(pos)
    assert all(p == sorted(p) for p in order.values()), "a session's events out of order"
    for m, g in zip(msgs, got, strict=True):
        assert m.subject == f"ledger.events.{g['session_id']}"
        assert m.headers["Nats-Msg-Id"] == f"agent_slot:ev:{g['session_id']}:{g['position']}"
    return len(keys)


def test_publisher_waits_for_acks_and_the_server_drops_a_republished_batch(tmp_path: Path) -> None:
    srv = NatsServer(tmp_path / "js")
    try:
        wait_jetstream([srv.url])
        pub = JetStreamPublisher(JetStreamSettings.from_url(srv.url), "agent_slot")
        import datetime as dt

        from ledger_cdc.events import LedgerEvent, ToolInvoked

        sid = uuid.uuid4()
        now = dt.datetime.now(dt.timezone.utc)
        batch = [
            (LedgerEvent(i, sid, i, "a", "tool.invoked", ToolInvoked(f"c{i}", "t"), now), 0x16B3A40)
            for i in range(1, 6)
        ]
        pub.publish(batch, [(sid, 5, b'{"session_id": "x"}')])
        pub.publish(batch, [(sid, 5, b'{"session_id": "x"}')])  # a crash, then the same batch again
        pub.close()
        events = read_all([srv.url], "ledger.events.*")
        assert [json.loads(m.data)["position"] for m in events] == [1, 2, 3, 4, 5]
        assert json.loads(events[0].data)["commit_lsn"] == "0/16B3A40"
        assert len(read_all([srv.url], "ledger.sessions.*", durable="s")) == 1
    finally:
        srv.kill()


def test_consumer_crash_republishes_without_duplicates(db: Database, tmp_path: Path) -> None:
    srv = NatsServer(tmp_path / "js")
    consumer = None
    try:
        wait_jetstream([srv.url])
        # every start as a deployment would give it: a kill may land before the slot exists
        args = ("--create-slot", "--sink", "postgres", "--sink", srv.url, "--max-delay-ms", "5")
        consumer = ConsumerProcess(db.dsn, *args, log=tmp_path / "c.log").start()
        writers = Writers(db.dsn, n=3, pace=0.005).start()
        try:
            for _ in range(3):  # SIGKILL mid-stream, three times
                until(lambda: writers.turns > 0, timeout=30)
                time.sleep(1.0)
                consumer.kill()
                consumer = ConsumerProcess(db.dsn, *args, log=tmp_path / "c.log").start()
        finally:
            writers.stop()
        wait_caught_up(db.dsn, timeout=90)
        assert _check_exactly_once(db, [srv.url]) > 50
    finally:
        if consumer is not None:
            consumer.kill()
        srv.kill()


def test_three_node_cluster_loses_a_node_mid_run(db: Database, tmp_path: Path) -> None:
    nodes = cluster(tmp_path / "cluster", 3)
    consumer = None
    try:
        urls = [n.url for n in nodes]
        wait_jetstream(urls)
        sink = ",".join(urls) + "?replicas=3"
        consumer = ConsumerProcess(
            db.dsn, "--create-slot", "--sink", sink, log=tmp_path / "c.log"
        ).start()
        writers = Writers(db.dsn, n=3, pace=0.005).start()
        try:
            until(lambda: writers.turns > 100, timeout=60)
            nodes[1].kill()  # one of three replicas gone: the stream keeps its quorum
            turns = writers.turns
            until(lambda: writers.turns > turns + 100, timeout=60)
            assert consumer.alive()
        finally:
            writers.stop()
        wait_caught_up(db.dsn, timeout=180)  # what the projections hold JetStream acknowledged
        alive = [n.url for n in nodes if n.proc.poll() is None]
        assert _check_exactly_once(db, alive) > 100
        info = _stream_info(alive)
        assert info["config"]["num_replicas"] == 3
    finally:
        if consumer is not None:
            consumer.kill()
        for n in nodes:
            n.kill()


def _stream_info(servers: list[str]) -> dict[str, Any]:
    import nats

    async def go() -> dict[str, Any]:
        nc = await nats.connect(servers=servers)
        try:
            si = await nc.jetstream().stream_info("LEDGER")
            return {"config": {"num_replicas": si.config.num_replicas}}
        finally:
            await nc.close()

    return asyncio.run(go())
