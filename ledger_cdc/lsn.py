"""Log sequence numbers as PostgreSQL prints them (``0/16B3A40``) and as integers."""

from __future__ import annotations

__all__ = ["format_lsn", "parse_lsn"]


def format_lsn(lsn: int) -> str:
    """An LSN as PostgreSQL prints it: ``16B3A40`` → ``0/16B3A40``."""
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def parse_lsn(text: str) -> int:
    """``'0/16B3A40'`` → integer LSN; raises ValueError on anything else
    (``errors.parse_lsn`` raises ConfigError)."""
    hi, sep, lo = text.strip().partition("/")
    try:
        if not sep:
            raise ValueError(text)
        return (int(hi, 16) << 32) | int(lo, 16)
    except ValueError:
        raise ValueError(f"not an LSN: {text!r} (expected the form 0/16B3A40)") from None
