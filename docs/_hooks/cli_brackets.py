"""A mkdocs hook: the command line reference is generated from click's help texts, where
``[…][…]`` is option syntax (``nats://host:4222[,nats://…][?stream=…]``), not a Markdown
reference link. mkdocs-autorefs takes such a pair for a cross-reference and fails the strict
build when it finds no target; on pages generated from ``--help`` it is put back as the text it
was."""

from __future__ import annotations

import html
import re
from typing import Any

_AUTOREF = re.compile(
    r"<autoref\b[^>]*?\bidentifier=\"(?P<id>[^\"]*)\"[^>]*>(?P<text>.*?)</autoref>", re.DOTALL
)
_PAGES = {"reference/cli.md"}


def on_page_content(html_text: str, page: Any, **kwargs: Any) -> str:
    if page.file.src_uri not in _PAGES:
        return html_text
    return _AUTOREF.sub(
        lambda m: f"[{m['text']}][{html.escape(html.unescape(m['id']), quote=False)}]", html_text
    )
