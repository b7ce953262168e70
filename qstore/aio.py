"""The async face of the storage: :class:`AsyncQueueStorage`.

It reads the same operation list as :class:`~qstore.storage.QueueStorage`
(:class:`~qstore.storage.Operations`): each operation runs its synchronous call in a
greenlet on the async target's synchronous counterpart (``AsyncEngine.sync_engine``,
``AsyncConnection.sync_connection``, ``AsyncSession.sync_session``), so an operation gets
exactly the transaction it gets on the sync face (see :mod:`qstore.storage.targets`) and
the two faces cannot drift apart. Requires the ``async`` extra (``sqlalchemy[asyncio]``)
and an async driver URL such as ``postgresql+psycopg://…`` for ``create_async_engine``.

Without the extra (no ``greenlet`` module), importing this module raises
:class:`AsyncExtraMissingError`, whose one-line message names ``pip install 'qstore[async]'``.
It is both an ``ImportError`` (an optional dependency is missing) and a
:class:`~qstore.errors.QueueStorageError` (every error qstore raises is one); the same
error comes from the async face of a task (``App.async_storage``, ``Task.defer_async``).

:class:`AsyncListener` is :class:`~qstore.storage.listen.Listener` for an event loop: one
``LISTEN`` connection (psycopg's ``AsyncConnection``) whose :meth:`AsyncListener.wait` is a
coroutine. The asyncio worker (:class:`qstore.worker.AsyncWorker`) uses it for wake-ups and
cancels.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import time
from collections.abc import Iterable
from types import TracebackType
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql
from sqlalchemy.util.concurrency import greenlet_spawn

from qstore.config import QueueStorageConfig
from qstore.errors import QueueStorageError, ValidationError
from qstore.outage import OutageLog
from qstore.storage import Naming, Operations, QueueStorage
from qstore.storage.listen import (
    KEEPALIVE_EVERY,
    RECONNECT_CAP,
    RECONNECT_FIRST,
    _Collected,
    collect,
    listen_channels,
)
from qstore.storage.operations import AsyncFace, Operation
from qstore.storage.targets import AsyncTarget, sync_target
from qstore.types import Wakeup

if TYPE_CHECKING:  # imported where used: it needs greenlet, checked first below
    from sqlalchemy.ext.asyncio import AsyncEngine


class AsyncExtraMissingError(QueueStorageError, ImportError):
    """The async face needs the ``async`` extra (``greenlet``), which is not installed. An
    ``ImportError`` and a :class:`~qstore.errors.QueueStorageError`; its message is one line."""


def _require_greenlet() -> None:
    """Raise :class:`AsyncExtraMissingError` when ``greenlet`` (what SQLAlchemy runs the
    async face on) cannot be imported; SQLAlchemy would only fail at the first call, with
    an error naming its own extra."""
    try:
        importlib.import_module("greenlet")
    except ImportError:
        raise AsyncExtraMissingError(
            "qstore.aio needs the 'async' extra (greenlet), which is not installed: "
            "pip install 'qstore[async]'") from None


_require_greenlet()

__all__ = ["AsyncExtraMissingError", "AsyncListener", "AsyncQueueStorage", "AsyncTarget"]

log = logging.getLogger("qstore.listen")


class AsyncQueueStorage(Operations, Naming, AsyncFace):
    """``await storage.enqueue_params_batch(async_engine, jobs)`` and so on: every operation
    of :class:`~qstore.storage.Operations` as a coroutine over an ``AsyncEngine``,
    ``AsyncConnection`` or ``AsyncSession``. :attr:`sync` is the synchronous face of the
    same install (same routing state)."""

    def __init__(self, config: QueueStorageConfig | QueueStorage | None = None) -> None:
        if config is not None and not isinstance(config, QueueStorageConfig | QueueStorage):
            raise ValidationError("config", config, "expected QueueStorageConfig, QueueStorage or None")
        self.sync = config if isinstance(config, QueueStorage) else QueueStorage(config)
        self._ctx = self.sync._ctx

    def _bind_operation(self, operation: Operation[Any, Any]) -> Any:
        return operation.bind_async(self._ctx)

    @staticmethod
    async def active_schema(target: AsyncTarget) -> str | None:
        """Schema most recently registered as the active queue-storage backend, or None."""
        return await greenlet_spawn(QueueStorage.active_schema, await sync_target(target))

    active_schema_in_tx = active_schema

    def __repr__(self) -> str:
        return f"AsyncQueueStorage({self._ctx.config!r})"


class AsyncListener:
    """``LISTEN`` on the channels of ``queues`` (and the cancel channel when ``cancel``) of
    one install, on a psycopg ``AsyncConnection`` of its own taken from ``engine`` (an
    ``AsyncEngine`` on the ``postgresql+psycopg`` driver) and detached from its pool.

    The same contract as :class:`~qstore.storage.listen.Listener`, with coroutines:
    ``await open()`` (or ``async with``) connects; ``await wait(timeout)`` returns a
    :class:`~qstore.types.Wakeup` as soon as a notification arrives, after ``timeout``
    seconds otherwise, or when :meth:`interrupt` is called (from the listener's loop); a
    lost connection is re-opened by ``wait`` (a growing delay while the server is away) and
    reported as ``missed=True`` (poll every queue). ``await close()`` ends it. One caller
    waits at a time.
    """

    def __init__(self, engine: AsyncEngine, config: QueueStorageConfig, queues: Iterable[str],
                 *, cancel: bool = True, outages: OutageLog | None = None) -> None:
        from sqlalchemy.ext.asyncio import AsyncEngine

        if not isinstance(engine, AsyncEngine):
            raise ValidationError("engine", engine, "the async listener needs an AsyncEngine")
        self.engine = engine
        self.config = config
        #: channel -> logical queue it wakes
        self.channels, self.cancel_channel = listen_channels(config, queues, cancel)
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._pending = _Collected()
        self._idle_since = time.monotonic()
        self._retry_delay = RECONNECT_FIRST
        self._interrupted = asyncio.Event()
        self._receiving: asyncio.Future[None] | None = None  # the wait's receive, while it runs
        self._closed = False
        self._outages = outages if outages is not None else OutageLog(log, "qstore listener")

    @property
    def connected(self) -> bool:
        """Whether the listening connection is currently open."""
        return self._conn is not None and not self._conn.closed

    async def open(self) -> AsyncListener:
        """Open the connection and ``LISTEN`` on every channel (raises when the database
        cannot be reached; :meth:`wait` retries by itself afterwards)."""
        if not self.connected:
            await self._connect()
        return self

    async def _connect(self) -> None:
        raw = await self.engine.raw_connection()
        driver = raw.driver_connection
        raw.detach()  # the listener's alone: closed by it, never reset by the pool
        if not isinstance(driver, psycopg.AsyncConnection):
            raw.close()
            raise ValidationError("engine", self.engine.url.render_as_string(),
                                  "the async listener needs the psycopg driver (postgresql+psycopg://...)")
        try:
            if driver.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                await driver.rollback()
            await driver.set_autocommit(True)
            for channel in dict.fromkeys([*self.channels, *([self.cancel_channel] if self.cancel_channel else [])]):
                await driver.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        except BaseException:
            raw.invalidate()
            with contextlib.suppress(Exception):
                await driver.close()
            raise
        self._conn = driver
        self._idle_since = time.monotonic()
        self._retry_delay = RECONNECT_FIRST

    async def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()

    def _take(self, n: psycopg.Notify) -> None:
        collect(self._pending, self.channels, self.cancel_channel, n.channel, n.payload)

    def _has_news(self) -> bool:
        p = self._pending
        return bool(p.queues or p.cancels or p.missed)

    async def _receive(self, conn: psycopg.AsyncConnection[Any], timeout: float) -> None:
        """Collect the notifications that arrive within ``timeout`` seconds: returns after
        the first, with every one that came in the same read, or when the time is up. (One
        that arrives later stays with the connection until the next wait: nothing is lost,
        and the wakeup goes out without a second look at the socket.)"""
        async for n in conn.notifies(timeout=timeout, stop_after=1):
            self._take(n)

    async def wait(self, timeout: float) -> Wakeup:
        """Wait up to ``timeout`` seconds for notifications (see the class docstring)."""
        if self._closed:
            raise ValidationError("listener", "closed", "this listener was closed")
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            if self._conn is None and not await self._reconnect(deadline):
                return self._pending.take()
            conn = self._conn
            assert conn is not None
            if self._interrupted.is_set():
                self._interrupted.clear()
                return self._pending.take()
            remaining = deadline - time.monotonic()
            try:
                if remaining <= 0:
                    await self._keepalive(conn)
                    return self._pending.take()
                # one task, which interrupt() cancels: the wait ends at the first of a
                # notification, the time, or an interrupt
                receiving = self._receiving = asyncio.ensure_future(
                    self._receive(conn, min(remaining, KEEPALIVE_EVERY)))
                try:
                    await asyncio.wait((receiving,))
                finally:
                    self._receiving = None
                    if not receiving.done():  # this wait itself was cancelled
                        receiving.cancel()
                if receiving.cancelled():  # interrupted: the wait ends here
                    self._interrupted.clear()
                    return self._pending.take()
                receiving.result()
                if self._has_news():
                    return self._pending.take()
                await self._keepalive(conn)
            except (psycopg.Error, OSError) as err:
                await self._lost(err)

    async def _lost(self, err: BaseException) -> None:
        self._outages.failed("LISTEN connection", err, 0.0, detail="lost; every queue polls", expected=True)
        await self._drop()
        self._pending.missed = True

    async def _keepalive(self, conn: psycopg.AsyncConnection[Any]) -> None:
        now = time.monotonic()
        if now - self._idle_since >= KEEPALIVE_EVERY:
            await conn.execute("SELECT 1")
            self._idle_since = now

    async def _reconnect(self, deadline: float) -> bool:
        """Try to re-open the connection; True when it is open. On failure, wait the
        current retry delay (not beyond ``deadline``, and cut short by :meth:`interrupt`)."""
        try:
            await self._connect()
            self._pending.missed = True
            self._outages.ok("LISTEN connection")
            return True
        except Exception as err:
            delay = min(self._retry_delay, max(0.0, deadline - time.monotonic()))
            self._outages.failed("LISTEN connection", err, delay, detail="reconnecting")
            self._retry_delay = min(self._retry_delay * 2, RECONNECT_CAP)
            self._pending.missed = True
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._interrupted.wait(), delay)
            self._interrupted.clear()
            return False

    def interrupt(self) -> None:
        """Make the current (or next) :meth:`wait` return at once (call it on the loop)."""
        self._interrupted.set()
        if self._receiving is not None:
            self._receiving.cancel()

    async def close(self) -> None:
        """Close the connection (its ``LISTEN`` registrations end with it). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._interrupted.set()
        await self._drop()

    async def __aenter__(self) -> AsyncListener:
        return await self.open()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()
