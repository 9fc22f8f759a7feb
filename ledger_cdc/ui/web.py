"""The web view as a WSGI application, safe by construction, and its server.

Every request passes the same gate before any page is made (:class:`Gate`): a method other than
GET or HEAD is refused (405: no route changes anything); a ``Host`` header other than the
address the server is bound to (or a name it was told to answer to) is refused (421), so a
page on another site cannot read this one through DNS rebinding; beyond loopback a token is
required (a ``?token=`` link sets it as an HttpOnly, SameSite=Strict cookie). Every answer
carries a strict Content-Security-Policy (no script at all, styles from this server only),
``nosniff``, no framing, no referrer, no caching, and never an ``Access-Control-*`` header.
Pages escape every value from the ledger (:mod:`ledger_cdc.ui.pages`).

:class:`LagSampler` samples the slots' health while the view runs, for the last hour's lag.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import re
import secrets
import socketserver
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlencode
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from ledger_cdc.errors import LedgerError, NoSuchSessionError
from ledger_cdc.events import LedgerEvent, Rejected
from ledger_cdc.ui import pages
from ledger_cdc.ui.store import Store

__all__ = ["CSP", "Gate", "LagSampler", "UiServer", "make_app", "serve"]

log = logging.getLogger(__name__)

CSP = (
    "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
    "frame-ancestors 'none'; base-uri 'none'"
)
_HEADERS = [
    ("Content-Security-Policy", CSP),
    ("X-Content-Type-Options", "nosniff"),
    ("X-Frame-Options", "DENY"),
    ("Referrer-Policy", "no-referrer"),
    ("Cache-Control", "no-store"),
    ("Cross-Origin-Opener-Policy", "same-origin"),
    ("Cross-Origin-Resource-Policy", "same-origin"),
]
_COOKIE = "ledger_cdc_ui"
HOUR = 3600.0

Start = Callable[..., Any]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Gate:
    """Who may ask: the ``Host`` values accepted, and the token (None: none needed)."""

    hosts: frozenset[str]
    token: str | None = None

    @classmethod
    def for_address(
        cls, host: str, port: int, token: str | None, names: Iterable[str] = ()
    ) -> Gate:
        """The Host values a browser sends for this address (and ``names``, with the port)."""
        bound = f"[{host}]" if ":" in host and not host.startswith("[") else host
        hosts = {f"{bound}:{port}"}
        if is_loopback(host):
            hosts |= {f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}"}
        hosts |= {n if ":" in n.rsplit("]", 1)[-1] else f"{n}:{port}" for n in names}
        if port == 80:
            hosts |= {h.rsplit(":", 1)[0] for h in list(hosts)}
        return cls(frozenset(x.lower() for x in hosts), token)

    def refusal(self, environ: dict[str, Any]) -> tuple[str, str, list[tuple[str, str]]] | None:
        """Why a request is refused (status, message, extra headers), or None to serve it."""
        method = environ.get("REQUEST_METHOD", "")
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", "This view only reads.", [("Allow", "GET, HEAD")]
        host = str(environ.get("HTTP_HOST", "")).lower()
        if host not in self.hosts:
            return (
                "421 Misdirected Request",
                "This server answers to its own address only.",
                [],
            )
        if self.token is not None and not self._has_token(environ):
            return "401 Unauthorized", "A token is needed: open the link the server printed.", []
        return None

    def _has_token(self, environ: dict[str, Any]) -> bool:
        assert self.token is not None
        given = []
        auth = str(environ.get("HTTP_AUTHORIZATION", ""))
        if auth.lower().startswith("bearer "):
            given.append(auth[7:].strip())
        for part in str(environ.get("HTTP_COOKIE", "")).split(";"):
            name, _, value = part.strip().partition("=")
            if name == _COOKIE:
                given.append(value)
        given += parse_qs(str(environ.get("QUERY_STRING", ""))).get("token", [])
        return any(hmac.compare_digest(g.encode(), self.token.encode()) for g in given)


@dataclass
class LagSampler:
    """Each slot's lag, sampled every ``interval`` seconds while the view runs; the last hour
    is kept (time, lag seconds, retained bytes, status)."""

    store: Store
    interval: float = 15.0
    samples: dict[str, deque[tuple[float, float | None, int | None, str]]] = field(
        default_factory=dict
    )
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def sample(self, now: float | None = None) -> list[Any]:
        slots = self.store.health()
        t = time.time() if now is None else now
        with self._lock:
            for s in slots:
                q = self.samples.setdefault(s.slot, deque())
                q.append((t, s.lag_seconds, s.retained_bytes, s.status_name))
                while q and q[0][0] < t - HOUR:
                    q.popleft()
        return slots

    def snapshot(self) -> dict[str, list[tuple[float, float | None, int | None, str]]]:
        with self._lock:
            return {k: list(v) for k, v in self.samples.items()}

    def run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sample()
            except (LedgerError, OSError) as e:
                log.warning("slot health not sampled: %s", e)
            except Exception as e:  # the database's own errors: the view goes on
                log.warning("slot health not sampled: %s: %s", type(e).__name__, e)

    def start(self) -> LagSampler:
        threading.Thread(target=self.run, name="ledger-cdc-ui-lag", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()


_SESSION = re.compile(r"^/s/([0-9a-fA-F-]{36})$")
_EVENT = re.compile(r"^/s/([0-9a-fA-F-]{36})/e/([0-9]{1,18})$")


def _int(params: dict[str, list[str]], name: str, default: int = 0) -> int:
    try:
        value = int(params.get(name, [str(default)])[0])
    except ValueError:
        return default
    return value if 0 <= value < 2**62 else default


_HTML = "text/html; charset=utf-8"


@dataclass(frozen=True)
class Page:
    status: str
    body: str
    ctype: str = _HTML
    headers: tuple[tuple[str, str], ...] = ()


def _error(status: str, title: str, message: str) -> Page:
    return Page(status, pages.error_page(title, message))


def make_app(store: Store, gate: Gate, sampler: LagSampler | None = None) -> Callable[..., Any]:
    """The WSGI application: the gate, then the page."""
    return _App(store, gate, sampler)


@dataclass(frozen=True)
class _App:
    store: Store
    gate: Gate
    sampler: LagSampler | None = None

    def __call__(self, environ: dict[str, Any], start: Start) -> list[bytes]:
        page = self.answer(environ)
        data = page.body.encode("utf-8")
        start(
            page.status,
            [
                ("Content-Type", page.ctype),
                ("Content-Length", str(len(data))),
                *_HEADERS,
                *page.headers,
            ],
        )
        return [] if environ.get("REQUEST_METHOD") == "HEAD" else [data]

    def answer(self, environ: dict[str, Any]) -> Page:
        """The gate's refusal, the token's redirect, or the page; a page never a traceback."""
        gate = self.gate
        refused = gate.refusal(environ)
        if refused is not None:
            status, message, extra = refused
            return Page(status, pages.error_page(status, message), headers=tuple(extra))
        params = parse_qs(str(environ.get("QUERY_STRING", "")))
        path = str(environ.get("PATH_INFO", "/"))
        if gate.token is not None and "token" in params:  # a link with the token: keep it
            cookie = f"{_COOKIE}={gate.token}; HttpOnly; SameSite=Strict; Path=/"
            rest = {k: v[0] for k, v in params.items() if k != "token"}
            where = path + ("?" + urlencode(rest) if rest else "")
            return Page("303 See Other", "", headers=(("Set-Cookie", cookie), ("Location", where)))
        try:
            return self.route(path, params)
        except NoSuchSessionError as e:
            return _error("404 Not Found", "not found", str(e))
        except LedgerError as e:
            return _error("500 Internal Server Error", "error", str(e))
        except Exception as e:  # a page is never a traceback
            log.exception("page %s failed", path)
            return _error("500 Internal Server Error", "error", f"{type(e).__name__} (see the log)")

    def route(self, path: str, params: dict[str, list[str]]) -> Page:
        store = self.store
        if path == "/style.css":
            return Page("200 OK", pages.CSS, "text/css; charset=utf-8")
        if path == "/":
            n = _int(params, "page")
            rows, more = store.sessions(n)
            return Page("200 OK", pages.sessions_page(rows, n, more))
        if path == "/find":
            named = store.resolve(params.get("q", [""])[0].strip())
            return Page("303 See Other", "", headers=(("Location", f"/s/{named.session_id}"),))
        m = _SESSION.match(path)
        if m:
            return Page("200 OK", self.session(uuid.UUID(m.group(1)), params))
        m = _EVENT.match(path)
        if m:
            sid, position = uuid.UUID(m.group(1)), int(m.group(2))
            return Page("200 OK", self.event(sid, position, _int(params, "offset")))
        if path == "/diff":
            return Page("200 OK", _diff(store, params))
        if path == "/health":
            return Page("200 OK", self.health())
        return _error("404 Not Found", "not found", "No such page.")

    def session(self, sid: uuid.UUID, params: dict[str, list[str]]) -> str:
        after = _int(params, "after")
        tl = self.store.timeline(sid, after, last="last" in params)
        if tl.head == 0:
            raise NoSuchSessionError(f"session {sid} has no events")
        shown_after = tl.events[0].position - 1 if tl.events else after
        return pages.session_page(sid, tl, shown_after)

    def event(self, sid: uuid.UUID, position: int, offset: int) -> str:
        from ledger_cdc.admin.readable import describe

        got = self.store.chunk(sid, position, offset)
        if got is None:
            raise NoSuchSessionError(f"session {sid} has no event at position {position}")
        event_type, size, text = got
        readable = None
        if offset == 0 and len(text) >= size:  # whole: what it did, values whole
            ev = self.store.event(sid, position)
            readable = None if ev is None else describe(ev, None)
        return pages.event_page(sid, position, event_type, size, offset, text, readable)

    def health(self) -> str:
        if self.sampler is None:
            return pages.health_page(self.store.health(), {})
        return pages.health_page(self.sampler.sample(), self.sampler.snapshot())


def _diff(store: Store, params: dict[str, list[str]]) -> str:
    """The diff page of sessions ``a`` and ``b``: as two LangGraph threads, or two runs."""
    from ledger_cdc.admin.readable import is_thread

    a, b = params.get("a", [""])[0].strip(), params.get("b", [""])[0].strip()
    if not (a and b):
        return pages.diff_page(a, b, None, [])
    ea = store.events(store.resolve(a).session_id)
    eb = store.events(store.resolve(b).session_id)
    facts, lines = _diff_threads(ea, eb) if is_thread(ea) and is_thread(eb) else _diff_runs(ea, eb)
    return pages.diff_page(a, b, facts, lines)


Events = Sequence[LedgerEvent | Rejected]
Facts = list[tuple[str, str]]
Lines = list[tuple[str, str, str]]


def _diff_threads(ea: Events, eb: Events) -> tuple[Facts, Lines]:
    from ledger_cdc.admin.readable import diff_threads

    d = diff_threads(ea, eb)
    if d.reason == "same":
        return [("result", f"same: both threads take {d.steps_a} steps")], []
    facts = [("result", d.reason), ("agree for", f"{d.common} checkpoint(s)")]
    lines = [("position", str(d.position_a or "—"), str(d.position_b or "—"))]
    if d.channel is not None:
        lines.append((d.channel, pages.pretty(d.a), pages.pretty(d.b)))
    return facts, lines


def _diff_runs(ea: Events, eb: Events) -> tuple[Facts, Lines]:
    from ledger_cdc.admin.timeline import diff_runs, summarise

    r = diff_runs(ea, eb)
    dv = r.divergence
    if dv is None:
        return [("result", f"same: both runs take {r.steps_a} steps")], []
    facts = [
        ("result", f"diverge at step {dv.step}: {dv.reason}"),
        ("agree for", f"{r.common} step(s)"),
    ]

    def what(ev: Any) -> str:
        return "(ended)" if ev is None else f"{ev.agent_id} {ev.event_type}"

    lines = [
        ("event", what(dv.a), what(dv.b)),
        (
            "summary",
            "" if dv.a is None else summarise(dv.a),
            "" if dv.b is None else summarise(dv.b),
        ),
    ]
    lines += [(f, pages.pretty(x), pages.pretty(y)) for f, x, y in dv.fields]
    return facts, lines


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)


class UiServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True


def serve(
    store: Store,
    host: str,
    port: int,
    token: str | None,
    names: Iterable[str] = (),
    sampler: LagSampler | None = None,
) -> UiServer:
    """A server for the view on ``host:port`` (port 0: a free one), not yet serving: call
    ``serve_forever()`` (and ``shutdown()``)."""
    import socket

    server_class: type[UiServer] = UiServer
    if ":" in host:
        server_class = type("UiServer6", (UiServer,), {"address_family": socket.AF_INET6})
    httpd = make_server(
        host, port, lambda e, s: [], server_class=server_class, handler_class=_Quiet
    )
    bound_port = httpd.server_address[1]
    gate = Gate.for_address(host, bound_port, token, names)
    httpd.set_app(make_app(store, gate, sampler))
    return httpd


def new_token() -> str:
    return secrets.token_urlsafe(24)
