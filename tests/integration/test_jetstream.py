"""JetStream fan-out against real nats-server processes: crash of the consumer, and a three-node
cluster with a replicated stream that loses a node mid-run. A durable consumer receives every
event exactly once, per session in position order."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from ledger_cdc.admin.schema import create_slot
from ledger_cdc.client.recovery import load_events
from ledger_cdc.sink.jetstream import JetStreamPublisher, JetStreamSettings
from tests.support.cdc import ConsumerProcess, Writers, until, wait_caught_up
from tests.support.cli import run_cli_process
from tests.support.harness import Database
from tests.support.natsserver import (
    NatsServer,
    cluster,
    jetstream_server,
    read_all,
    stream_config,
    wait_jetstream,
)


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


def _tool_events(sid: uuid.UUID, results: list[str]) -> list[Any]:
    import datetime as dt

    from ledger_cdc.events import LedgerEvent, ToolObserved

    now = dt.datetime.now(dt.timezone.utc)
    return [
        (LedgerEvent(i, sid, i, "a", "tool.observed", ToolObserved(f"c{i}", r), now), 0x1000 + i)
        for i, r in enumerate(results, 1)
    ]


def test_a_message_over_the_servers_max_payload_goes_without_its_body(tmp_path: Path) -> None:
    """An event (or projection) larger than the server's max_payload would make the server
    close the connection at every retry, stopping the fan-out for good. It is published in
    its place without its payload, marked, and the stream goes on; tail reads it from
    agent_events, or says why it cannot."""
    from ledger_cdc.client.tail import follow_jetstream
    from ledger_cdc.events import LedgerEvent, Rejected

    srv = NatsServer(tmp_path / "js", config="max_payload: 4096\n")
    try:
        wait_jetstream([srv.url])
        settings = JetStreamSettings.from_url(srv.url)
        pub = JetStreamPublisher(settings, "agent_slot")
        sid = uuid.uuid4()
        batch = _tool_events(sid, ["small", "x" * 10_000, "after"])
        pub.publish(batch, [(sid, 3, b'{"big": "' + b"y" * 10_000 + b'"}')])
        pub.publish(_tool_events(sid, ["a", "b", "c", "d"])[3:], [])  # the connection is fine
        pub.close()
        events = read_all([srv.url], "ledger.events.*")
        bodies = [json.loads(m.data) for m in events]
        assert [b["position"] for b in bodies] == [1, 2, 3, 4]
        assert (
            bodies[0]["payload"]["result"] == "small" and bodies[2]["payload"]["result"] == "after"
        )
        assert bodies[1]["payload"] is None and bodies[1]["omitted"] > 10_000
        assert events[1].headers["Ledger-Omitted"] == str(bodies[1]["omitted"])
        assert "Ledger-Omitted" not in (events[0].headers or {})
        (ctx,) = read_all([srv.url], "ledger.sessions.*", durable="s")
        assert ctx.data == b"{}" and int(ctx.headers["Ledger-Omitted"]) > 10_000

        async def first_three() -> list[Any]:
            got = []
            async for ev in follow_jetstream(settings, sid):
                got.append(ev)
                if len(got) == 3:
                    return got
            return got

        got = asyncio.run(asyncio.wait_for(first_three(), 60))
        assert isinstance(got[0], LedgerEvent) and isinstance(got[2], LedgerEvent)
        assert isinstance(got[1], Rejected) and "--dsn" in got[1].reason
    finally:
        srv.kill()


def test_a_refused_publish_fails_the_batch_at_once_and_the_next_one_works(
    tmp_path: Path,
) -> None:
    """The server answers a publish nobody stores (the stream was deleted) with a status, not
    silence: the batch fails with that reason at once, not after ack_timeout, and the next
    attempt creates the stream again."""
    from ledger_cdc.errors import JetStreamError

    srv = NatsServer(tmp_path / "js")
    try:
        wait_jetstream([srv.url])
        pub = JetStreamPublisher(
            JetStreamSettings.from_url(srv.url + "?ack_timeout=120"), "agent_slot"
        )
        sid = uuid.uuid4()
        batch = _tool_events(sid, ["a", "b", "c"])
        pub.publish(batch[:1], [])

        async def delete() -> None:
            import nats

            nc = await nats.connect(srv.url)
            await nc.jetstream().delete_stream("LEDGER")
            await nc.close()

        asyncio.run(delete())
        began = time.monotonic()
        with pytest.raises(JetStreamError, match="no JetStream stream"):
            pub.publish(batch[1:2], [])
        assert time.monotonic() - began < 60  # the answer, not the 120 s timeout
        pub.publish(batch[1:], [])
        pub.close()
        assert [json.loads(m.data)["position"] for m in read_all([srv.url], "ledger.events.*")] == [
            2,
            3,
        ]
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


def test_a_batch_republished_after_the_duplicate_window_is_not_duplicated(tmp_path: Path) -> None:
    """Past the duplicate window the server no longer drops a copy: a restarted publisher (a
    new object, as after a crash) reads each subject's last position and skips what is there."""
    import datetime as dt

    from ledger_cdc.events import LedgerEvent, ToolInvoked

    srv = NatsServer(tmp_path / "js")
    try:
        wait_jetstream([srv.url])
        url = srv.url + "?duplicate_window=0.5"
        sids, now = [uuid.uuid4() for _ in range(30)], dt.datetime.now(dt.timezone.utc)
        # each event its own commit, in commit order; a projection carries its session's last
        # commit, so the batch's last messages (projections) have lower LSNs than its last event
        batch = [
            (LedgerEvent(i, sid, pos, "a", "tool.invoked", ToolInvoked(f"c{i}", "t"), now), i)
            for pos in range(1, 21)
            for i, sid in enumerate(sids, start=pos * 100)
        ]
        lsn_of = {(ev.session_id, ev.position): lsn for ev, lsn in batch}
        first = JetStreamPublisher(JetStreamSettings.from_url(url), "agent_slot")
        first.publish(
            batch[:450], [(sid, 15, b"{}", lsn_of[(sid, 15)]) for sid in reversed(sids)]
        )  # then a crash before the checkpoint
        assert first.heads_read == 0  # an empty stream: nothing to look up
        first.close()
        time.sleep(2.0)  # four duplicate windows
        again = JetStreamPublisher(JetStreamSettings.from_url(url), "agent_slot")
        again.publish(batch, [(sid, 20, b"{}", lsn_of[(sid, 20)]) for sid in sids])  # republish
        assert again.skipped == 450 and again.published == len(batch) - 450 + 30
        heads_read = again.heads_read
        later = [
            (LedgerEvent(i, sid, 21, "a", "tool.invoked", ToolInvoked(f"d{i}", "t"), now), 9000 + i)
            for i, sid in enumerate(sids)
        ]
        again.publish(later, [])  # commits after everything in the stream: no lookup
        assert again.heads_read == heads_read
        again.publish(batch[-30:], [])  # and nothing is published twice on one connection
        assert again.skipped == 480
        again.close()
        events = read_all([srv.url], "ledger.events.*")
        keys = [(json.loads(m.data)["session_id"], json.loads(m.data)["position"]) for m in events]
        assert len(keys) == len(set(keys)) == len(batch) + len(later)
        per: dict[str, list[int]] = defaultdict(list)
        for sid, pos in keys:
            per[sid].append(pos)
        assert all(v == list(range(1, 22)) for v in per.values())
        ctx = read_all([srv.url], "ledger.sessions.*", durable="ctx")
        assert len(ctx) == 2 * len(sids)  # position 15, then 20: each once
    finally:
        srv.kill()


def test_a_shorter_replay_after_a_crash_does_not_hide_what_the_stream_holds(
    tmp_path: Path,
) -> None:
    """A restart may replay a shorter batch than the one a crashed publisher stored (its batches
    end elsewhere). What the stream's last message says it may hold must not go down, or the
    restart after that would publish again what is there."""
    import datetime as dt

    from ledger_cdc.events import LedgerEvent, ToolInvoked

    srv = NatsServer(tmp_path / "js")
    try:
        wait_jetstream([srv.url])
        url = srv.url + "?duplicate_window=0.5"
        sids, now = [uuid.uuid4() for _ in range(2)], dt.datetime.now(dt.timezone.utc)
        # one session's events commit first, the other's after (what a lookup by subject sees
        # depends on the LSN ranges: the second session has only later commits)
        events = [
            (
                LedgerEvent(
                    i,
                    sids[0] if i < 200 else sids[1],
                    1 + (i if i < 200 else i - 200),
                    "a",
                    "tool.invoked",
                    ToolInvoked(f"c{i}", "t"),
                    now,
                ),
                100 + i,
            )
            for i in range(600)
        ]
        first = JetStreamPublisher(JetStreamSettings.from_url(url), "agent_slot")
        first.publish(events, [])  # stored; its checkpoint was not
        first.close()
        second = JetStreamPublisher(JetStreamSettings.from_url(url), "agent_slot")
        # the restart's first batch ends earlier, and carries a projection the stream lacks
        second.publish(events[:200], [(sids[0], 200, b"{}", 299)])
        assert second.published == 1 and second.skipped == 200
        second.close()
        time.sleep(2.0)  # past the duplicate window
        third = JetStreamPublisher(JetStreamSettings.from_url(url), "agent_slot")
        third.publish(events, [])
        assert third.published == 0 and third.skipped == 600
        third.close()
        keys = [
            (json.loads(m.data)["session_id"], json.loads(m.data)["position"])
            for m in read_all([srv.url], "ledger.events.*")
        ]
        assert len(keys) == len(set(keys)) == 600
    finally:
        srv.kill()


@pytest.mark.one_server  # the same on every PostgreSQL: run once, on the newest
def test_consumer_restarted_after_several_windows_publishes_nothing_twice(
    db: Database, tmp_path: Path
) -> None:
    srv = NatsServer(tmp_path / "js")
    consumer = None
    try:
        wait_jetstream([srv.url])
        sink = srv.url + "?duplicate_window=0.5"
        args = ("--create-slot", "--sink", "postgres", "--sink", sink, "--max-delay-ms", "5")
        consumer = ConsumerProcess(db.dsn, *args, log=tmp_path / "c.log").start()
        writers = Writers(db.dsn, n=3, pace=0.005).start()
        try:
            for _ in range(3):  # SIGKILL mid-stream, then down for four windows
                until(lambda: writers.turns > 0, timeout=30)
                time.sleep(1.0)
                consumer.kill()
                time.sleep(2.0)
                consumer = ConsumerProcess(db.dsn, *args, log=tmp_path / "c.log").start()
        finally:
            writers.stop()
        wait_caught_up(db.dsn, timeout=90)
        assert _check_exactly_once(db, [srv.url]) > 50
    finally:
        if consumer is not None:
            consumer.kill()
        srv.kill()


@pytest.mark.one_server  # the same on every PostgreSQL: run once, on the newest
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
    import nats.errors
    import nats.js.errors

    async def go() -> dict[str, Any]:
        nc = await nats.connect(servers=servers)
        deadline = time.monotonic() + 60
        try:
            while True:  # a stream whose leader is being elected answers 503 for a while
                try:
                    si = await nc.jetstream().stream_info("LEDGER")
                    return {"config": {"num_replicas": si.config.num_replicas}}
                except (nats.errors.TimeoutError, nats.js.errors.APIError):
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.5)
        finally:
            await nc.close()

    return asyncio.run(go())


@pytest.mark.parametrize("nodes", [1, 3])
def test_the_publisher_recovers_from_a_server_killed_mid_batch(tmp_path: Path, nodes: int) -> None:
    """The smallest form of a lost acknowledgement: a 10,000-message batch (a fast-ingest
    batch), a server killed 50 ms in and restarted (the only one, or one of an R3 cluster).
    Later publishes work (no publish slot is left behind) and the stream holds each message
    once."""
    import datetime as dt

    from ledger_cdc.errors import JetStreamError
    from ledger_cdc.events import LedgerEvent, ToolInvoked

    servers = [NatsServer(tmp_path / "js")] if nodes == 1 else cluster(tmp_path / "cluster", 3)
    srv = servers[0]
    urls = [n.url for n in servers]
    try:
        wait_jetstream(urls)
        opts = "?ack_timeout=3" + ("&replicas=3" if nodes == 3 else "")
        pub = JetStreamPublisher(JetStreamSettings.from_url(",".join(urls) + opts), "agent_slot")
        sid, now = uuid.uuid4(), dt.datetime.now(dt.timezone.utc)
        batch = [
            (LedgerEvent(i, sid, i, "a", "tool.invoked", ToolInvoked(f"c{i}", "t"), now), 1)
            for i in range(1, 10_001)
        ]
        pub.publish(batch[:1], [])
        failed: list[BaseException] = []

        def publish_all() -> None:
            try:
                pub.publish(batch, [])
            except JetStreamError as e:
                failed.append(e)

        t = threading.Thread(target=publish_all)
        t.start()
        time.sleep(0.05)  # the point of the test: a kill 50 ms into the batch
        srv.restart()
        t.join(60)
        assert not t.is_alive()
        wait_jetstream(urls)
        # what a consumer does next: publish the same batch again (same message ids)
        until(lambda: _republish(pub, batch), timeout=90)
        assert pub.fast_batches >= 1
        pub.close()
        events = read_all(urls, "ledger.events.*")
        assert [json.loads(m.data)["position"] for m in events] == list(range(1, 10_001))
    finally:
        for n in servers:
            n.kill()


@pytest.fixture
def srv(tmp_path: Path) -> Iterator[NatsServer]:
    """A nats-server with JetStream, answering, killed after the test."""
    with jetstream_server(tmp_path / "js") as srv:
        yield srv


def _events(sid: uuid.UUID, first: int, last: int) -> list[Any]:
    import datetime as dt

    from ledger_cdc.events import LedgerEvent, ToolInvoked

    now = dt.datetime.now(dt.timezone.utc)
    return [
        (LedgerEvent(i, sid, i, "a", "tool.invoked", ToolInvoked(f"c{i}", "t"), now), 100 + i)
        for i in range(first, last + 1)
    ]


def _positions(urls: list[str], durable: str) -> list[int]:
    return [json.loads(m.data)["position"] for m in read_all(urls, "ledger.events.*", durable)]


def _stream_config(url: str, **change: Any) -> dict[str, Any]:
    """The LEDGER stream's config (after ``change``, when given) as the server reports it."""
    return {"allow_batched": bool(stream_config(url, **change).allow_batched)}


def _duplicate_window(url: str) -> float:
    return float(stream_config(url).duplicate_window or 0)


def test_a_stream_keeps_the_settings_the_url_does_not_name(srv: NatsServer) -> None:
    """An existing stream is updated to the options its URL names, and keeps those it does
    not: a URL without ``duplicate_window`` (or ``replicas``) does not put an operator's
    setting back to the default."""
    sid = uuid.uuid4()
    first = JetStreamPublisher(
        JetStreamSettings.from_url(srv.url + "?duplicate_window=300"), "agent_slot"
    )
    first.publish(_events(sid, 1, 2), [])
    first.close()
    assert _duplicate_window(srv.url) == 300
    plain = JetStreamPublisher(JetStreamSettings.from_url(srv.url), "agent_slot")
    plain.publish(_events(sid, 3, 4), [])
    plain.close()
    assert _duplicate_window(srv.url) == 300  # not the default 120
    named = JetStreamPublisher(
        JetStreamSettings.from_url(srv.url + "?duplicate_window=30"), "agent_slot"
    )
    named.publish(_events(sid, 5, 6), [])
    named.close()
    assert _duplicate_window(srv.url) == 30
    assert _positions([srv.url], "a") == list(range(1, 7))


def test_a_large_batch_goes_as_one_fast_ingest_batch_and_a_small_one_message_by_message(
    srv: NatsServer,
) -> None:
    """A batch of hundreds of messages is one fast-ingest batch (the server acknowledges every
    few hundred, not each); a batch of a few messages is acknowledged message by message (no
    round trip more). Both land in order, once."""
    pub = JetStreamPublisher(JetStreamSettings.from_url(srv.url), "agent_slot")
    sid = uuid.uuid4()
    pub.publish(_events(sid, 1, 1500), [(sid, 1500, b"{}", 1600)])
    assert (pub.fast_batches, pub.fast_published, pub.published) == (1, 1501, 1501)
    pub.publish(_events(sid, 1501, 1503), [])
    assert (pub.fast_batches, pub.published) == (1, 1504)
    pub.close()
    assert _stream_config(srv.url) == {"allow_batched": True}
    assert _positions([srv.url], "a") == list(range(1, 1504))


def test_a_stream_made_without_batching_is_given_it_and_one_that_loses_it_still_gets_all(
    srv: NatsServer,
) -> None:
    """A stream made by an older release (no allow_batched) is updated to take fast-ingest
    batches. A stream whose batching is turned off under a running publisher refuses the first
    message of the next batch: that batch, and the ones after it, go message by message."""
    import nats
    from nats.js.api import StreamConfig

    async def make() -> None:
        nc = await nats.connect(srv.url)
        await nc.jetstream().add_stream(
            StreamConfig(name="LEDGER", subjects=["ledger.events.*", "ledger.sessions.*"])
        )
        await nc.close()

    asyncio.run(make())
    assert _stream_config(srv.url) == {"allow_batched": False}
    pub = JetStreamPublisher(JetStreamSettings.from_url(srv.url), "agent_slot")
    sid = uuid.uuid4()
    pub.publish(_events(sid, 1, 300), [])
    assert pub.fast_batches == 1 and _stream_config(srv.url) == {"allow_batched": True}
    _stream_config(srv.url, allow_batched=False)
    pub.publish(_events(sid, 301, 600), [])
    pub.publish(_events(sid, 601, 900), [])
    assert pub.fast_batches == 1 and pub.published == 900
    pub.close()
    assert _positions([srv.url], "a") == list(range(1, 901))


def test_fast_batches_sharing_the_stream_follow_the_servers_changing_ack_interval(
    srv: NatsServer,
) -> None:
    """The server starts a fast batch at an ack interval of 1 while another is open on the
    stream, doubles it as acknowledgements go, and halves it for each batch more: publishers
    (shards) sharing a stream, or one retrying beside a batch the server has not yet abandoned,
    send as much as the interval of the moment allows, never a range twice or a gap."""
    import nats

    pubs = [JetStreamPublisher(JetStreamSettings.from_url(srv.url), f"slot{k}") for k in range(3)]
    sids = [uuid.uuid4() for _ in pubs]
    pubs[0].publish(_events(sids[0], 1, 100), [])  # the stream exists, with batching

    async def open_a_batch() -> None:  # a batch left open (as by a crashed publisher)
        nc = await nats.connect(srv.url)
        inbox = nc.new_inbox()
        await nc.subscribe(inbox + ".>")
        await nc.publish("ledger.sessions.x", b"{}", reply=f"{inbox}.b1.500.fail.1.0.$FI")
        await nc.flush()
        await nc.close()

    asyncio.run(open_a_batch())
    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            for b in range(4):  # batches of 2,000 at once from three publishers
                pubs[k].publish(_events(sids[k], 101 + 2000 * b, 2100 + 2000 * b), [])
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert all(p.fast_batches >= 4 for p in pubs)
    for p in pubs:
        p.close()
    got: dict[str, list[int]] = defaultdict(list)
    for m in read_all([srv.url], "ledger.events.*"):
        body = json.loads(m.data)
        got[body["session_id"]].append(body["position"])
    assert dict(got) == {
        str(sid): list(range(1 if k == 0 else 101, 8101)) for k, sid in enumerate(sids)
    }


def test_batched_false_publishes_message_by_message_and_leaves_the_stream_as_it_is(
    srv: NatsServer,
) -> None:
    pub = JetStreamPublisher(JetStreamSettings.from_url(srv.url + "?batched=false"), "agent_slot")
    sid = uuid.uuid4()
    pub.publish(_events(sid, 1, 300), [])
    assert pub.fast_batches == 0 and pub.published == 300
    pub.close()
    assert _stream_config(srv.url) == {"allow_batched": False}
    assert _positions([srv.url], "a") == list(range(1, 301))


def test_a_fast_batch_holding_messages_the_stream_has_is_stored_once_and_succeeds(
    srv: NatsServer,
) -> None:
    """The server drops a message of a fast-ingest batch whose Nats-Msg-Id it has seen and
    still counts it in the batch (the publisher checks that count): a republished batch that
    overlaps what the stream holds succeeds, and nothing is stored twice."""
    sid = uuid.uuid4()
    first = JetStreamPublisher(JetStreamSettings.from_url(srv.url), "agent_slot")
    first.publish(_events(sid, 1, 200), [])
    first.close()
    again = JetStreamPublisher(JetStreamSettings.from_url(srv.url), "agent_slot")
    again.connect()
    # as if the stream's high-water mark were unknown to be past these: no subject is
    # looked up, the whole batch is sent, and the server's duplicate window drops 1 … 200
    again._known.high = 0
    again.publish(_events(sid, 1, 400), [])
    assert again.fast_batches == 1 and again.published == 400 and again.skipped == 0
    again.close()
    assert _positions([srv.url], "a") == list(range(1, 401))


def test_closing_the_publisher_is_not_logged_as_a_lost_connection(
    srv: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A consumer that stops closes its NATS connection: an info line, not the warning of a
    connection lost (every clean stop logged "NATS: disconnected" as a warning); a server that
    goes away still gets the warning."""
    caplog.set_level(logging.INFO, logger="ledger_cdc")
    pub = JetStreamPublisher(JetStreamSettings.from_url(srv.url), "agent_slot")
    pub.publish(_events(uuid.uuid4(), 1, 10), [])
    pub.close()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert "NATS: connection closed" in caplog.messages

    caplog.clear()
    lost = JetStreamPublisher(JetStreamSettings.from_url(srv.url), "agent_slot")
    lost.publish(_events(uuid.uuid4(), 1, 10), [])
    srv.kill()
    try:
        until(lambda: "NATS: disconnected" in caplog.messages, timeout=30)
    finally:
        lost.close()
    assert all(r.levelno == logging.WARNING for r in caplog.records if "disconnected" in r.msg)


def test_a_stop_gives_up_a_publish_the_server_does_not_answer_within_the_grace(
    db: Database, tmp_path: Path
) -> None:
    """SIGTERM while the NATS server is hung (SIGSTOP) and ack_timeout is 10 minutes: the
    consumer exits 0 within STOP_GRACE of the stop instead of waiting out the timeout (the
    events written meanwhile are a batch it cannot publish, under way or flushed by the stop),
    and checkpoints nothing it did not publish: started again with the server back, it
    publishes every event once."""
    from ledger_cdc.sink.jetstream import STOP_GRACE

    srv = NatsServer(tmp_path / "js")
    consumer = None
    try:
        wait_jetstream([srv.url])
        log = tmp_path / "c.log"
        args = ("--create-slot", "--sink", "postgres", "--sink", srv.url + "?ack_timeout=600")
        consumer = ConsumerProcess(db.dsn, *args, log=log).start()
        writers = Writers(db.dsn, n=2, pace=0.01).start()

        def published() -> bool:  # a batch committed: JetStream acknowledged it first
            with psycopg.connect(db.dsn) as conn:
                row = conn.execute("SELECT count(*) FROM agent_sessions").fetchone()
            return row is not None and row[0] > 0

        try:
            until(published, timeout=60)
            srv.hang()
            hung = writers.turns
            until(lambda: writers.turns > hung + 20, timeout=60)
        finally:
            writers.stop()
        began = time.monotonic()
        assert consumer.terminate(timeout=STOP_GRACE + 30) == 0
        took = time.monotonic() - began
        assert took < STOP_GRACE + 10, f"the stop took {took:.1f}s"
        assert "stopping: JetStream did not acknowledge" in log.read_text()
        srv.restart()
        wait_jetstream([srv.url])
        consumer = ConsumerProcess(db.dsn, *args, log=log).start()
        wait_caught_up(db.dsn, timeout=120)
        assert _check_exactly_once(db, [srv.url]) > 20
    finally:
        if consumer is not None:
            consumer.kill()
        srv.kill()


def test_a_server_out_of_reach_is_logged_once_per_half_minute_not_per_attempt(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """nats-py reports every failed connection attempt (two a second): the first is logged,
    the rest are counted into the next line, 30 s on."""
    from ledger_cdc.errors import JetStreamError
    from tests.support.natsserver import free_port

    caplog.set_level(logging.INFO, logger="ledger_cdc")
    port = free_port()
    pub = JetStreamPublisher(JetStreamSettings.from_url(f"nats://127.0.0.1:{port}"), "agent_slot")
    try:
        with pytest.raises(JetStreamError):
            pub.connect(timeout=4)
    finally:
        pub.close()
    # (its own lines only: the test need not be alone in the process)
    refused = [m for m in caplog.messages if m.startswith("NATS: ") and f", {port})" in m]
    assert len(refused) == 1, refused


def _republish(pub: JetStreamPublisher, batch: list[Any]) -> bool:
    from ledger_cdc.errors import JetStreamError

    try:
        pub.publish(batch, [])
    except JetStreamError:
        return False
    return True


@pytest.mark.parametrize("nodes", [1, 3])
def test_a_hung_node_killed_and_restarted_never_stops_the_consumer(
    db: Database, tmp_path: Path, nodes: int
) -> None:
    """A NATS node (of one, or of an R3 cluster) is hung by SIGSTOP mid-run, then killed and
    restarted: the consumer goes on within a bounded time (projections, checkpoint and the
    stream advance again) and the stream holds every event exactly once."""
    servers = [NatsServer(tmp_path / "js")] if nodes == 1 else cluster(tmp_path / "cluster", 3)
    consumer = None
    try:
        urls = [n.url for n in servers]
        wait_jetstream(urls)
        sink = ",".join(urls) + ("?replicas=3&ack_timeout=5" if nodes == 3 else "?ack_timeout=5")
        consumer = ConsumerProcess(
            db.dsn, "--create-slot", "--sink", "postgres", "--sink", sink, log=tmp_path / "c.log"
        ).start()
        writers = Writers(db.dsn, n=3, pace=0.01).start()
        try:
            until(lambda: writers.turns > 50, timeout=60)
            victim = servers[0]
            victim.hang()
            hung = writers.turns
            until(lambda: writers.turns > hung + 30, timeout=60)  # hung for a while under load
            victim.restart()
            wait_jetstream(urls)
            restarted = writers.turns
            until(lambda: writers.turns > restarted + 30, timeout=60)
            assert consumer.alive()
        finally:
            writers.stop()
        # bounded: caught up well within the time the publisher's timeouts and backoff allow
        wait_caught_up(db.dsn, timeout=120)
        assert _check_exactly_once(db, urls) > 50
        log = (tmp_path / "c.log").read_text()
        assert "Traceback" not in log, log[-3000:]
    finally:
        if consumer is not None:
            consumer.kill()
        for n in servers:
            n.kill()


def test_shards_sharing_a_stream_republish_nothing_twice_past_the_window(
    srv: NatsServer,
) -> None:
    """Two shards share the stream; one that is behind publishes last, its mark lower than what
    the other stored before dying uncheckpointed: that other, restarted past the duplicate
    window, must not take the lower mark for its own and republish what the stream holds."""
    url = srv.url + "?duplicate_window=0.5"
    early, late, theirs = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    events = [(ev, 1000 + lsn) for ev, lsn in _events(early, 1, 5)]  # LSNs 1101..1105
    events += [(ev, 1005 + lsn) for ev, lsn in _events(late, 1, 5)]  # LSNs 1106..1110
    b = JetStreamPublisher(JetStreamSettings.from_url(url), "agent_slot_s1")
    b.connect()  # shard 1 up first, the stream empty then
    a = JetStreamPublisher(JetStreamSettings.from_url(url), "agent_slot_s0")
    a.publish(events, [])  # stored; then shard 0 dies before its checkpoint
    a.close()
    b.publish([(ev, 1105) for ev, _ in _events(theirs, 1, 1)], [])  # behind: marks 1105
    b.close()
    time.sleep(2.0)  # four duplicate windows
    again = JetStreamPublisher(JetStreamSettings.from_url(url), "agent_slot_s0")
    again.publish(events, [])
    again.close()
    assert again.published == 0 and again.skipped == 10
    assert sorted(_positions([srv.url], "check")) == sorted([1, *range(1, 6), *range(1, 6)])


def test_a_stream_whose_settings_cannot_change_stops_consume_before_any_event(
    db: Database, srv: NatsServer
) -> None:
    """The stream is made or checked when the consumer starts, not at its first event: a
    single node refuses replicas=3, and consume says so at once, in one line, exit 4."""
    with db.connect() as conn:
        create_slot(conn, "agent_slot")
    made = JetStreamPublisher(JetStreamSettings.from_url(srv.url), "agent_slot")
    made.connect()  # R1
    made.close()
    out = run_cli_process(
        *("consume", "--dsn", db.dsn, "--log-format", "text"),
        *("--sink", "postgres", "--sink", srv.url + "?replicas=3"),
        timeout=120,
    )
    assert out.returncode == 4, out.stderr
    assert "Traceback" not in out.stderr and "exists with other settings" in out.stderr
