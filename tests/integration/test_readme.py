"""Every Python block of the README runs, in order, as a reader would type them, against a real
server with a consumer streaming (the DSNs of the examples point at the test database)."""

from __future__ import annotations

import re
import sys
import threading
from typing import Any

import pytest

from tests.support.cdc import ROOT, InThread
from tests.support.harness import Database

pytestmark = pytest.mark.server

_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
_DSN = re.compile(r"postgresql://\w+@db/app")


def blocks() -> list[tuple[int, str]]:
    text = (ROOT / "README.md").read_text()
    return [(text[: m.start()].count("\n") + 1, m.group(1)) for m in _BLOCK.finditer(text)]


def test_the_readme_has_python_blocks() -> None:
    assert len(blocks()) >= 5


def test_every_python_block_of_the_readme_runs(db: Database) -> None:
    namespace: dict[str, Any] = {"__name__": "__readme__"}
    with InThread(db.dsn):
        for line, code in blocks():
            if sys.version_info < (3, 11) and "pydantic_ai" in code:
                continue  # its extra needs 3.11, as the README says
            source = _DSN.sub(db.dsn, code)
            done = threading.Event()
            error: list[BaseException] = []

            def run(
                src: str = source,
                at: int = line,
                done: threading.Event = done,
                error: list[BaseException] = error,
            ) -> None:
                try:
                    exec(compile(src, f"README.md:{at}", "exec"), namespace)
                except BaseException as e:
                    error.append(e)
                finally:
                    done.set()

            # a thread of its own: a block that never returns fails the test, not the run
            threading.Thread(target=run, daemon=True).start()
            assert done.wait(120), f"README.md:{line} did not finish within 120 s"
            if error:
                raise AssertionError(f"README.md:{line} failed: {error[0]!r}") from error[0]


def test_readme_dsn_placeholders_are_the_only_ones() -> None:
    """Each example names its database the same way, so the test above can point them all at
    the test server (a new spelling would silently leave one unrun)."""
    for line, code in blocks():
        for url in re.findall(r"postgresql://\S+", code):
            assert _DSN.match(url.strip("\"'),")), f"README.md:{line}: {url}"
