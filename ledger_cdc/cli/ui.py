"""``ledger-cdc ui``: the local, read-only web view (:mod:`ledger_cdc.ui`)."""

from __future__ import annotations

import click

from ledger_cdc.cli.base import Interval, State, _env, cli, dsn_option, handles_errors, option
from ledger_cdc.errors import ConfigError


@cli.command("ui")
@dsn_option
@option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    envvar=_env("UI_HOST"),
    help="Address to listen on. Beyond loopback a token is required.",
)
@option(
    "--port",
    default=8321,
    show_default=True,
    type=click.IntRange(0, 65535),
    envvar=_env("UI_PORT"),
    help="Port to listen on (0: a free one).",
)
@option(
    "--token",
    default=None,
    envvar=_env("UI_TOKEN"),
    help="Token a browser must present (required beyond loopback; made up and printed if "
    "not given there).",
)
@option(
    "--allow-host",
    "allow_hosts",
    multiple=True,
    metavar="NAME",
    help="Another name the view answers to (a Host header other than the bound address and "
    "these is refused: DNS rebinding). Needed to listen on every address (0.0.0.0, ::).",
)
@option(
    "--sample-interval",
    default=15.0,
    show_default=True,
    type=Interval(1.0),
    help="Seconds between samples of the slots' health (the last hour's lag); 0: not sampled.",
)
@click.pass_obj
@handles_errors
def ui(
    state: State,
    dsn: str,
    host: str,
    port: int,
    token: str | None,
    allow_hosts: tuple[str, ...],
    sample_interval: float,
) -> None:
    """A local web view of the ledger, read-only: sessions and LangGraph threads with their
    status and last activity; one session's timeline a page at a time (tool calls in flight
    and retried, snapshots, interrupts, handoffs; large payloads read a part at a time); the
    diff of two sessions; the slots' health and lag over the last hour.

    Give it a ledger_reader role's DSN: it only reads, every statement in a read-only
    transaction. It listens on 127.0.0.1 unless told otherwise; beyond loopback it asks for a
    token. Ctrl-C stops it.
    """
    from ledger_cdc.stopping import ignore_stop_signals, on_stop_signals
    from ledger_cdc.ui import LagSampler, Store, serve
    from ledger_cdc.ui.web import is_loopback, new_token

    if host in ("0.0.0.0", "::", "") and not allow_hosts:
        raise ConfigError(
            f"--host {host!r} listens on every address: name the host browsers use with "
            "--allow-host (a request for any other name is refused)"
        )
    if token is None and not is_loopback(host):
        token = new_token()
    store = Store(dsn)
    if store.writable():
        state.err.print(
            "[yellow]note:[/] this DSN's role may append to the ledger; the view only reads "
            "(read-only transactions), but a ledger_reader role is the one to give it"
        )
    sampler = None
    if sample_interval > 0:
        sampler = LagSampler(store, sample_interval)
        sampler.sample()
        sampler.start()
    httpd = serve(store, host, port, token, allow_hosts, sampler)
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{httpd.server_address[1]}/"
    state.console.print(
        f"serving the ledger's web view on {url}" + (f"?token={token}" if token else ""),
        highlight=False,
        soft_wrap=True,
    )
    import threading

    on_stop_signals(lambda: threading.Thread(target=httpd.shutdown, daemon=True).start())
    try:
        httpd.serve_forever()
    finally:
        ignore_stop_signals()
        httpd.server_close()
        if sampler is not None:
            sampler.stop()
