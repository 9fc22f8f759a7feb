"""What every command shares: the ``ledger-cdc`` group, exit codes, the error handler, the
options that every command spells alike, tables.

Exit codes (every command but ``lag`` and ``doctor``; each command's ``--help`` ends with its own):
  0  success
  1  the command ran and found a problem it reports (e.g. differences)
  2  usage error (bad option or argument)
  3  the replication slot is missing, invalidated, or not a pgoutput slot of this database
     (consume, slot drop)
  4  configuration or connection error (bad DSN, bad name, missing binaries)
  5  any other ledger-cdc error
``lag`` and ``doctor`` are checks (:class:`CheckCommand`): 0 OK, 1 warning, 2 critical, 3
unknown, whatever made them unable to tell (a usage error, a connection refused) included.
An error is printed as one red line on stderr, with a hint where there is one.
"""

from __future__ import annotations

import math
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial, wraps
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.markup import escape
from rich.rule import Rule
from rich.table import Table
from rich.text import Text

from ledger_cdc._version import __version__
from ledger_cdc.errors import LedgerError
from ledger_cdc.settings import DAY

F = TypeVar("F", bound=Callable[..., Any])

EXIT_PROBLEM = 1
EXIT_SLOT = 3
EXIT_CONFIG = 4
EXIT_ERROR = 5
EXIT_UNKNOWN = 3  # a check's (lag, doctor): it could not tell
# ctx.meta key: the exit code every error of the command takes (a check's errors are UNKNOWN)
_ERROR_EXIT = "ledger_cdc.error_exit"

EXIT_CODES = {
    0: "success",
    1: "the command found a problem it reports",
    2: "usage error (bad option or argument)",
    3: "the slot is missing, invalidated or not this database's pgoutput slot (a command "
    "that uses one)",
    4: "configuration or connection error (a bad DSN or name, credentials, privileges, "
    "schema; the server unreachable)",
    5: "any other error",
}
"""What every command's exit codes mean, unless its help says otherwise."""


@dataclass
class State:
    console: Console
    err: Console


def fail(e: BaseException) -> None:
    """Any error as one red line on stderr (its password removed) and its exit code."""
    import logging

    from ledger_cdc.errors import describe, translate
    from ledger_cdc.redact import redact

    dsn = None
    ctx = click.get_current_context(silent=True)
    if ctx is not None:
        for c in (ctx, *_parents(ctx)):
            dsn = dsn or c.params.get("dsn")
    if not isinstance(e, LedgerError) and _is_driver_error(e):
        e = translate(e, dsn=dsn)
    if isinstance(e, LedgerError):
        text = redact(" ".join(str(e).split()) or type(e).__name__, dsn)
        code = e.exit_code
        if ctx is not None and _ERROR_EXIT in ctx.meta:
            code = ctx.meta[_ERROR_EXIT]
    else:
        logging.getLogger(__name__).debug("internal error", exc_info=e)
        text = (
            f"internal error: {type(e).__name__}: {describe(e, dsn)} (a bug: please report it; "
            "LEDGER_CDC_DEBUG=1 shows the traceback)"
        )
        code = EXIT_ERROR if ctx is None else ctx.meta.get(_ERROR_EXIT, EXIT_ERROR)
    err = Console(stderr=True, highlight=False)
    err.print(f"[bold red]error:[/] {safe(text)}", soft_wrap=True, markup=True)
    if os.environ.get("LEDGER_CDC_DEBUG"):
        import traceback

        traceback.print_exception(e)
    sys.exit(code)


def _parents(ctx: click.Context) -> list[click.Context]:
    out = []
    while ctx.parent is not None:
        ctx = ctx.parent
        out.append(ctx)
    return out


def _is_driver_error(e: BaseException) -> bool:
    mod = type(e).__module__
    return mod.startswith(("psycopg", "psycopg2"))


def handles_errors(fn: F) -> F:
    """Turn any error into one red line and its exit code (no traceback, no password)."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (click.ClickException, click.exceptions.Exit, click.Abort, SystemExit):
            raise
        except KeyboardInterrupt:
            sys.exit(130)
        except Exception as e:
            fail(e)

    return wrapper  # type: ignore[return-value]


def print_records(
    console: Console,
    title: str,
    columns: list[str],
    rows: list[list[str]],
    *,
    title_style: str | None = None,
    caption: str | None = None,
) -> None:
    """Rows as a table when the terminal is wide enough for every column unbroken, else one
    block per row (header, value) — never headers split mid-word at 80 columns."""
    widths = [
        max([len(c), *(min(len(Text.from_markup(r[i]).plain), 40) for r in rows)])
        for i, c in enumerate(columns)
    ]
    if sum(widths) + 3 * len(columns) + 1 <= console.width:
        t = Table(title=title, title_style=title_style, caption=caption)
        for col in columns:
            t.add_column(col, overflow="fold")
        for r in rows:
            t.add_row(*r)
        console.print(t)
        return
    console.print(Text(title, style=title_style or "bold"))
    key_width = max(len(c) for c in columns)
    for r in rows:
        t = Table(show_header=False, box=None, padding=(0, 1), pad_edge=False)
        t.add_column(no_wrap=True, width=key_width, style="dim")
        t.add_column(overflow="fold")
        for col, value in zip(columns, r, strict=True):
            t.add_row(col, value)
        console.print(Rule(style="dim"))
        console.print(t)
    if caption:
        console.print(Text(caption, style="dim"))


# C0 (but tab and newline), DEL, C1 and the bidirectional overrides: what can move the cursor,
# recolour or rewrite a terminal, or make text read other than it is
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def printable(value: object) -> str:
    """Text from the ledger or the server (agent ids, payloads, error messages) made safe for a
    terminal: control characters shown as their escapes (``\\x1b``), nothing interpreted."""
    text = str(value)
    if _CONTROL.search(text) is None:
        return text
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


def safe(value: object) -> str:
    """:func:`printable`, with rich markup escaped: for untrusted text inside a markup string
    or a table cell (``[/]`` in an agent id must print as itself, not end a style)."""
    return escape(printable(value))


class Finite(click.FloatRange):
    """A float option's type: ``click.FloatRange`` that also refuses NaN and ±inf (``nan``
    passes every range check; ``inf`` seconds overflows a wait)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return rv


class Interval(Finite):
    """Seconds between runs of a periodic task: 0 (off), or from ``least`` (a denormal such as
    ``1e-320`` would run it without pause: a busy loop of queries) to a day."""

    def __init__(self, least: float = 0.1) -> None:
        super().__init__(0, DAY)
        self.least = least

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        rv = super().convert(value, param, ctx)
        if 0 < rv < self.least:
            self.fail(f"{value!r} is neither 0 (off) nor from {self.least:g} to {DAY}.", param, ctx)
        return rv

    def _describe_range(self) -> str:  # (the help's range)
        return f"0 or {self.least:g}<=x<={DAY}"


class LedgerCommand(click.Command):
    """A command whose help ends with its exit codes: ``exit_codes`` (code → meaning), or else
    :data:`EXIT_CODES`."""

    def __init__(self, *args: Any, exit_codes: dict[int, str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.exit_codes = EXIT_CODES if exit_codes is None else exit_codes

    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        super().format_epilog(ctx, formatter)
        with formatter.section("Exit codes"):
            formatter.write_dl([(str(code), what) for code, what in self.exit_codes.items()])


class _UnknownUsage(click.UsageError):
    exit_code = EXIT_UNKNOWN


class _Unknown(click.ClickException):
    exit_code = EXIT_UNKNOWN


class CheckCommand(LedgerCommand):
    """A check (``lag``, ``doctor``), whose exit status is a monitoring plugin's state (Nagios,
    Icinga, Sensu and the scripts written like them): 0 OK, 1 warning, 2 critical, 3 unknown.
    Whatever keeps it from telling ends it with 3: a usage error (click's code, 2, would read
    as critical), a connection refused, any error (exit 4 or 5 elsewhere). The check's own
    verdict is its ``sys.exit(0..2)``."""

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.UsageError as e:  # (parsing: a missing --dsn, a bad value)
            raise _UnknownUsage(e.format_message(), e.ctx) from e

    def invoke(self, ctx: click.Context) -> Any:
        ctx.meta[_ERROR_EXIT] = EXIT_UNKNOWN  # read by fail()
        try:
            return super().invoke(ctx)
        except click.UsageError as e:  # (raised by the command: --warn-x above --crit-x)
            raise _UnknownUsage(e.format_message(), e.ctx) from e
        except click.ClickException as e:
            if e.exit_code == EXIT_UNKNOWN:
                raise
            raise _Unknown(e.format_message()) from e


class LedgerGroup(click.Group):
    """The group: its commands are :class:`LedgerCommand` (exit codes in their help), its
    subgroups of its own kind."""

    command_class = LedgerCommand
    group_class = type


option = partial(click.option, show_envvar=True)
"""``click.option`` whose help shows its environment variable: the shared options have fixed
names (``LEDGER_CDC_DSN`` serves every command), the others get click's automatic ones
(``LEDGER_CDC_<COMMAND>_<OPTION>``, from the group's ``auto_envvar_prefix``)."""


class Dsn(click.ParamType):  # type: ignore[type-arg]
    """A libpq connection string or URL: not empty (libpq would take its defaults, the local
    socket) and without a NUL (libpq would read up to it)."""

    name = "DSN"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        text = str(value)
        if not text.strip():
            self.fail("is empty: give host, port and database (libpq would take its defaults)")
        if "\x00" in text:
            self.fail("holds a NUL character")
        if param is not None and ctx is not None and not ctx.resilient_parsing:
            _warn_password_on_command_line(text, param, ctx)
        return text


def _warn_password_on_command_line(dsn: str, param: click.Parameter, ctx: click.Context) -> None:
    """One line on stderr when a DSN given on the command line holds a password: every user of
    the machine reads a process's arguments (``ps``, ``/proc/*/cmdline``); the environment and
    a passfile are the process owner's alone. Not an error: the command goes on."""
    from click.core import ParameterSource

    if ctx.get_parameter_source(param.name or "") is not ParameterSource.COMMANDLINE:
        return
    if "password" not in dsn.lower() and "@" not in dsn:
        return  # (no password can be in it: libpq is not asked)
    from psycopg import Error
    from psycopg.conninfo import conninfo_to_dict

    try:
        if not conninfo_to_dict(dsn).get("password"):
            return
    except Error:
        return  # a DSN that does not parse: the connection says why
    envvar = param.envvar if isinstance(param, click.Option) else None
    if isinstance(envvar, (list, tuple)):
        envvar = envvar[0] if envvar else None
    if not envvar and ctx.auto_envvar_prefix and param.name:
        envvar = f"{ctx.auto_envvar_prefix}_{param.name.upper()}"
    flag = param.opts[0] if param.opts else param.name
    click.echo(
        f"warning: the password in {flag} can be read by every user of this machine in the "
        f"process list (ps): give the DSN in {envvar or 'the environment'} instead, or the "
        "password in a passfile (~/.pgpass, PGPASSFILE, or passfile=… in the DSN)",
        err=True,
    )


DSN = Dsn()

dsn_option = option(
    "--dsn",
    envvar="LEDGER_CDC_DSN",
    required=True,
    type=DSN,
    help="libpq connection string or URL of the ledger database.",
)


@click.group(
    cls=LedgerGroup,
    context_settings={
        "help_option_names": ["-h", "--help"],
        "max_content_width": 100,
        "auto_envvar_prefix": "LEDGER_CDC",
    },
)
@click.version_option(__version__, "-V", "--version", prog_name="ledger-cdc")
@click.pass_context
def cli(ctx: click.Context) -> None:
    """PostgreSQL's write-ahead log as the state ledger of multi-agent systems.

    Writers only INSERT agent steps into agent_events; one consumer reads the agent_slot
    pgoutput stream in commit order and folds it into per-session projections.

    \b
    Start here:
      ledger-cdc demo               agents writing to a throwaway local PostgreSQL
      ledger-cdc init --dsn DSN     create the ledger schema, publication (and slot)
    """
    ctx.obj = State(console=Console(), err=Console(stderr=True))


def _env(name: str) -> str:
    return f"LEDGER_CDC_{name}"


def ahead_option(name: str, what: str) -> Callable[[F], F]:
    """How many partitions beyond the current one (``ledger_ensure_partitions`` takes 0-120)."""
    return option(name, default=3, show_default=True, type=click.IntRange(0, 120), help=what)


def log_format_option(
    what: str = "auto: a live status line on a terminal, text lines otherwise",
) -> Callable[[F], F]:
    return option(
        "--log-format",
        type=click.Choice(["auto", "text", "json"]),
        default="auto",
        show_default=True,
        envvar=_env("LOG_FORMAT"),
        help=f"{what}.",
    )


def options(*decorators: Callable[[F], F]) -> Callable[[F], F]:
    """Several options as one decorator, listed as they appear in the help (the first on top):
    a command's options declared once, in groups, where a stack of decorators would be long."""

    def apply(fn: F) -> F:
        for decorate in reversed(decorators):
            fn = decorate(fn)
        return fn

    return apply


# options that several commands share (init, slot create, consume, fold)
failover_option = option(
    "--failover",
    is_flag=True,
    envvar=_env("FAILOVER"),
    help="Make a slot this creates a failover slot (PostgreSQL 17+): a standby with "
    "sync_replication_slots keeps it in step, so it survives the standby's promotion.",
)
target_dsn_option = option(
    "--target-dsn",
    default=None,
    type=DSN,
    envvar=_env("TARGET_DSN"),
    help="Database for the projections (default: the ledger database).",
)
snapshot_every_option = option(
    "--snapshot-every",
    default=100,
    show_default=True,
    type=click.IntRange(0, 2**31),
    envvar=_env("SNAPSHOT_EVERY"),
    help="Snapshot a session every N events (and at task end); 0: only at task end.",
)


def stop_timeout_option(holds: str, then: str) -> Callable[[F], F]:
    """``--stop-timeout``: ``holds``, what may keep a stop from ending; ``then``, what becomes
    of the work in hand when it is cut short."""
    return option(
        "--stop-timeout",
        default=30.0,
        show_default=True,
        type=Finite(1, DAY),
        envvar=_env("STOP_TIMEOUT"),
        help=f"Seconds a stop (SIGINT, SIGTERM, SIGHUP) may take to finish the batch in hand: "
        f"past them ({holds}), the process exits with status 4 and {then}.",
    )
