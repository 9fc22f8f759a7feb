"""Passwords taken out of text before it is shown or logged.

A DSN's password may turn up in a driver's error, a server's message or an option echoed back:
:func:`redact` removes it, as given in the DSN and as written as one (``password=…``, a URL's
``user:…@``). It knows nothing of drivers or errors; every message that may quote a DSN passes
through it (:func:`ledger_cdc.errors.translate`, :func:`ledger_cdc.errors.describe`).
"""

from __future__ import annotations

import re
import urllib.parse

__all__ = ["redact"]

_PASSWORD_KV = re.compile(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE)
_PASSWORD_URL = re.compile(r"(://[^:/@\s]*:)([^@\s]*)(@)")
_DSN_PASSWORD_URL = re.compile(r"(://[^:/@]*:)([^@]*)(@)")


def redact(text: str, dsn: str | None = None) -> str:
    """``text`` without any password it may hold (of ``dsn``, or written as one)."""
    if dsn:
        secret = _password_of(dsn)
        if secret:
            # as written, and as libpq quotes it decoded (a URL's %20 is a space in its errors)
            for form in {secret, urllib.parse.unquote(secret)}:
                text = text.replace(form, "***")
    text = _PASSWORD_KV.sub(r"\1***", text)
    return _PASSWORD_URL.sub(r"\1***\3", text)


def _password_of(dsn: str) -> str | None:
    # a DSN is one value, not prose: its URL password runs to the '@' (spaces and all, which
    # libpq then refuses, quoting it)
    m = _DSN_PASSWORD_URL.search(dsn)
    if m and m.group(2):
        return m.group(2)
    m = _PASSWORD_KV.search(dsn)
    if m:
        return m.group(2).strip("'")
    return None
