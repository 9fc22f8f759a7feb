"""``ledger-cdc ui`` against a real server and in a real browser (Debian's chromium, headless):
pages render and link, a 100k-event session opens in under a second, large payloads are read a
part at a time, and the view is safe by construction — payload text escaped, a strict CSP, a
foreign Host refused, no CORS, nothing but GET and HEAD, a token beyond loopback.

Chromium is skipped where it is absent, unless LEDGER_CDC_REQUIRE_CHROMIUM=1 (CI)."""

from __future__ import annotations

import http.client
import operator
import os
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, TypedDict

import pytest

from ledger_cdc.client.frameworks import session_of
from ledger_cdc.client.writer import Ledger
from ledger_cdc.ui import Gate, Store, make_app, serve
from ledger_cdc.ui.web import CSP
from tests.support.cdc import ROOT, ConsumerProcess, wait_caught_up
from tests.support.cli import run_cli_process, start_cli
from tests.support.harness import Database

pytestmark = pytest.mark.server

SCRIPT = "<script>document.title='pwned'</script>"


class View:
    """A view served in this process on a free loopback port."""

    def __init__(self, dsn: str, token: str | None = None) -> None:
        self.httpd = serve(Store(dsn), "127.0.0.1", 0, token)
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def get(
        self, path: str, method: str = "GET", headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str], str]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request(method, path, headers=headers or {})
            r = conn.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read().decode()
        finally:
            conn.close()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def view(db: Database) -> Iterator[View]:
    v = View(db.dsn)
    try:
        yield v
    finally:
        v.close()


def _hostile_session(db: Database) -> uuid.UUID:
    sid = uuid.uuid4()
    with Ledger(db.dsn) as ledger:
        ledger.append(sid, "agent<b>", "tool.invoked", {"call_id": "c1", "tool": SCRIPT})
        ledger.append(sid, "agent<b>", "task.failed", {"error": f"{SCRIPT}\"'&"})
    return sid


def test_payload_text_is_escaped_never_markup(db: Database, view: View) -> None:
    sid = _hostile_session(db)
    status, _, body = view.get(f"/s/{sid}")
    assert status == 200
    assert "<script" not in body.lower()
    assert "&lt;script&gt;document.title=&#x27;pwned&#x27;&lt;/script&gt;" in body
    assert "agent&lt;b&gt;" in body and "<b>" not in body
    status, _, body = view.get(f"/s/{sid}/e/1")
    assert status == 200 and "<script" not in body.lower() and "&lt;script&gt;" in body


def test_every_answer_has_a_strict_csp_and_no_cors(db: Database, view: View) -> None:
    sid = _hostile_session(db)
    for path in ("/", f"/s/{sid}", f"/s/{sid}/e/2", "/diff", "/health", "/nope", "/style.css"):
        status, headers, _ = view.get(path, headers={"Origin": "https://evil.example"})
        assert status in (200, 404), path
        assert headers["content-security-policy"] == CSP
        assert "script-src" not in CSP and "unsafe" not in CSP and "default-src 'none'" in CSP
        assert headers["x-content-type-options"] == "nosniff"
        assert headers["x-frame-options"] == "DENY"
        assert not [h for h in headers if h.startswith("access-control-")], path


def test_a_foreign_host_is_refused(view: View) -> None:
    # a page on evil.example whose name was rebound to 127.0.0.1 sends its own Host
    assert view.get("/", headers={"Host": f"evil.example:{view.port}"})[0] == 421
    assert view.get("/", headers={"Host": "127.0.0.1"})[0] == 421  # another port's
    assert view.get("/", headers={"Host": f"localhost:{view.port}"})[0] == 200
    assert view.get("/")[0] == 200


def test_nothing_but_get_and_head(view: View) -> None:
    for method in ("POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE"):
        status, headers, _ = view.get("/", method)
        assert (status, headers.get("allow")) == (405, "GET, HEAD"), method
    status, headers, body = view.get("/", "HEAD")
    assert status == 200 and body == "" and int(headers["content-length"]) > 0


def test_a_token_is_required_beyond_loopback(db: Database) -> None:
    # the gate in process: a token-bearing gate refuses without it, takes it as a link's
    # parameter (setting the cookie), a cookie or a bearer header
    app = make_app(Store(db.dsn), Gate(frozenset({"view.example:80"}), "s3cret"))

    def call(qs: str = "", **headers: str) -> tuple[str, dict[str, str]]:
        got: dict[str, Any] = {}

        def start(status: str, hdrs: list[tuple[str, str]]) -> None:
            got.update(status=status, headers=dict(hdrs))

        environ = {"REQUEST_METHOD": "GET", "PATH_INFO": "/", "QUERY_STRING": qs}
        environ["HTTP_HOST"] = "view.example:80"
        environ.update({f"HTTP_{k.upper()}": v for k, v in headers.items()})
        app(environ, start)
        return got["status"], got["headers"]

    assert call()[0].startswith("401")
    assert call("token=wrong")[0].startswith("401")
    status, headers = call("token=s3cret")
    assert status.startswith("303") and headers["Location"] == "/"
    assert "HttpOnly" in headers["Set-Cookie"] and "SameSite=Strict" in headers["Set-Cookie"]
    assert call(cookie="ledger_cdc_ui=s3cret")[0].startswith("200")
    assert call(authorization="Bearer s3cret")[0].startswith("200")
    # the command: every address needs --allow-host; beyond loopback a token is made up
    out = run_cli_process("ui", "--dsn", db.dsn, "--host", "0.0.0.0")
    assert out.returncode == 4 and "--allow-host" in out.stderr
    proc = start_cli(
        *("ui", "--dsn", db.dsn, "--host", "0.0.0.0", "--port", "0"),
        *("--allow-host", "view.example", "--sample-interval", "0"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "300"},
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "?token=" in line, line
        port = int(line.split("0.0.0.0:")[1].split("/")[0])
        token = line.strip().split("?token=")[1]
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        host = {"Host": f"view.example:{port}"}
        conn.request("GET", "/", headers=host)
        assert conn.getresponse().status == 401
        conn.close()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/", headers={**host, "Authorization": f"Bearer {token}"})
        assert conn.getresponse().status == 200
        conn.close()
    finally:
        proc.terminate()
        assert proc.wait(30) == 0


def test_a_session_of_100k_events_opens_in_under_a_second(db: Database, view: View) -> None:
    sid = uuid.uuid4()
    with db.connect() as conn:
        conn.execute(
            "INSERT INTO agent_events (session_id, position, agent_id, event_type, payload) "
            "SELECT %s, g, 'bulk', CASE WHEN g %% 2 = 1 THEN 'tool.invoked' "
            "ELSE 'tool.observed' END, CASE WHEN g %% 2 = 1 THEN jsonb_build_object('call_id', "
            "'c' || (g / 2), 'tool', 'search', 'arguments', jsonb_build_object('q', g)) "
            "ELSE jsonb_build_object('call_id', 'c' || ((g - 1) / 2), 'result', g) END "
            "FROM generate_series(1, 100000) g",
            (sid,),
        )
        # and one payload of 1 MB: not loaded with its page, read a part at a time
        conn.execute(
            "INSERT INTO agent_events (session_id, position, agent_id, event_type, payload) "
            "VALUES (%s, 100001, 'bulk', 'task.completed', jsonb_build_object('result', "
            "repeat('x', 1000000)))",
            (sid,),
        )
    timings = {}
    for path in (f"/s/{sid}", f"/s/{sid}?after=50000", f"/s/{sid}?last=1"):
        t0 = time.perf_counter()
        status, _, body = view.get(path)
        timings[path] = time.perf_counter() - t0
        assert (status == 200 and body.count("<tr class=") == 100) or "last=1" in path
    print(f"\n100k-event session pages: {timings}")  # (pytest -s shows it)
    assert max(timings.values()) < 1.0, timings
    status, _, body = view.get(f"/s/{sid}?last=1")
    assert "large payload (1,000,014 bytes)" in body and "positions 99902–100001" in body
    status, _, body = view.get(f"/s/{sid}/e/100001")
    assert status == 200 and len(body) < 100_000 and "next part →" in body
    status, _, body = view.get(f"/s/{sid}/e/100001?offset=983040")
    assert status == 200 and "← previous part" in body and "next part" not in body


def test_unknown_sessions_and_names_are_one_line(view: View) -> None:
    status, _, body = view.get(f"/s/{uuid.uuid4()}")
    assert status == 404 and "has no events" in body
    status, _, body = view.get("/find?q=no-such-thread")
    assert status == 404 and "neither a session id" in body
    assert view.get("/s/not-a-uuid")[0] == 404


# -- in a browser -------------------------------------------------------------------------------


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if os.environ.get("LEDGER_CDC_REQUIRE_CHROMIUM") == "1":
            pytest.fail("chromium not found, but LEDGER_CDC_REQUIRE_CHROMIUM=1 requires it")
        pytest.skip("chromium not found (apt-get install chromium)")
    return found


def browse(url: str, tmp: Path, screenshot: Path | None = None) -> str:
    """The DOM chromium made of ``url`` (or, with ``screenshot``, a picture of it)."""
    args = [
        _chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp / 'chromium'}",
    ]
    if screenshot is not None:
        args += [f"--screenshot={screenshot}", "--window-size=1280,900"]
    else:
        args.append("--dump-dom")
    out = subprocess.run([*args, url], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


class Ticket(TypedDict):
    done: Annotated[list[str], operator.add]
    approved: bool


def _ticket_thread(dsn: str, thread: str, answer: str) -> None:
    """A LangGraph graph on LedgerSaver: a node that fails once, resumed, an approval
    interrupt, resumed with ``answer``."""
    from langgraph.graph import START, StateGraph
    from langgraph.types import Command, interrupt

    from ledger_cdc.integrations.langgraph import LedgerSaver

    failures = [1]

    def lookup(s: Ticket) -> dict[str, Any]:
        if failures:
            failures.pop()
            raise RuntimeError("orders db down")
        return {"done": ["looked up order 7: $40"]}

    def approve(s: Ticket) -> dict[str, Any]:
        return {"approved": interrupt({"question": "Refund $40?"}) == "yes"}

    def finish(s: Ticket) -> dict[str, Any]:
        return {"done": ["refunded" if s["approved"] else "declined"]}

    b = StateGraph(Ticket)
    b.add_node("lookup", lookup)
    b.add_node("approve", approve)
    b.add_node("finish", finish)
    b.add_edge(START, "lookup")
    b.add_edge("lookup", "approve")
    b.add_edge("approve", "finish")
    with LedgerSaver.from_conn_string(dsn) as saver:
        g = b.compile(checkpointer=saver)
        config: Any = {"configurable": {"thread_id": thread}}
        with pytest.raises(RuntimeError):
            g.invoke({"done": []}, config)
        g.invoke(None, config)
        g.invoke(Command(resume=answer), config)


def test_pages_render_and_link_in_a_browser(db: Database, tmp_path: Path) -> None:
    _chromium()
    _ticket_thread(db.dsn, "ticket-7", "yes")
    _ticket_thread(db.dsn, "ticket-8", "no")
    hostile = _hostile_session(db)
    with ConsumerProcess(db.dsn, "--create-slot"):
        wait_caught_up(db.dsn)
        v = View(db.dsn)
        try:
            home = browse(v.url + "/", tmp_path)
            sid = session_of("thread", "ticket-7")
            assert f'href="/s/{sid}"' in home and "thread ticket-7" in home
            assert "graph done" in home
            page = browse(f"{v.url}/s/{sid}", tmp_path)
            assert "LangGraph" in page or "thread ticket-7" in page
            assert "lookup ✗ RuntimeError('orders db down')" in page
            assert "approve interrupt: {'question': 'Refund $40?'}" in page
            assert "(input) resume: 'yes'" in page
            for href in (f"/s/{sid}/e/1", "/diff?a=" + str(sid)):
                assert f'href="{href}"' in page
            event = browse(f"{v.url}/s/{sid}/e/1", tmp_path)
            assert "<h2>Decoded</h2>" in event  # (a checkpoint or the input task's writes)
            assert "step -1 (input)" in event or "__start__ wrote" in event
            diff = browse(f"{v.url}/diff?a=thread:ticket-7&b=thread:ticket-8", tmp_path)
            assert "channel approved differs at step" in diff
            health = browse(f"{v.url}/health", tmp_path)
            assert "agent_slot" in health and "Lag (seconds)" in health
            # the hostile payload stayed text: the browser made no element of it
            hostile_dom = browse(f"{v.url}/s/{hostile}", tmp_path)
            assert (
                "<script" not in hostile_dom.lower()
                and "pwned" not in hostile_dom.split("<title>")[1].split("</title>")[0]
            )
            shot = tmp_path / "session.png"
            browse(f"{v.url}/s/{sid}", tmp_path, shot)
            assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
            if os.environ.get("LEDGER_CDC_UPDATE_SCREENSHOT") == "1":  # the docs' picture
                shutil.copy(shot, ROOT / "docs" / "assets" / "ui-session.png")
        finally:
            v.close()
