"""What every command shares: the ``ledger-cdc`` group, exit codes, the error handler, the
options that every command spells alike, tables.

Exit codes (every command):
  0  success
  1  the command ran and found a problem it reports (e.g. differences, unhealthy slot)
  2  usage error (bad option or argument)
  3  the replication slot is missing, invalidated, or not a pgoutput slot of this database
     (lag, consume)
  4  configuration or connection error (bad DSN, bad name, missing binaries)
  5  any other ledger-cdc error
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
from ledger_cdc.errors import DAY, LedgerError

F = TypeVar("F", bound=Callable[..., Any])

EXIT_PROBLEM = 1
EXIT_SLOT = 3
EXIT_CONFIG = 4
EXIT_ERROR = 5


@dataclass
class State:
    console: Console
    err: Console


def fail(e: BaseException) -> None:
    """Any error as one red line on stderr (its password removed) and its exit code."""
    import logging

    from ledger_cdc.errors import describe, redact, translate

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
    else:
        logging.getLogger("ledger_cdc").debug("internal error", exc_info=e)
        text = (
            f"internal error: {type(e).__name__}: {describe(e, dsn)} (a bug: please report it; "
            "LEDGER_CDC_DEBUG=1 shows the traceback)"
        )
        code = EXIT_ERROR
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
        return text


DSN = Dsn()

dsn_option = option(
    "--dsn",
    envvar="LEDGER_CDC_DSN",
    required=True,
    type=DSN,
    help="libpq connection string or URL of the ledger database.",
)


@click.group(
    context_settings={
        "help_option_names": ["-h", "--help"],
        "max_content_width": 100,
        "auto_envvar_prefix": "LEDGER_CDC",
    }
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
