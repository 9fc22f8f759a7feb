"""The README's examples run, in order, as a reader would type them, against a real server: the
same reader as the documentation's (``test_docs.py``: the examples' DSNs point at the test
database, logged in as the role each names; shell blocks run; a block that cannot run says why
in a comment above it), in one namespace for the whole README."""

from __future__ import annotations

import re

import pytest

from tests.integration.test_docs import PYTHON, Logins, blocks, logins, read_page, run_twice
from tests.support.cdc import ROOT

README = ROOT / "README.md"
__all__ = ["logins"]  # the docs' fixture: the examples' login roles


def test_the_readme_has_examples() -> None:
    kinds = [b.lang for b in blocks(README) if b.runs]
    assert kinds.count("python") >= 2 and kinds.count("sh") >= 1


def test_the_readme_is_short() -> None:
    """The front door, not the manual: the manual is docs/."""
    assert len(README.read_text().splitlines()) <= 250


@pytest.mark.server
def test_every_example_of_the_readme_runs(logins: Logins) -> None:
    read_page(README, logins)


@pytest.mark.server
def test_the_readme_write_example_runs_twice(logins: Logins) -> None:
    run_twice(next(b for b in blocks(README) if b.lang in PYTHON), logins)


def test_the_readme_links_resolve() -> None:
    """The README is read on the forge, outside the site: its links into docs/ name files."""
    text = README.read_text()
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
        assert (ROOT / target).exists(), f"README.md links to {target}, which does not exist"
