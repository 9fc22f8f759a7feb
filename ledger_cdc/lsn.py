"""Log sequence numbers as PostgreSQL prints them (``0/16B3A40``) and as integers."""

from __future__ import annotations

import re

__all__ = ["format_lsn", "parse_lsn"]


def format_lsn(lsn: int) -> str:
    """An LSN as PostgreSQL prints it: ``16B3A40`` → ``0/16B3A40``."""
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


_LSN = re.compile(r"([0-9A-Fa-f]{1,8})/([0-9A-Fa-f]{1,8})", re.ASCII)


def parse_lsn(text: str) -> int:
    """``'0/16B3A40'`` → integer LSN; raises ValueError on anything else. Strict: two groups
    of 1–8 ASCII hex digits, as ``pg_lsn`` accepts them (``int(x, 16)`` alone would take signs,
    ``_``, other scripts' digits and values past 64 bits, which the server then refuses)."""
    m = _LSN.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"not an LSN: {text!r} (expected the form 0/16B3A40)")
    return (int(m[1], 16) << 32) | int(m[2], 16)
