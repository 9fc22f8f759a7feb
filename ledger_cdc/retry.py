"""One backoff for everything that retries: the consumer's reconnects, the dispatcher's database
and the outbox's failed calls.

A delay doubles from ``base`` up to ``cap`` and is spread by ``jitter`` (0.5: between half and
one and a half times the delay), so processes restarted together do not retry in step. The clock
and the random source are injected; :class:`Backoff` decides, the caller waits.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Backoff", "delay"]

_MAX_EXPONENT = 16  # 2**16 × base is past any cap in use; keeps the float finite


def delay(
    attempt: int,
    *,
    base: float,
    cap: float,
    jitter: float = 0.5,
    rand: Callable[[float, float], float] = random.uniform,
) -> float:
    """The wait before retry number ``attempt`` (0 for the first retry)."""
    raw = min(cap, base * 2 ** min(max(attempt, 0), _MAX_EXPONENT))
    return float(raw * rand(1.0 - jitter, 1.0 + jitter))


@dataclass
class Backoff:
    """Consecutive failures and the wait before the next attempt.

    ``healthy_after``: a failure that follows at least that many seconds of success (see
    :meth:`succeeded`) starts the count over; a half-recovery (a leader election, a flapping
    server) keeps backing off instead of retrying in a tight loop. None: any success resets.
    """

    base: float = 0.5
    cap: float = 30.0
    jitter: float = 0.5
    healthy_after: float | None = None
    clock: Callable[[], float] = time.monotonic
    rand: Callable[[float, float], float] = random.uniform
    attempt: int = 0
    _since: float | None = field(default=None, repr=False)

    def succeeded(self) -> None:
        """The operation works again (for now)."""
        if self.healthy_after is None:
            self.attempt = 0
        else:
            self._since = self.clock()

    def failed(self) -> float:
        """A failure: the seconds to wait before the next attempt."""
        since, self._since = self._since, None
        if since is not None and self.clock() - since >= (self.healthy_after or 0.0):
            self.attempt = 0
        wait = delay(self.attempt, base=self.base, cap=self.cap, jitter=self.jitter, rand=self.rand)
        self.attempt = min(self.attempt + 1, _MAX_EXPONENT)
        return wait
