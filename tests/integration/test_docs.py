"""Every example of the documentation runs, as a reader would type it, against a real server.

Each page of ``docs/`` (and ``README.md``, see ``test_readme.py``) is read like a script: its
fenced blocks run in order, the Python ones in one namespace of the page's own, the shell ones
(``sh``, ``console``, ``bash``) by ``sh -e`` with this environment's ``ledger-cdc`` first on the
PATH. The examples name their database ``postgresql://ROLE@db/app``; each is pointed at the
test's database, logged in as a role of its own made for the test: ``svc`` (``ledger_writer``),
``worker`` (``ledger_writer`` and ``ledger_reader``), ``cdc`` (``ledger_consumer``, REPLICATION),
``dispatch`` (``ledger_dispatcher``) and ``reader`` (``ledger_reader``); ``admin`` is the
database's owner. So an example that logs in as a role too weak for what it does fails here.

An HTML comment right above a block tells how it runs:

- ``<!-- not run: REASON -->``: shown, not run (a reason is required);
- ``<!-- background: until "TEXT" -->``: a shell command a reader leaves running in another
  terminal: started, waited for until its output holds TEXT, and stopped at the end of the page
  (or before a block marked ``<!-- background commands stopped first -->``) with SIGINT, as
  Ctrl-C would; it must then exit 0 (130 for a command that ends on Ctrl-C) with no error;
- ``<!-- exit: N -->``: the shell block's expected exit status (0 by default).

In a shell block, ``$NAME`` is the value of the Python name ``NAME`` the page's earlier blocks
set (the text says so, e.g. ``SESSION``), and a ``--metrics-port`` is moved to a free port. A
``pip install 'ledger-cdc[EXTRAS]'`` line is never run: the extras it names must exist and bring
every package the page's Python blocks import (``test_install_lines_bring_what_the_page_imports``).
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest
from packaging.requirements import Requirement
from psycopg import sql

from tests.support.cdc import ROOT
from tests.support.harness import Database
from tests.support.wait import until

DOCS = ROOT / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if not p.relative_to(DOCS).parts[0].startswith("_"))

_FENCE = re.compile(
    r"^(?P<indent>[ ]*)```(?P<lang>[\w-]*)[^\n]*\n(?P<code>.*?)^(?P=indent)```", re.M | re.S
)
_DSN = re.compile(r"postgresql://(?P<role>\w+)@db/app")
_NAME = re.compile(r"\$\{?([A-Za-z_]\w*)\}?")
_PIP = re.compile(r"pip install (?:-\S+ )*['\"]?ledger-cdc\[(?P<extras>[\w,-]+)\]")
SHELL = {"sh", "console", "bash"}
PYTHON = {"python", "py"}
NOT_EXAMPLES = {"text", "sql", "toml", "yaml", "json", "ini"}

# login role made for the test → the group roles it is in (and its attributes)
ROLES = {
    "svc": ("IN ROLE ledger_writer", ""),
    "worker": ("IN ROLE ledger_writer, ledger_reader", ""),
    "reader": ("IN ROLE ledger_reader", ""),
    "cdc": ("IN ROLE ledger_consumer", "REPLICATION"),
    "dispatch": ("IN ROLE ledger_dispatcher", ""),
}


@dataclass
class Block:
    path: Path
    line: int
    lang: str
    code: str
    not_run: str | None = None
    background: str | None = None
    exit_code: int = 0
    stop_background_first: bool = False

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.not_run is None and (self.lang in PYTHON or self.lang in SHELL)


def _directives(before: str) -> list[str]:
    """The HTML comments between the previous text and a fence (blank lines allowed)."""
    out: list[str] = []
    rest = before.rstrip()
    while rest.endswith("-->"):
        start = rest.rfind("<!--")
        out.append(" ".join(rest[start + 4 : -3].split()))
        rest = rest[:start].rstrip()
    return out[::-1]


def blocks(path: Path) -> list[Block]:
    text = path.read_text()
    found = []
    for m in _FENCE.finditer(text):
        code = m["code"]
        if m["indent"]:  # a block inside an admonition or a list item
            code = re.sub(rf"^{m['indent']}", "", code, flags=re.M)
        b = Block(path, text[: m.start()].count("\n") + 1, m["lang"], code)
        for d in _directives(text[: m.start()]):
            if d.startswith("not run:"):
                b.not_run = d.removeprefix("not run:").strip()
                assert b.not_run, f"{b.where}: 'not run' without a reason"
            elif m2 := re.fullmatch(r'background: until "(.+)"', d):
                b.background = m2[1]
            elif m2 := re.fullmatch(r"exit: (\d+)", d):
                b.exit_code = int(m2[1])
            elif d == "background commands stopped first":
                b.stop_background_first = True
            else:
                raise AssertionError(f"{b.where}: unknown directive <!-- {d} -->")
        found.append(b)
    return found


def runnable_pages() -> list[Path]:
    return [p for p in PAGES if any(b.runs for b in blocks(p))]


# -- running a page ---------------------------------------------------------------------------


@dataclass
class Logins:
    db: Database

    def url(self, role: str) -> str:
        if role == "admin":
            return self.db.server.pg.url(self.db.name)
        assert role in ROLES, f"no test login for the role {role!r} an example names"
        return self.db.server.pg.url(self.db.name, f"{role}_{self.db.name}")


@pytest.fixture
def logins(db: Database) -> Iterator[Logins]:
    """The examples' login roles, made for this test's database (role names are cluster-wide)."""
    made = [f"{role}_{db.name}" for role in ROLES]
    with psycopg.connect(db.server.dsn(), autocommit=True) as admin:
        for name, (groups, attrs) in zip(made, ROLES.values(), strict=True):
            admin.execute(
                sql.SQL(f"CREATE ROLE {{}} LOGIN {attrs} {groups}").format(sql.Identifier(name))
            )
    try:
        yield Logins(db)
    finally:
        with db.connect() as conn, psycopg.connect(db.server.dsn(), autocommit=True) as admin:
            for name in made:
                conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
                admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Background:
    block: Block
    proc: subprocess.Popen[str]
    output: list[str] = field(default_factory=list)
    reader: threading.Thread | None = None

    def start_reading(self) -> None:
        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.output.append(line)

        self.reader = threading.Thread(target=read, daemon=True)
        self.reader.start()

    @property
    def text(self) -> str:
        return "".join(self.output)


class Reader:
    """Runs a page's blocks in order, as a reader would."""

    def __init__(self, logins: Logins | None, name: str) -> None:
        self.logins = logins
        self.namespace: dict[str, Any] = {"__name__": name}
        self.background: list[Background] = []

    def rewrite(self, code: str) -> str:
        if self.logins is None:
            return code
        return _DSN.sub(lambda m: self.logins.url(m["role"]), code)  # type: ignore[union-attr]

    def run(self, b: Block) -> None:
        if b.stop_background_first:
            self.stop_background()
        if b.lang in PYTHON:
            self.python(b)
        else:
            self.shell(b)

    def python(self, b: Block) -> None:
        source = self.rewrite(b.code)
        done = threading.Event()
        error: list[BaseException] = []

        def run() -> None:
            try:
                exec(compile(source, b.where, "exec"), self.namespace)
            except BaseException as e:
                error.append(e)
            finally:
                done.set()

        # a thread of its own: a block that never returns fails the test, not the run
        threading.Thread(target=run, daemon=True).start()
        assert done.wait(120), f"{b.where} did not finish within 120 s"
        if error:
            raise AssertionError(f"{b.where} failed: {error[0]!r}") from error[0]

    def env(self, code: str, b: Block) -> dict[str, str]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "120"}
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        assigned = set(re.findall(r"^\s*([A-Za-z_]\w*)=", code, re.M))
        for name in set(_NAME.findall(code)) - assigned:
            if name in self.namespace:
                env[name] = str(self.namespace[name])
            else:
                assert name in env, f"{b.where}: ${name} is set by no earlier block of the page"
        return env

    def shell(self, b: Block) -> None:
        code = self.rewrite(b.code)
        code = re.sub(r"--metrics-port \d+", lambda _: f"--metrics-port {_free_port()}", code)
        env = self.env(code, b)
        if b.background is not None:
            commands = [c for c in code.splitlines() if c.strip() and not c.startswith("#")]
            assert len(commands) == 1, f"{b.where}: a background block holds one command"
            proc = subprocess.Popen(
                ["sh", "-c", "exec " + commands[0]],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
                cwd=ROOT,
            )
            bg = Background(b, proc)
            bg.start_reading()
            self.background.append(bg)

            def started() -> bool:
                assert proc.poll() is None, f"{b.where} exited {proc.returncode}:\n{bg.text}"
                return b.background in bg.text

            until(started, 60, what=lambda: f"{b.where}: {b.background!r}:\n{bg.text}")
            return
        r = subprocess.run(
            ["sh", "-ec", code],
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
            timeout=180,
        )
        assert r.returncode == b.exit_code, (
            f"{b.where} exited {r.returncode}, not {b.exit_code}:\n{r.stdout}\n{r.stderr}"
        )
        assert "Traceback" not in r.stderr, f"{b.where}:\n{r.stderr}"

    def stop_background(self) -> None:
        running, self.background = self.background, []
        for bg in running:
            bg.proc.send_signal(signal.SIGINT)  # Ctrl-C in the reader's other terminal
        for bg in running:
            try:
                code = bg.proc.wait(60)
            except subprocess.TimeoutExpired:
                bg.proc.kill()
                raise AssertionError(
                    f"{bg.block.where} did not stop on Ctrl-C:\n{bg.text}"
                ) from None
            if bg.reader is not None:
                bg.reader.join(10)
            assert code in (0, 130), f"{bg.block.where} exited {code}:\n{bg.text}"
            assert "error:" not in bg.text and "Traceback" not in bg.text, (
                f"{bg.block.where}:\n{bg.text}"
            )

    def close(self) -> None:
        try:
            self.stop_background()
        finally:
            for value in list(self.namespace.values()):  # a throwaway server a page started
                if type(value).__name__ == "EmbeddedPostgres":
                    value.cleanup()


def read_page(path: Path, logins: Logins | None) -> None:
    reader = Reader(logins, f"__docs_{path.stem}__")
    try:
        for b in blocks(path):
            if b.runs:
                reader.run(b)
    finally:
        reader.close()


# -- the tests --------------------------------------------------------------------------------


@pytest.mark.server
@pytest.mark.parametrize("page", runnable_pages(), ids=lambda p: str(p.relative_to(DOCS)))
def test_every_example_of_the_page_runs(page: Path, logins: Logins) -> None:
    if sys.version_info < (3, 11) and page.name == "pydantic-ai.md":
        pytest.skip("the pydantic-ai extra needs Python 3.11, as the page says")
    read_page(page, logins)


def run_twice(block: Block, logins: Logins) -> None:
    """A reader runs an example again, in a new session of Python: it must not collide with what
    it wrote the first time (keys new each time, or idempotent)."""
    for _ in range(2):
        reader = Reader(logins, "__docs_twice__")
        try:
            reader.run(block)
        finally:
            reader.close()


@pytest.mark.server
def test_the_first_writing_example_runs_twice(logins: Logins) -> None:
    run_twice(
        next(b for b in blocks(DOCS / "how-to" / "write-events.md") if b.lang in PYTHON), logins
    )


def test_every_block_is_an_example_or_says_why_not() -> None:
    """Every fence names its language, every shell or Python block runs or gives a reason, and
    the examples name their database one way (a new spelling would silently go unrewritten)."""
    for page in [*PAGES, ROOT / "README.md"]:
        for b in blocks(page):
            assert b.lang, f"{b.where}: a fence without a language"
            assert b.lang in SHELL | PYTHON | NOT_EXAMPLES, f"{b.where}: unknown language {b.lang}"
            if not b.runs:
                continue
            for url in re.findall(r"postgresql://[^\s\"')]+", _code_without_comments(b)):
                assert _DSN.fullmatch(url), f"{b.where}: {url}"
            if b.lang in SHELL and b.not_run is None:
                assert "pip install" not in b.code, f"{b.where}: mark a pip install 'not run'"


def _code_without_comments(b: Block) -> str:
    if b.lang in PYTHON:  # the strings only: a comment may show what a line prints
        tree = ast.parse(b.code)
        return "\n".join(
            n.value
            for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str)
        )
    return "\n".join(re.sub(r"(^|\s)#.*", "", line) for line in b.code.splitlines())


def test_the_docs_have_examples() -> None:
    assert len(runnable_pages()) >= 10


# -- the install lines ------------------------------------------------------------------------


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements(dist: str, extras: set[str]) -> set[str]:
    """The distributions ``dist`` with ``extras`` depends on, transitively (installed metadata)."""
    seen: set[str] = set()
    todo = [(dist, extras)]
    while todo:
        name, wanted = todo.pop()
        for line in md.requires(name) or []:
            req = Requirement(line)
            envs = [{"extra": e} for e in wanted] or [{"extra": ""}]
            if req.marker is not None and not any(req.marker.evaluate(e) for e in envs):
                continue
            if _norm(req.name) not in seen:
                seen.add(_norm(req.name))
                try:
                    md.distribution(req.name)
                except md.PackageNotFoundError:
                    continue
                todo.append((req.name, set(req.extras)))
    return seen


def _providers(module: str) -> set[str]:
    """The installed distributions whose files hold ``module``."""
    top = module.split(".")[0]
    candidates = md.packages_distributions().get(top, [])
    if len(set(candidates)) <= 1:
        return {_norm(c) for c in candidates}
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, module
    origin = Path(spec.origin).resolve()
    out = set()
    for c in set(candidates):
        dist = md.distribution(c)
        if any(Path(str(dist.locate_file(f))).resolve() == origin for f in dist.files or []):
            out.add(_norm(c))
    return out


def _imports(code: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
    return {m for m in found if m.split(".")[0] not in sys.stdlib_module_names | {"ledger_cdc"}}


@pytest.mark.parametrize(
    "page",
    [p for p in [*PAGES, ROOT / "README.md"] if _PIP.search(p.read_text())],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_install_lines_bring_what_the_page_imports(page: Path) -> None:
    """``pip install 'ledger-cdc[X]'`` on a page brings what its examples import: each module is
    installed by a distribution the package needs with those extras."""
    if sys.version_info < (3, 11) and page.name == "pydantic-ai.md":
        pytest.skip("the pydantic-ai extra needs Python 3.11")
    known = set(md.metadata("ledger-cdc").get_all("Provides-Extra") or [])
    extras: set[str] = set()
    for m in _PIP.finditer(page.read_text()):
        named = set(m["extras"].split(","))
        assert named <= known, f"{page.name}: no extra {named - known} in pyproject.toml"
        extras |= named
    needed = _requirements("ledger-cdc", extras)
    for b in blocks(page):
        if b.lang not in PYTHON:
            continue
        for module in sorted(_imports(b.code)):
            provided = _providers(module)
            assert provided & needed, (
                f"{b.where}: `import {module}` comes from {sorted(provided)}, which "
                f"'ledger-cdc[{','.join(sorted(extras))}]' does not install"
            )
