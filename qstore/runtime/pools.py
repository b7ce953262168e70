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
application configured on its engine, except that a pool too small for the worker's own
threads is made large enough for them (:class:`ConnectionNeeds`), and a pool that hands one
connection to every caller (``StaticPool``, ``AssertionPool``) is replaced by a queue pool
on the same connect function: the worker's threads each run their own transactions, and on
one shared connection they would interleave them. A worker on the application's pool
(``own_pool=False``) refuses a pool it could not make progress on or would share one
connection over.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.engine.base import OptionEngine
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.pool import AssertionPool, AsyncAdaptedQueuePool, Pool, QueuePool, StaticPool

from qstore.errors import ValidationError

__all__ = ["ConnectionNeeds", "own_pool_async_engine", "own_pool_engine", "pool_capacity", "shares_one_connection"]

#: The overflow of the queue pool that replaces a one-connection pool (SQLAlchemy's default).
ONE_CONNECTION_OVERFLOW = 10


@dataclass(frozen=True)
class ConnectionNeeds:
    """How many pooled connections a worker's own threads use at once (its handlers'
    context calls and the ``LISTEN`` connection, which leaves the pool, not counted).

    ``kept``: connections held for long stretches: one per claim cycle in flight (a busy
    cycle keeps its connection between claims) and the maintainer's and the periodic
    planner's lock holders (each keeps one while it leads). ``brief``: connections held for
    one call at a time: the completion batcher, the heartbeat keeper, a maintenance task and
    the outcome writers."""

    kept: int
    brief: int

    @property
    def least(self) -> int:
        """The smallest pool the worker makes progress on: everything kept, plus one for
        the brief users to take turns on."""
        return self.kept + 1

    @property
    def most(self) -> int:
        """Every user at once: the pool size that lets no worker thread wait for another."""
        return self.kept + self.brief

    def check(self, pool: Pool, source: str, remedy: str = ", or use own_pool=True") -> None:
        """Raise :class:`~qstore.errors.ValidationError` naming ``source`` when ``pool``
        allows fewer connections at once than :attr:`least` (the worker would wait for
        connections its own threads never give back) or hands one connection to every
        caller (:func:`shares_one_connection`: the worker's transactions would interleave on
        it); ``remedy`` ends the message."""
        if shares_one_connection(pool):
            raise ValidationError(
                source, type(pool).__name__,
                f"a pool of this class hands one connection to every caller, and this worker's threads (claim cycles, "
                f"the completion batcher, maintenance) each run transactions of their own, which "
                f"would interleave on it: give {source} a QueuePool of at least {self.least} "
                f"connections{remedy}")
        capacity = pool_capacity(pool)
        if capacity is not None and capacity < self.least:
            raise ValidationError(
                source, f"a pool of {capacity} connection{'s' * (capacity != 1)}",
                f"this worker keeps up to {self.kept} connections of it for long stretches (claim "
                f"cycles, maintenance and planner locks) and needs one more for its other calls: "
                f"give {source} a pool of at least {self.least} (pool_size + max_overflow){remedy}")


def pool_capacity(pool: Pool) -> int | None:
    """The most connections ``pool`` hands out at once: ``pool_size + max_overflow`` of a
    ``QueuePool`` (and its asyncio form), ``None`` when it sets no limit (other pool classes,
    ``max_overflow=-1``, ``pool_size=0``)."""
    if not isinstance(pool, QueuePool) or pool.size() <= 0 or pool._max_overflow < 0:
        return None
    return pool.size() + pool._max_overflow


def shares_one_connection(pool: Pool) -> bool:
    """True when ``pool`` hands one connection to every caller: a ``StaticPool`` (the same
    connection to every checkout at once) or an ``AssertionPool`` (one checkout at a time,
    and an error for a second)."""
    return isinstance(pool, StaticPool | AssertionPool)


def _copy(pool: Pool, at_least: int) -> Pool:
    """``pool.recreate()``, with a ``QueuePool``'s ``pool_size`` raised to ``at_least`` when
    it is smaller (and not 0, no limit). The most connections it hands out at once stay the
    original's (``pool_size + max_overflow``: the overflow shrinks by what the size grew)
    unless that is below ``at_least``; every other setting as ``recreate`` copies it. A
    one-connection pool (:func:`shares_one_connection`) becomes a queue pool of
    ``at_least`` connections (and :data:`ONE_CONNECTION_OVERFLOW` more) on its connect
    function, with its pre-ping, recycle, reset and logging settings and its events."""
    if shares_one_connection(pool):
        queue_class = AsyncAdaptedQueuePool if getattr(pool._dialect, "is_async", False) else QueuePool
        return queue_class(
            pool._creator, pool_size=max(1, at_least), max_overflow=ONE_CONNECTION_OVERFLOW,
            pre_ping=pool._pre_ping, recycle=pool._recycle, echo=pool.echo,
            logging_name=pool._orig_logging_name, reset_on_return=pool._reset_on_return,
            _dispatch=pool.dispatch, dialect=pool._dialect)
    copy = pool.recreate()
    if not isinstance(copy, QueuePool) or not 0 < copy.size() < at_least:
        return copy
    overflow = copy._max_overflow
    if overflow >= 0:
        overflow = max(0, copy.size() + overflow - at_least)
    # the arguments QueuePool.recreate passes, with the size and overflow changed
    return type(copy)(
        copy._creator, pool_size=at_least, max_overflow=overflow, pre_ping=copy._pre_ping,
        use_lifo=copy._pool.use_lifo, timeout=copy._timeout, recycle=copy._recycle, echo=copy.echo,
        logging_name=copy._orig_logging_name, reset_on_return=copy._reset_on_return,
        _dispatch=copy.dispatch, dialect=copy._dialect)


class _OwnPoolEngine(OptionEngine):
    """An engine that is its parent in every respect (dialect, URL, execution options,
    compiled cache, and the parent's event listeners, including ones added later) except
    that it checks connections out of a pool of its own."""

    def __init__(self, parent: Engine, at_least: int) -> None:
        super().__init__(parent, {})
        self.__dict__["_own_pool"] = _copy(parent.pool, at_least)

    # OptionEngine reads and writes its parent's pool through this property; an engine of
    # a pool of its own keeps its pool here instead (``dispose`` assigns a new one)
    @property
    def pool(self) -> Pool:
        pool: Pool = self.__dict__["_own_pool"]
        return pool

    @pool.setter
    def pool(self, pool: Pool) -> None:
        self.__dict__["_own_pool"] = pool


def own_pool_engine(engine: Engine, at_least: int = 0) -> Engine:
    """``engine`` on a new pool made by ``engine.pool.recreate()``: the same pool class and
    sizes, the same connect function (the engine's URL and ``connect_args``) and the pool's
    event listeners (``connect``, ``checkout``, ... registered so far), except that a
    ``QueuePool`` keeps at least ``at_least`` connections (with its ``max_overflow`` cut so
    that it hands out no more at once than the original, or ``at_least`` if that is more),
    and a one-connection pool (:func:`shares_one_connection`) becomes a queue pool of
    ``at_least`` connections.
    Statements sent through the returned engine fire ``engine``'s engine events as the
    engine's own do. Nothing is connected until the first checkout; dispose of the pool
    (``returned.pool.dispose()``) when done with it."""
    return _OwnPoolEngine(engine, at_least)


def own_pool_async_engine(engine: AsyncEngine, at_least: int = 0) -> AsyncEngine:
    """:func:`own_pool_engine` for an ``AsyncEngine`` (its synchronous engine on a pool of
    its own, wrapped again)."""
    own: Any = _OwnPoolEngine(engine.sync_engine, at_least)
    return AsyncEngine(own)
