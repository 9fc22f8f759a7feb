"""``ledger-cdc`` commands for the morning after: replay, verify, inspect, diff, fork, and the
outbox dispatcher (``dispatch``, ``outbox``). Registered on the group defined in :mod:`.cli`."""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import json as jsonlib
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import msgspec
from rich.table import Table
from rich.text import Text

from ledger_cdc.cli.base import (
    DSN,
    EXIT_PROBLEM,
    Finite,
    State,
    _env,
    ahead_option,
    cli,
    dsn_option,
    handles_errors,
    log_format_option,
    option,
    print_records,
    printable,
    safe,
)
from ledger_cdc.errors import NoSuchSessionError
from ledger_cdc.settings import DAY

if TYPE_CHECKING:
    from collections.abc import Callable

    import psycopg
    from rich.console import Console
    from rich.status import Status

    from ledger_cdc.admin.review import Call, Replay, SessionsDiff
    from ledger_cdc.admin.verify import VerifyReport


class SessionId(click.ParamType):  # type: ignore[type-arg]
    name = "SESSION"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, uuid.UUID):
            return value
        try:
            return uuid.UUID(str(value))
        except ValueError:
            self.fail(f"{value!r} is not a session id (a UUID)", param, ctx)


SESSION = SessionId()


class SessionName(click.ParamType):  # type: ignore[type-arg]
    """A session as the user knows it: its UUID, ``thread:ID`` (LangGraph), ``openai:ID``
    (OpenAI Agents), ``pydantic:ID`` (Pydantic AI), or a bare name looked up in all three."""

    name = "SESSION"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from ledger_cdc.client.frameworks import Named, parse_name

        if isinstance(value, Named):
            return value
        text = str(value)
        if not text.strip() or "\x00" in text:
            self.fail(f"{value!r} names no session", param, ctx)
        return parse_name(text)


NAME = SessionName()

_NAMES_HELP = (
    "SESSION is a session id, or a name of its framework: thread:ID (LangGraph), openai:ID "
    "(OpenAI Agents), pydantic:ID (Pydantic AI), or a bare name looked up in all three."
)


@dataclass(frozen=True)
class Names:
    """The sessions named by options (--thread, --openai-session, --pydantic-run) and the
    LangGraph namespace (--checkpoint-ns) of a command."""

    threads: tuple[str, ...] = ()
    openai_sessions: tuple[str, ...] = ()
    pydantic_runs: tuple[str, ...] = ()
    checkpoint_ns: str | None = None

    def __bool__(self) -> bool:
        return bool(self.threads or self.openai_sessions or self.pydantic_runs)

    def named(self, given: Any, count: int | None, *, ns_applies: bool = True) -> list[Any]:
        """Every session named, in order: SESSION arguments (``given``: one, None or a tuple),
        then the options'. ``count``: how many the command takes (None: one or more)."""
        from ledger_cdc.client.frameworks import Named, parse_name

        args = () if given is None else given if isinstance(given, tuple) else (given,)
        named: list[Named] = list(args)
        named += [parse_name(t, "thread") for t in self.threads]
        named += [parse_name(t, "openai") for t in self.openai_sessions]
        named += [parse_name(t, "pydantic") for t in self.pydantic_runs]
        ns = self.checkpoint_ns
        if ns is not None:
            if not ns_applies:
                raise click.UsageError(
                    "--checkpoint-ns narrows what is shown of a thread; this command works on "
                    "the thread's whole session"
                )
            if not any(n.kind in ("thread", "name") for n in named):
                raise click.UsageError("--checkpoint-ns goes with a LangGraph thread (--thread ID)")
            named = [
                Named(n.kind, n.name, n.session_id, ns) if n.kind in ("thread", "name") else n
                for n in named
            ]
        if count is not None and len(named) != count:
            what = "one session" if count == 1 else f"{count} sessions"
            raise click.UsageError(
                f"give {what} (SESSION, --thread, --openai-session or --pydantic-run), got "
                f"{len(named)}"
            )
        if not named:
            raise click.UsageError("give a SESSION (or --thread, --openai-session, --pydantic-run)")
        return named

    def one(self, conn: psycopg.Connection[Any], given: Any, *, ns_applies: bool = True) -> Any:
        """The one session a command takes, resolved (NoSuchSessionError if the ledger has no
        such name)."""
        from ledger_cdc.client.frameworks import resolve

        (named,) = self.named(given, 1, ns_applies=ns_applies)
        return resolve(conn, named)


def names_options(fn: Any) -> Any:
    """--thread, --checkpoint-ns, --openai-session and --pydantic-run, handed to the command as
    one ``names`` argument (:class:`Names`)."""

    @functools.wraps(fn)
    def command(
        *args: Any,
        threads: tuple[str, ...],
        checkpoint_ns: str | None,
        openai_sessions: tuple[str, ...],
        pydantic_runs: tuple[str, ...],
        **kwargs: Any,
    ) -> Any:
        names = Names(threads, openai_sessions, pydantic_runs, checkpoint_ns)
        return fn(*args, names=names, **kwargs)

    for decorator in reversed(
        [
            option(
                "--thread",
                "threads",
                multiple=True,
                metavar="ID",
                help="A LangGraph thread id (instead of SESSION).",
            ),
            option(
                "--checkpoint-ns",
                default=None,
                metavar="NS",
                help="With a LangGraph thread: only this checkpoint namespace (a subgraph's); "
                "'' is the root graph.",
            ),
            option(
                "--openai-session",
                "openai_sessions",
                multiple=True,
                metavar="ID",
                help="An OpenAI Agents session id (instead of SESSION).",
            ),
            option(
                "--pydantic-run",
                "pydantic_runs",
                multiple=True,
                metavar="ID",
                help="A Pydantic AI run id, as its step store names it (instead of SESSION).",
            ),
        ]
    ):
        command = decorator(command)
    return command


def _resolve(conn: psycopg.Connection[Any], named: Any) -> Any:
    from ledger_cdc.client.frameworks import resolve

    return resolve(conn, named)


def _connect(dsn: str) -> psycopg.Connection[Any]:
    from ledger_cdc.connect import connect

    return connect(dsn, autocommit=True)


def _json(value: Any) -> None:
    click.echo(msgspec.json.format(msgspec.json.encode(value), indent=2).decode())


# -- replay -------------------------------------------------------------------------------------


@cli.command()
@dsn_option
@click.argument("session", type=NAME, required=False)
@names_options
@option("--upto-seq", type=int, default=None, help="Rebuild as of this global seq (time travel).")
@option("--json", "as_json", is_flag=True, help="The whole context as JSON.")
@click.pass_obj
@handles_errors
def replay(
    state: State,
    dsn: str,
    session: Any,
    names: Names,
    upto_seq: int | None,
    as_json: bool,
) -> None:
    """Rebuild a session's context as a restarted worker would: the latest usable snapshot plus
    the tail of the log, folded by the consumer's reducers.

    Shows the tool calls in flight (to retry with their idempotency keys) and the memoised
    calls a restarted worker answers from the ledger instead of calling again (all of them:
    those before the snapshot are read from agent_memo). For a LangGraph thread, where the
    graph is (interrupted at a node and waiting for what, failed at a node, running and what
    runs next, or done); for an OpenAI Agents session its items, for a Pydantic AI run its
    steps and snapshots.

    SESSION is a session id, or a name of its framework: thread:ID (LangGraph), openai:ID
    (OpenAI Agents), pydantic:ID (Pydantic AI), or a bare name looked up in all three.
    """
    from ledger_cdc.admin.review import replay as rebuild

    (named,) = names.named(session, 1)
    with _connect(dsn) as conn:
        replayed = rebuild(conn, named, upto_seq)
    if as_json:
        _json(replayed.context)
        return
    _print_replay(state.console, replayed)


def _print_replay(con: Console, replayed: Replay) -> None:
    ctx, named = replayed.context, replayed.named
    colour = {"completed": "green", "failed": "red"}.get(ctx.status, "yellow")
    title = "" if named.kind == "session" else f"{safe(str(named))}  "
    con.print(
        f"{title}session [bold]{ctx.session_id}[/]  status [{colour}]{safe(ctx.status)}[/]  "
        f"{ctx.event_count} events up to seq {ctx.last_seq} (position {ctx.last_position})"
    )
    for i, line in enumerate(replayed.framework):
        con.print(Text(printable(line), style="bold" if i == 0 else ""))
    if replayed.ignored > 0 or ctx.quarantined:
        con.print(
            f"[dim]{replayed.ignored} event(s) of types no reducer folds; {ctx.quarantined} "
            "quarantined[/]"
        )
    if ctx.task:
        con.print(f"task: {safe(ctx.task)}")
    if ctx.forked_from:
        f = ctx.forked_from
        con.print(f"forked from {f.session_id} at seq {f.upto_seq} (position {f.upto_position})")
    con.print(
        f"agents: {safe(', '.join(ctx.agents))}  ·  messages: {len(ctx.messages)}  ·  tokens "
        f"{ctx.usage.input_tokens}/{ctx.usage.output_tokens} in {ctx.usage.model_calls} model calls"
    )
    if replayed.in_flight:
        t = Table(
            title="in flight when the log ends (retry with the same key)", title_style="bold yellow"
        )
        for col in ("kind", "id", "tool / model", "idempotency key", "since seq", "attempts"):
            t.add_column(col)
        for c in replayed.in_flight:
            t.add_row(*_call_cells(c), str(c.attempts))
        con.print(t)
    else:
        con.print("[green]nothing in flight[/]")
    if replayed.memoised:
        t = Table(title="memoised (answered from the ledger, never called again)")
        for col in ("kind", "id", "tool / model", "idempotency key", "seq", "result"):
            t.add_column(col, overflow="ellipsis", max_width=60 if col == "result" else None)
        for c in replayed.memoised:
            t.add_row(*_call_cells(c), safe(c.result or ""))
        con.print(t)
    if ctx.status == "failed":
        con.print(f"[red]failed:[/] {safe(ctx.error)}" + (" (retryable)" if ctx.retryable else ""))


def _call_cells(c: Call) -> list[str]:
    return [c.kind, safe(c.id), safe(c.name), safe(c.idempotency_key or "—"), str(c.seq)]


# -- verify -------------------------------------------------------------------------------------


@cli.command()
@dsn_option
@click.argument("sessions", type=NAME, nargs=-1)
@names_options
@option("--all", "all_sessions", is_flag=True, help="Every session in the ledger.")
@option("--no-chain", is_flag=True, help="Skip the hash-chain walk.")
@option(
    "--target-dsn",
    default=None,
    type=DSN,
    envvar=_env("TARGET_DSN"),
    help="Database the projections, snapshots, memo and checkpoints are in, when the consumer "
    "writes them into another one (consume --target-dsn); the ledger is read from --dsn.",
)
@option(
    "--archive-dir",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    default=None,
    help="Also check the archived partitions' files against their recorded sha256.",
)
@option(
    "--consumer-wait",
    default=10.0,
    show_default=True,
    type=Finite(-1.0, 3600),
    help="Seconds to wait for a running consumer to apply past verify's snapshot, to tell a "
    "projection deleted or put back by hand from one not yet written (0: judge by what the "
    "slots have confirmed already). A session no consumer vouches for by then is a "
    "difference; -1: not judged, only noted.",
)
@option("--json", "as_json", is_flag=True, help="Machine-readable report.")
@click.pass_obj
@handles_errors
def verify(
    state: State,
    dsn: str,
    sessions: tuple[Any, ...],
    names: Names,
    all_sessions: bool,
    no_chain: bool,
    target_dsn: str | None,
    archive_dir: Path | None,
    consumer_wait: float,
    as_json: bool,
) -> None:
    """Refold sessions from zero and compare with their projection and every stored snapshot,
    field by field; walk each session's hash chain and report the first event that no longer
    matches. Exit 1 if anything differs.

    With --archive-dir, archived partitions' files are checked against their recorded sha256;
    history before an archived bound is verified by its chain link and manifest, not refolded.

    A projection behind the log is compared at its own position. Whether it lags or was
    deleted or put back by hand is told by the consumer: a projection still missing or
    behind once a running consumer's checkpoint passes verify's snapshot, or one no consumer
    vouches for within --consumer-wait (kind behind), is a difference, as is one ahead of the
    ledger; with --consumer-wait -1 it is only noted. With --target-dsn the projections are
    read from that database, the ledger from --dsn.

    SESSION is a session id, or a name of its framework: thread:ID (LangGraph), openai:ID
    (OpenAI Agents), pydantic:ID (Pydantic AI), or a bare name looked up in all three.
    """
    from ledger_cdc.admin.verify import verify as do_verify

    given = bool(sessions or names)
    if given == all_sessions:
        raise click.UsageError("give SESSION ids or --all (not both)")
    if given:
        named = names.named(sessions, None, ns_applies=False)
        with _connect(dsn) as conn:
            sessions = tuple(_resolve(conn, n).session_id for n in named)
    run = functools.partial(
        do_verify,
        dsn,
        None if all_sessions else list(sessions),
        target_dsn=target_dsn,
        chain=not no_chain,
        archive_dir=archive_dir,
        consumer_wait=consumer_wait,
    )
    con = state.console
    if as_json or not con.is_terminal:
        report = run()
    else:
        with con.status("refolding…") as status:
            on_session, on_wait = _verify_progress(status, consumer_wait)
            report = run(on_session=on_session, on_wait=on_wait)
    if as_json:
        click.echo(report.to_json())
    else:
        _print_verify(con, report, chain=not no_chain)
    if report.unknown:
        unknown = ", ".join(str(u) for u in report.unknown)
        raise NoSuchSessionError(
            f"no such session: {unknown} (no events, projection or snapshot: check the id)"
        )
    if not report.ok:
        sys.exit(EXIT_PROBLEM)


def _verify_progress(
    status: Status, consumer_wait: float
) -> tuple[Callable[[uuid.UUID], None], Callable[[int], None]]:
    """verify's ``on_session`` and ``on_wait``, told on the terminal's status line."""
    count = [0]

    def progress(sid: uuid.UUID) -> None:
        count[0] += 1
        if count[0] % 100 == 0:
            status.update(f"refolding… {count[0]} sessions")

    def waiting(n: int) -> None:
        status.update(
            f"{n} projection(s) missing or behind: waiting up to {consumer_wait:g}s for "
            "the consumer to pass the snapshot (--consumer-wait)…"
        )

    return progress, waiting


def _print_verify(con: Console, report: VerifyReport, *, chain: bool) -> None:
    for note in report.notes:
        con.print(f"[dim]note: {safe(note)}[/]", soft_wrap=True)
    if report.differences:
        print_records(
            con,
            f"{len(report.differences)} difference(s)",
            ["session", "kind", "seq", "pos", "field", "refold / expected", "stored", "detail"],
            [
                [
                    str(d.session_id),
                    safe(d.kind),
                    "—" if d.seq is None else str(d.seq),
                    "—" if d.position is None else str(d.position),
                    safe(d.field or "—"),
                    "—" if d.expected is None else safe(d.expected),
                    "—" if d.actual is None else safe(d.actual),
                    safe(d.detail),
                ]
                for d in report.differences
            ],
            title_style="bold red",
        )
    walked = f", {report.chained_events} events' hash chain walked" if chain else ""
    verdict = "[green]verified[/]" if report.ok else "[bold red]differences found[/]"
    con.print(
        f"{verdict}: {report.sessions} sessions, {report.events} events refolded, "
        f"{report.projections} projections, {report.snapshots} snapshots and "
        f"{report.memo} memoised calls compared{walked}"
    )


# -- inspect ------------------------------------------------------------------------------------

_MARKS = {
    "in flight": "bold yellow",
    "retry": "magenta",
    "failed": "red",
    "interrupt": "bold cyan",
    "quarantined": "red",
}


@cli.command()
@dsn_option
@click.argument("session", type=NAME, required=False)
@names_options
@option("--last", type=click.IntRange(0), default=None, help="Only the last N events.")
@option("--full", is_flag=True, help="Values whole (else cut to a line's worth).")
@option("--json", "as_json", is_flag=True, help="The timeline as JSON lines.")
@click.pass_obj
@handles_errors
def inspect(
    state: State,
    dsn: str,
    session: Any,
    names: Names,
    last: int | None,
    full: bool,
    as_json: bool,
) -> None:
    """A readable timeline of a session: seq, time, agent, type and a one-line summary of each
    event; tool calls paired with their results; calls still in flight highlighted.

    Framework events are decoded: a LangGraph checkpoint shows its step, source (input, loop,
    update, fork), the nodes that ran, the channels written (decoded as the saver's serializer
    wrote them), what runs next and its parent; a write shows its node, its channel values,
    interrupts with their values, errors, resume values and sends. OpenAI Agents items and
    Pydantic AI steps are shown by role or kind with their content.

    SESSION is a session id, or a name of its framework: thread:ID (LangGraph), openai:ID
    (OpenAI Agents), pydantic:ID (Pydantic AI), or a bare name looked up in all three.
    """
    from ledger_cdc.admin.readable import SHORT, readable_timeline
    from ledger_cdc.admin.review import heading, session_events

    with _connect(dsn) as conn:
        named = names.one(conn, session)
        assert named.session_id is not None
        events = session_events(conn, named.session_id)
    rows = readable_timeline(events, None if full else SHORT, named.checkpoint_ns)
    if last is not None:
        rows = rows[-last:] if last else []
    if as_json:
        for r in rows:
            click.echo(
                jsonlib.dumps(
                    {
                        "seq": r.seq,
                        "position": r.position,
                        "created_at": None if r.created_at is None else r.created_at.isoformat(),
                        "agent_id": r.agent_id,
                        "event_type": r.event_type,
                        "summary": r.summary,
                        "mark": r.mark or None,
                        "pair_seq": r.pair,
                    }
                )
            )
        return
    t = Table(title=heading(named))
    for col in ("seq", "pos", "time", "agent", "type", "summary", "pair"):
        t.add_column(col, overflow="fold" if col == "summary" else "ellipsis")
    for r in rows:
        style = _MARKS.get(r.mark)
        pair = (
            ""
            if r.pair is None
            else ("→ " if r.event_type.endswith(("invoked", "requested")) else "← ") + str(r.pair)
        )
        summary = Text(printable(r.summary))
        if r.mark:
            summary = Text.assemble((f"[{r.mark}] ", style or ""), printable(r.summary))
        t.add_row(
            str(r.seq),
            str(r.position),
            "—" if r.created_at is None else r.created_at.strftime("%H:%M:%S.%f")[:-3],
            safe(r.agent_id),
            safe(r.event_type),
            summary,
            pair,
            style=style if r.mark == "in flight" else None,
        )
    state.console.print(t)
    flying = sum(1 for r in rows if r.mark == "in flight")
    if flying:
        state.console.print(
            f"[bold yellow]{flying} call(s) in flight[/]: "
            f"`ledger-cdc replay {named.session_id}` shows their keys"
        )


# -- diff ---------------------------------------------------------------------------------------


@cli.command()
@dsn_option
@click.argument("sessions", type=NAME, nargs=-1)
@names_options
@option("--full", is_flag=True, help="Values whole (else cut to a line's worth).")
@option("--json", "as_json", is_flag=True, help="Machine-readable result.")
@click.pass_obj
@handles_errors
def diff(
    state: State,
    dsn: str,
    sessions: tuple[Any, ...],
    names: Names,
    full: bool,
    as_json: bool,
) -> None:
    """Align two runs of the same task and show the first step where they diverge (different
    prompt hash, tool arguments, model output, …) and what differs. Ids, keys and times are
    not compared; a fork's marker and retries of a call are not steps. Exit 1 if they diverge.

    Two LangGraph threads are compared checkpoint by checkpoint along each one's latest line
    (the nodes that ran, then each channel's value decoded as the saver's serializer wrote it,
    ids and times left out): the first step and channel where they differ.

    A and B (SESSION, twice) are session ids, or names of their framework: thread:ID
    (LangGraph), openai:ID (OpenAI Agents), pydantic:ID (Pydantic AI), or bare names looked up
    in all three; or --thread A --thread B.
    """
    from ledger_cdc.admin.review import diff_sessions

    a, b = names.named(sessions, 2)
    with _connect(dsn) as conn:
        found = diff_sessions(conn, a, b)
    if as_json:
        click.echo(found.to_json())
    elif found.threads is not None:
        _print_thread_diff(state.console, found, full)
    else:
        _print_run_diff(state.console, found)
    if found.diverged:
        sys.exit(EXIT_PROBLEM)


def _diff_table(found: SessionsDiff) -> Table:
    t = Table(show_header=True)
    t.add_column("")
    t.add_column(f"A {safe(found.a.label)}", overflow="fold")
    t.add_column(f"B {safe(found.b.label)}", overflow="fold")
    return t


def _print_run_diff(con: Console, found: SessionsDiff) -> None:
    from ledger_cdc.admin.timeline import summarise

    assert found.runs is not None
    res, d = found.runs, found.runs.divergence
    if d is None:
        con.print(f"[green]same[/]: both runs take the same {res.steps_a} steps")
        return
    con.print(
        f"the runs agree for [bold]{res.common}[/] step(s); they diverge at step "
        f"[bold]{d.step}[/]: [bold red]{safe(d.reason)}[/]"
    )
    t = _diff_table(found)
    t.add_row(
        "seq / pos",
        "—" if d.a is None else f"{d.a.seq} / {d.a.position}",
        "—" if d.b is None else f"{d.b.seq} / {d.b.position}",
    )
    t.add_row(
        "event",
        "(ended)" if d.a is None else safe(f"{d.a.agent_id} {d.a.event_type}"),
        "(ended)" if d.b is None else safe(f"{d.b.agent_id} {d.b.event_type}"),
    )
    t.add_row(
        "summary",
        "" if d.a is None else safe(summarise(d.a)),
        "" if d.b is None else safe(summarise(d.b)),
    )
    for f, a, b in d.fields:
        t.add_row(Text(printable(f), style="bold"), safe(a), safe(b))
    con.print(t)


def _print_thread_diff(con: Console, found: SessionsDiff, full: bool) -> None:
    d = found.threads
    assert d is not None
    if not found.diverged:
        con.print(f"[green]same[/]: both threads take the same {d.steps_a} steps")
        return
    con.print(
        f"the threads agree for [bold]{d.common}[/] checkpoint(s); they diverge at step "
        f"[bold]{d.step}[/]"
        + ("" if d.channel is None else f", channel [bold]{safe(d.channel)}[/]")
        + f": [bold red]{safe(d.reason)}[/]"
    )
    t = _diff_table(found)

    def shown(v: Any) -> str:
        text = v if isinstance(v, str) else jsonlib.dumps(v, ensure_ascii=False, default=str)
        return safe(text if full or len(text) <= 300 else text[:299] + "…")

    t.add_row(
        "position",
        "—" if d.position_a is None else str(d.position_a),
        "—" if d.position_b is None else str(d.position_b),
    )
    if d.channel is not None:
        t.add_row(Text(printable(d.channel), style="bold"), shown(d.a), shown(d.b))
    for f, a, b in d.fields:
        if f != d.channel:
            t.add_row(Text(printable(f), style="dim"), shown(a), shown(b))
    con.print(t)


# -- fork ---------------------------------------------------------------------------------------


@cli.command()
@dsn_option
@click.argument("session", type=NAME, required=False)
@names_options
@option("--upto-seq", type=int, required=True, help="Copy the events at or below this global seq.")
@option("--new-session", type=SESSION, default=None, help="Id of the fork (default: a new UUID).")
@option("--reason", default=None, help="Why the fork was made (recorded in its first event).")
@click.pass_obj
@handles_errors
def fork(
    state: State,
    dsn: str,
    session: Any,
    names: Names,
    upto_seq: int,
    new_session: uuid.UUID | None,
    reason: str | None,
) -> None:
    """Start a new session from any step of an existing one (time travel): it holds the same
    events up to --upto-seq after a first session.forked event recording its origin. Resume it
    with changed inputs; `ledger-cdc diff` against the origin then starts at the fork point.
    Outbox rows are not copied.

    SESSION is a session id, or a name of its framework: thread:ID (LangGraph), openai:ID
    (OpenAI Agents), pydantic:ID (Pydantic AI), or a bare name looked up in all three. (A fork
    of a framework's session is a session of its own, named by its id: the framework does not
    know it.)"""
    from ledger_cdc.client.recovery import fork as do_fork

    with _connect(dsn) as conn:
        sid = names.one(conn, session, ns_applies=False).session_id
        res = do_fork(conn, sid, upto_seq, new_session_id=new_session, reason=reason)
    state.console.print(
        f"forked [bold]{res.session_id}[/] from {res.origin_session_id}: {res.events} events up "
        f"to seq {res.upto_seq} (position {res.upto_position})"
    )
    if not state.console.is_terminal:
        click.echo(str(res.session_id))  # for scripts: NEW=$(ledger-cdc fork … | tail -1)


# -- dispatch -----------------------------------------------------------------------------------


@cli.command()
@dsn_option
@option(
    "--target",
    "targets",
    multiple=True,
    metavar="NAME=URL",
    envvar=_env("TARGETS"),
    help="An HTTP webhook for outbox rows whose target is NAME (repeatable; in the environment, "
    "space-separated).",
)
@option(
    "--entry-points/--no-entry-points",
    default=True,
    show_default=True,
    help="Also use Python targets installed under the 'ledger_cdc.targets' entry-point group.",
)
@option(
    "--batch-size",
    default=32,
    show_default=True,
    type=click.IntRange(1),
    help="Rows claimed per statement (at most --concurrency: a claim counts as an attempt of "
    "each row it takes, so it takes only rows it calls at once).",
)
@option(
    "--concurrency",
    default=8,
    show_default=True,
    type=click.IntRange(1),
    help="Calls in flight at once.",
)
@option(
    "--max-attempts",
    default=8,
    show_default=True,
    type=click.IntRange(1),
    help="Failures before a row is parked.",
)
@option(
    "--backoff",
    default=1.0,
    show_default=True,
    type=Finite(0, DAY),
    help="Seconds before the 2nd attempt; doubles, capped by --backoff-cap.",
)
@option(
    "--backoff-cap",
    default=300.0,
    show_default=True,
    type=Finite(0, DAY),
    help="Longest wait between attempts (s).",
)
@option(
    "--poll-interval",
    default=0.5,
    show_default=True,
    type=Finite(0.01, 3600),
    help="Seconds between polls when nothing is due.",
)
@option(
    "--timeout",
    default=10.0,
    show_default=True,
    type=Finite(0.001, DAY),
    help="Deadline of one call (s): an HTTP target's whole request and answer (not each "
    "read); a Python target still running by then is recorded as failed.",
)
@option(
    "--claim-seconds",
    default=30.0,
    show_default=True,
    type=Finite(0.1, DAY),
    help="Lease of a claimed row, renewed while its call is in flight: a dead dispatcher's "
    "rows are retried by another after this long.",
)
@option("--once", is_flag=True, help="One pass over what is due now, then exit.")
@option(
    "--until-idle", is_flag=True, help="Exit when no row is left to dispatch (retries included)."
)
@option(
    "--metrics-port",
    default=None,
    type=click.IntRange(0, 65535),
    help="Serve Prometheus metrics (ledger_cdc_outbox_*) on this port.",
)
@option(
    "--metrics-host", default="127.0.0.1", show_default=True, help="Address for --metrics-port."
)
@log_format_option("Log lines as text (auto) or JSON")
@click.pass_obj
@handles_errors
def dispatch(
    state: State,
    dsn: str,
    targets: tuple[str, ...],
    entry_points: bool,
    batch_size: int,
    concurrency: int,
    max_attempts: int,
    backoff: float,
    backoff_cap: float,
    poll_interval: float,
    timeout: float,
    claim_seconds: float,
    once: bool,
    until_idle: bool,
    metrics_port: int | None,
    metrics_host: str,
    log_format: str,
) -> None:
    """Perform the outbox's external calls: claim due rows with a lease (several dispatchers
    can run at once and never call one row at the same time), call the target with the row's
    idempotency key with no database transaction open, then record the outcome. A failed call
    is retried with backoff and parked after --max-attempts attempts, every call counted (see
    `ledger-cdc outbox --parked`). A dispatcher killed mid-call leaves a claim that expires
    after --claim-seconds; the row is then retried with the same key.

    Exit 0 when stopped (SIGINT/SIGTERM/SIGHUP finish the batch), 1 if rows were parked.
    """
    from ledger_cdc.cli.runner import setup_logging
    from ledger_cdc.client.dispatch import (
        DispatchConfig,
        Dispatcher,
        Target,
        load_entry_point_targets,
        parse_target,
    )
    from ledger_cdc.stopping import ignore_stop_signals, on_stop_signals

    table: dict[str, Target] = load_entry_point_targets() if entry_points else {}
    for spec in (s for t in targets for s in t.split()):
        name, target = parse_target(spec, timeout=timeout)
        table[name] = target
    log = setup_logging("json" if log_format == "json" else "text")
    d = Dispatcher(
        DispatchConfig(
            dsn=dsn,
            targets=table,
            batch_size=batch_size,
            concurrency=concurrency,
            max_attempts=max_attempts,
            backoff_base=backoff,
            backoff_cap=backoff_cap,
            poll_interval=poll_interval,
            claim_seconds=claim_seconds,
            call_timeout=timeout,
        )
    )

    on_stop_signals(d.stop)
    log.info(
        "dispatching outbox rows for %s",
        ", ".join(f"{n} ({t!r})" for n, t in sorted(table.items())),
    )
    d.open()
    if metrics_port is not None:
        from ledger_cdc.consumer.metrics import DispatchCollector, registry, serve

        server = serve(registry(DispatchCollector(d.metrics, d.name)), metrics_port, metrics_host)
        log.info("metrics on http://%s:%d/metrics", metrics_host, server.port)
    for name, count in d.unserved():
        log.warning(
            "%d due row(s) for target %r, which this dispatcher does not serve", count, name
        )
    try:
        m = d.run(once=once, idle_exit=until_idle)
    finally:
        ignore_stop_signals()  # done: a late signal must not turn its exit status into -15
    log.info("dispatched %d, failed attempts %d, parked %d", m.dispatched, m.failures, m.parked)
    if m.parked:
        sys.exit(EXIT_PROBLEM)


@cli.group(invoke_without_command=True)
@dsn_option
@option("--parked", "show", flag_value="parked", help="Only parked rows.")
@option("--pending", "show", flag_value="pending", help="Only rows still to dispatch.")
@option("--limit", default=50, show_default=True, type=click.IntRange(1), help="Rows shown.")
@option("--json", "as_json", is_flag=True)
@click.pass_context
@handles_errors
def outbox(ctx: click.Context, dsn: str, show: str | None, limit: int, as_json: bool) -> None:
    """List outbox rows (newest first); `outbox requeue ID…` retries parked rows."""
    ctx.meta["dsn"] = dsn
    if ctx.invoked_subcommand is not None:
        return
    from ledger_cdc.client.dispatch import outbox_rows

    with _connect(dsn) as conn:
        rows = outbox_rows(conn, parked=None if show is None else show == "parked", limit=limit)
    if as_json:
        click.echo(jsonlib.dumps(rows, indent=2, default=str))
        return
    t = Table(title="agent_outbox")
    for col in ("id", "target", "idempotency key", "state", "attempts", "last error"):
        t.add_column(col, overflow="fold")
    for r in rows:
        st = (
            "dispatched"
            if r["dispatched"]
            else ("[red]parked[/]" if r["parked"] else "[yellow]pending[/]")
        )
        t.add_row(
            str(r["id"]),
            safe(r["target"]),
            safe(r["idempotency_key"]),
            st,
            str(r["attempts"]),
            safe(r["last_error"] or ""),
        )
    ctx.find_object(State).console.print(t)  # type: ignore[union-attr]


@outbox.command("requeue")
@click.argument("ids", type=click.IntRange(1, 2**63 - 1), nargs=-1, required=True)
@click.pass_context
@handles_errors
def outbox_requeue(ctx: click.Context, ids: tuple[int, ...]) -> None:
    """Unpark rows (after fixing their target): they are tried again at once. Rows already
    dispatched, being called now (a live claim) or not found are left as they are (exit 1)."""
    from ledger_cdc.client.dispatch import requeue

    with _connect(ctx.meta["dsn"]) as conn:
        done = requeue(conn, ids)
    click.echo(f"requeued {len(done)} row(s)")
    left = sorted(set(ids) - set(done))
    if left:
        click.echo(
            f"not requeued: {', '.join(map(str, left))} (dispatched, being called now, "
            "or no such row: see `ledger-cdc outbox`)",
            err=True,
        )
        sys.exit(EXIT_PROBLEM)


# -- runs -----------------------------------------------------------------------------------------


@cli.command()
@dsn_option
@option(
    "--status",
    type=click.Choice(["pending", "running", "suspended", "stale", "completed", "failed"]),
    default=None,
    help="Only runs in this state (stale: running on an expired lease).",
)
@option("--limit", default=200, show_default=True, type=click.IntRange(1), help="Runs shown.")
@option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_obj
@handles_errors
def runs(state: State, dsn: str, status: str | None, limit: int, as_json: bool) -> None:
    """List runs from the projections: pending (ready to lease), running (with lease holder and
    expiry), suspended (and the signals they wait for), stale (lease expired: may be taken
    over), completed, failed."""
    from ledger_cdc.client.runs import list_runs

    with _connect(dsn) as conn:
        rows = list_runs(conn, status, limit=limit)
    if as_json:
        click.echo(jsonlib.dumps(rows, indent=2, default=str))
        return
    colours = {"pending": "cyan", "running": "green", "suspended": "yellow", "stale": "red"}
    t = Table(title=f"runs{'' if status is None else f' ({status})'}")
    for col in ("session", "status", "lease holder", "lease until", "waits for", "last seq"):
        t.add_column(col)
    for r in rows:
        c = colours.get(r["status"])
        t.add_row(
            str(r["session_id"]),
            f"[{c}]{r['status']}[/]" if c else r["status"],
            safe(r["lease_worker"] or "—"),
            "—" if r["lease_until"] is None else r["lease_until"].isoformat(timespec="seconds"),
            safe(", ".join(r["wait_for"]) or "—"),
            str(r["last_seq"]),
        )
    state.console.print(t)


@cli.command("signal")
@dsn_option
@click.argument("session", type=SESSION)
@click.argument("name")
@option("--payload", default=None, help="JSON value delivered with the signal.")
@option("--id", "signal_id", default=None, help="Signal id: sending the same id twice is a no-op.")
@option("--sender", default="cli", show_default=True, help="Recorded as the event's agent.")
@option(
    "--create",
    is_flag=True,
    help="Allow a session with no events yet (else an unknown SESSION is an error, exit 1).",
)
@click.pass_obj
@handles_errors
def signal_cmd(
    state: State,
    dsn: str,
    session: uuid.UUID,
    name: str,
    payload: str | None,
    signal_id: str | None,
    sender: str,
    create: bool,
) -> None:
    """Send a signal to a run (an approval, a webhook's answer): appends signal.received. A run
    suspended on NAME becomes pending and is woken by the consumer's notification."""
    from ledger_cdc.client.runs import signal as do_signal

    try:
        value = None if payload is None else jsonlib.loads(payload)
    except ValueError as e:
        raise click.BadParameter(f"not JSON: {e}", param_hint="--payload") from None
    except RecursionError:
        raise click.BadParameter("nested too deep to be an event", param_hint="--payload") from None
    with _connect(dsn) as conn:
        res = do_signal(
            conn, session, name, value, sender=sender, signal_id=signal_id, create=create
        )
    what = "already sent" if res.duplicate else "sent"
    state.console.print(f"signal {safe(name)} {what}: seq {res.seq}, position {res.position}")


# -- partitions -----------------------------------------------------------------------------------


def _duration(text: str) -> dt.timedelta:
    """A positive age like 90d, 12h, 2w, 30m or 45s."""
    units = {"d": "days", "h": "hours", "w": "weeks", "m": "minutes", "s": "seconds"}
    text = text.strip()
    try:
        age = dt.timedelta(**{units[text[-1:]]: float(text[:-1])})
    except (KeyError, ValueError, OverflowError):  # ValueError: "", "nand"; Overflow: "1e10d"
        raise click.BadParameter(
            f"{text!r} is not a duration like 90d, 12h or 2w", param_hint="--older-than"
        ) from None
    if age <= dt.timedelta(0):
        raise click.BadParameter(
            f"{text!r}: the age must be above zero (a bound in the future would archive live "
            "partitions)",
            param_hint="--older-than",
        )
    return age


@cli.group()
def partitions() -> None:
    """Partitions of a partitioned ledger (init --partition-by): list, ensure, archive."""


@cli.command("import")
@dsn_option
@click.argument("source", type=click.File("rb"))
@option(
    "--batch", default=1000, show_default=True, type=click.IntRange(1), help="Events per commit."
)
@click.pass_obj
@handles_errors
def import_cmd(state: State, dsn: str, source: Any, batch: int) -> None:
    """Import existing agent logs with their own times, from SOURCE (JSON lines, - for stdin):
    {"session_id", "agent_id", "event_type", "payload", "created_at", "idempotency_key"?}.

    The one way to place events in the past: created_at is otherwise the server's clock. Needs
    the ledger's owner (or a member of its role). Each line is validated like an append; a
    session's positions follow on from what it holds; on a partitioned ledger the partitions
    the times fall into are created (never one already archived). Commits every --batch
    events: a failure names the line to go on from."""
    from ledger_cdc.admin.importer import import_events, read_lines

    with _connect(dsn) as conn, state.console.status("importing…") as status:
        res = import_events(
            conn,
            read_lines(source),
            batch=batch,
            progress=lambda n: status.update(f"importing… {n:,} events"),
        )
    made = f"; partitions created: {', '.join(res.partitions_created)}" * bool(
        res.partitions_created
    )
    state.console.print(f"imported {res.events:,} events of {res.sessions:,} sessions{made}")


@partitions.command("list")
@dsn_option
@option("--json", "as_json", is_flag=True)
@click.pass_obj
@handles_errors
def partitions_list(state: State, dsn: str, as_json: bool) -> None:
    """The ledger's partitions and the archives already taken."""
    from ledger_cdc.admin.partitions import list_partitions

    with _connect(dsn) as conn:
        parts = list_partitions(conn)
        archived = conn.execute(
            "SELECT partition_name, range_start, range_end, events, file_name, file_sha256, "
            "archived_at FROM ledger_archives ORDER BY range_start"
        ).fetchall()
    if as_json:
        click.echo(
            jsonlib.dumps(
                {
                    "partitions": [
                        {"name": p.name, "start": p.start.isoformat(), "end": p.end.isoformat()}
                        for p in parts
                    ],
                    "archived": [
                        dict(
                            zip(
                                ("name", "start", "end", "events", "file", "sha256", "archived_at"),
                                a,
                                strict=True,
                            )
                        )
                        for a in archived
                    ],
                },
                indent=2,
                default=str,
            )
        )
        return
    t = Table(title="agent_events partitions")
    for col in ("partition", "from", "to", "state"):
        t.add_column(col)
    for a in archived:
        t.add_row(
            a[0], a[1].isoformat(), a[2].isoformat(), f"[dim]archived: {a[3]} events in {a[4]}[/]"
        )
    for p in parts:
        t.add_row(p.name, p.start.isoformat(), p.end.isoformat(), "live")
    state.console.print(t)


@partitions.command("ensure")
@dsn_option
@ahead_option("--ahead", "Partitions beyond the current one.")
@click.pass_obj
@handles_errors
def partitions_ensure(state: State, dsn: str, ahead: int) -> None:
    """Create the current and the next --ahead partitions if missing (run it from cron; the
    consumer also does it hourly). Idempotent."""
    from ledger_cdc.admin.partitions import ensure

    with _connect(dsn) as conn:
        made = ensure(conn, ahead)
    state.console.print(f"created: {', '.join(made)}" if made else "all partitions exist")


@partitions.command("archive")
@dsn_option
@option(
    "--older-than",
    "older",
    required=True,
    help="Age bound, e.g. 90d: partitions entirely older are archived.",
)
@option(
    "--to",
    "to_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("ledger-archive"),
    show_default=True,
    help="Directory for the exported partitions and their manifests.",
)
@click.pass_obj
@handles_errors
def partitions_archive(state: State, dsn: str, older: str, to_dir: Path) -> None:
    """Archive partitions entirely older than --older-than: refused unless the consumer has
    folded every session in them; each session gets a snapshot at or after its last event
    there; the partition is detached (CONCURRENTLY: writers are never blocked; it waits for
    transactions that could still insert into it, and for open snapshots), what it holds is
    checked again, exported (COPY, gzip) with a sha256 manifest, recorded and dropped. A row is
    always in the ledger or in the archive. The only way ledger data is removed."""
    from ledger_cdc.admin.archive import archive

    bound = _duration(older)
    with _connect(dsn) as conn, state.console.status("archiving…") as status:
        done = archive(conn, bound, to_dir, on_partition=lambda n: status.update(f"archiving {n}…"))
    if not done:
        state.console.print(f"nothing to archive: no partition ends more than {safe(older)} ago")
    for a in done:
        state.console.print(
            f"archived {a.name} ({a.start:%Y-%m-%d} – {a.end:%Y-%m-%d}): {a.events} events of "
            f"{a.sessions} sessions → {safe(a.file)} (sha256 {a.file_sha256[:16]}…), "
            f"{a.snapshots_taken} snapshot(s) taken; partition dropped"
        )


# -- tail -----------------------------------------------------------------------------------------


@cli.command()
@dsn_option
@click.argument("session", type=NAME, required=False)
@names_options
@option(
    "--nats",
    "nats_url",
    default=None,
    envvar=_env("NATS"),
    help="Follow from JetStream (nats://host:4222[,…]) instead of PostgreSQL.",
)
@option(
    "--after",
    default=0,
    show_default=True,
    help="Start after this position (0: from the first event).",
)
@option("--count", type=click.IntRange(1), default=None, help="Exit after N events.")
@option("--json", "as_json", is_flag=True, help="One JSON object per event.")
@click.pass_obj
@handles_errors
def tail(
    state: State,
    dsn: str,
    session: Any,
    names: Names,
    nats_url: str | None,
    after: int,
    count: int | None,
    as_json: bool,
) -> None:
    """Follow one session live, event by event, as the consumer commits it: from JetStream
    with --nats, else from PostgreSQL (woken by the consumer's notifications, no polling
    loop). Replaces LISTEN/NOTIFY tails and `seq > last` pollers. Ctrl-C stops.

    SESSION is a session id, or a name of its framework: thread:ID (LangGraph), openai:ID
    (OpenAI Agents), pydantic:ID (Pydantic AI), or a bare name looked up in all three; framework
    events are shown decoded, as inspect shows them."""
    import asyncio

    from ledger_cdc.admin.readable import describe as summarise
    from ledger_cdc.client.tail import follow_jetstream, follow_postgres
    from ledger_cdc.events import Rejected

    with _connect(dsn) as conn:
        named = names.one(conn, session)
    session = named.session_id
    ns = named.checkpoint_ns

    async def run() -> None:
        if nats_url:
            from ledger_cdc.sink.jetstream import JetStreamSettings

            events: Any = follow_jetstream(
                JetStreamSettings.from_url(nats_url, "--nats"), session, after=after, dsn=dsn
            )
        else:
            events = follow_postgres(dsn, session, after=after)
        n = 0
        async for ev in events:
            if ns is not None and getattr(getattr(ev, "payload", None), "ns", ns) != ns:
                continue
            if as_json:
                click.echo(jsonlib.dumps(_tail_json(ev)), nl=True)
            else:
                when = "—" if isinstance(ev, Rejected) else f"{ev.created_at:%H:%M:%S.%f}"[:-3]
                state.console.print(
                    f"{ev.position:>6} {when}  {safe(ev.agent_id)}  "
                    f"[bold]{safe(ev.event_type)}[/]  {safe(summarise(ev))}",
                    highlight=False,
                    soft_wrap=True,
                )
            sys.stdout.flush()
            n += 1
            if count is not None and n >= count:
                return

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())


def _tail_json(ev: Any) -> dict[str, Any]:
    from ledger_cdc.events import Rejected

    if type(ev) is Rejected:
        return {
            "seq": ev.seq,
            "position": ev.position,
            "agent_id": ev.agent_id,
            "event_type": ev.event_type,
            "quarantined": ev.reason,
        }
    return {
        "seq": ev.seq,
        "position": ev.position,
        "agent_id": ev.agent_id,
        "event_type": ev.event_type,
        "payload": msgspec.to_builtins(ev.payload),
        "created_at": ev.created_at.isoformat(),
    }
