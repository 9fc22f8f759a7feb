"""Connection pools that hand out the connection returned last.

psycopg_pool's pools are queues: each request takes the connection idle longest, so a pool
that grew to several connections under a burst serves one request at a time on a different
server backend each time, whose caches have gone cold since its last turn. These take the one
returned last, as SQLAlchemy's ``pool_use_lifo`` does: at low concurrency the same backend
answers, warm, and the others stay idle, so that the pool's shrinking closes the one idle
longest.

The order is changed where the pool decides, under its lock, which idle connection a request
gets (``_get_ready_connection``, which takes the leftmost of the idle ``deque``): the rightmost
(returned last) is moved to the left first. ``tests/integration/test_pools.py`` holds the order,
so a psycopg_pool that moves that decision elsewhere fails a test rather than going back to a
queue.
"""

from __future__ import annotations

from typing import Any

from psycopg_pool import AsyncConnectionPool, ConnectionPool

__all__ = ["AsyncLifoPool", "LifoPool"]


class LifoPool(ConnectionPool[Any]):
    """A :class:`psycopg_pool.ConnectionPool` that gives out the connection returned last."""

    def _get_ready_connection(self, timeout: float | None) -> Any:
        self._pool.rotate(1)  # the idle connection returned last to the front
        return super()._get_ready_connection(timeout)


class AsyncLifoPool(AsyncConnectionPool[Any]):
    """An :class:`psycopg_pool.AsyncConnectionPool` that gives out the connection returned
    last."""

    async def _get_ready_connection(self, timeout: float | None) -> Any:
        self._pool.rotate(1)  # the idle connection returned last to the front
        return await super()._get_ready_connection(timeout)
