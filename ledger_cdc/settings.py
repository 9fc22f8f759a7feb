"""Numeric settings checked against their ranges, wherever they are given.

The consumer's configuration, the outbox dispatcher, the NATS fold workers and the CLI's
options take intervals, waits and sizes: :func:`check_ranges` names every one out of its range
in one :class:`~ledger_cdc.errors.ConfigError`, and :data:`DAY` is the longest interval any of
them takes. Knows nothing of what the settings drive.
"""

from __future__ import annotations

from ledger_cdc.errors import ConfigError

__all__ = ["DAY", "check_ranges"]

DAY = 86_400
"""Seconds: the longest interval, wait or timeout a setting takes (past it a wait overflows the
platform's clock, or a health check never comes)."""


def _number(x: float) -> str:
    return f"{x:,}" if isinstance(x, int) else f"{x:g}"


def check_ranges(
    what: str,
    settings: object,
    ranges: dict[str, tuple[float, float]],
    off: tuple[str, ...] = (),
) -> None:
    """Raise ConfigError naming every setting of ``settings`` (an attribute each) that is not a
    number from its least to its most in ``ranges`` (NaN is in no range; a bool is no number),
    or 0 for one in ``off`` (0 turns it off)."""
    bad: list[str] = []
    for name, (low, high) in ranges.items():
        value = getattr(settings, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            bad.append(f"{name}={value!r} is not a number")
        elif not (low <= value <= high or (name in off and value == 0)):
            zero = "0 or " if name in off else ""
            bad.append(f"{name}={value!r} is not {zero}from {_number(low)} to {_number(high)}")
    if bad:
        raise ConfigError(f"{what} out of range: " + "; ".join(bad))
