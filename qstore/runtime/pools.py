"""The worker's connection pool of its own (``WorkerSettings.own_pool``).

A worker's threads check connections out many times a second: each claim cycle per claim,
the completion batcher per flush, the maintainer per task, the keeper per heartbeat batch.
On the application's pool they add to the application's own checkouts, and a
``QueuePool`` keeps only ``pool_size`` connections: whenever more than that are in use at
once, the ones above it are opened for the checkout and closed again at check-in (the
pool's overflow). With SQLAlchemy's default pool (5 kept, 10 more allowed), a worker and a
few application threads that enqueue together keep the pool opening and closing
connections all the time, and every claim or enqueue that lands on a new connection waits
for a server process to start. A worker on a pool of its own neither churns the
application's connections nor waits for them.

:func:`own_pool_engine` gives the worker that pool without giving up anything the
application configured on its engine.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine
from sqlalchemy.engine.base import OptionEngine
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.pool import Pool

__all__ = ["own_pool_async_engine", "own_pool_engine"]


class _OwnPoolEngine(OptionEngine):
    """An engine that is its parent in every respect (dialect, URL, execution options,
    compiled cache, and the parent's event listeners, including ones added later) except
    that it checks connections out of a pool of its own."""

    def __init__(self, parent: Engine) -> None:
        super().__init__(parent, {})
        self.__dict__["_own_pool"] = parent.pool.recreate()

    # OptionEngine reads and writes its parent's pool through this property; an engine of
    # a pool of its own keeps its pool here instead (``dispose`` assigns a new one)
    @property
    def pool(self) -> Pool:
        pool: Pool = self.__dict__["_own_pool"]
        return pool

    @pool.setter
    def pool(self, pool: Pool) -> None:
        self.__dict__["_own_pool"] = pool


def own_pool_engine(engine: Engine) -> Engine:
    """``engine`` on a new pool made by ``engine.pool.recreate()``: the same pool class and
    sizes, the same connect function (the engine's URL and ``connect_args``) and the pool's
    event listeners (``connect``, ``checkout``, ... registered so far). Statements sent
    through the returned engine fire ``engine``'s engine events as the engine's own do.
    Nothing is connected until the first checkout; dispose of the pool
    (``returned.pool.dispose()``) when done with it."""
    return _OwnPoolEngine(engine)


def own_pool_async_engine(engine: AsyncEngine) -> AsyncEngine:
    """:func:`own_pool_engine` for an ``AsyncEngine`` (its synchronous engine on a pool of
    its own, wrapped again)."""
    own: Any = _OwnPoolEngine(engine.sync_engine)
    return AsyncEngine(own)
