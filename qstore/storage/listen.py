"""Wake-ups over ``LISTEN``: a dedicated connection that tells a consumer when to claim.

An enqueue whose job is ready at once sends ``NOTIFY`` on its logical queue's channel
(``config.notify_channel(queue)``) when it commits, and an operator's cancel of a running
attempt sends ``{"job_id": …, "run_lease": …}`` on ``config.cancel_channel``.
:class:`Listener` holds one psycopg connection in autocommit mode (never a transaction, so
it never pins the MVCC horizon), listens on those channels (names quoted as identifiers)
and hands what arrived to its caller through :meth:`Listener.wait`.

Notifications are a hint, never the only source of truth: one sent while the connection was
down is lost. So :meth:`Listener.wait` returns after ``timeout`` seconds even when nothing
arrived (the caller polls then), and when the connection drops it reconnects (with a
growing delay while the server stays away) and returns a :class:`Wakeup` with
``missed=True``, which means "poll every queue now". Start it with
``QueueStorage.listen(engine, queues)`` (or :class:`Listener` directly) and use it as a
context manager or call :meth:`Listener.close`.

A lost connection is one WARNING line, the tries to reconnect while the server stays away
are DEBUG, and the reconnect is one INFO line (:class:`~qstore.outage.OutageLog`). A
connection that failed is closed, never handed back to the engine's pool (it would be reset
there, which fails on a dead connection).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import psycopg
from psycopg import sql
from sqlalchemy import Engine

from qstore.config import QueueStorageConfig
from qstore.errors import ValidationError
from qstore.outage import OutageLog
from qstore.storage.jobs import validate_queue
from qstore.types import Wakeup

__all__ = ["Listener"]

log = logging.getLogger("qstore.listen")

#: While idle, the connection is checked with a round trip this often (seconds), so a
#: connection the network silently dropped is noticed and replaced.
KEEPALIVE_EVERY = 30.0
#: Reconnect delays (seconds): the first retry is immediate-ish, then they grow to the cap.
RECONNECT_FIRST, RECONNECT_CAP = 0.1, 5.0


@dataclass
class _Collected:
    queues: set[str] = field(default_factory=set)
    cancels: list[tuple[int, int]] = field(default_factory=list)
    missed: bool = False

    def take(self) -> Wakeup:
        out = Wakeup(frozenset(self.queues), tuple(self.cancels), self.missed)
        self.queues, self.cancels, self.missed = set(), [], False
        return out


def collect(pending: _Collected, channels: dict[str, str], cancel_channel: str | None, channel: str,
            payload: str) -> None:
    """Add one notification to ``pending``: a wake-up of the queue whose channel it came on
    (``channels``: channel -> queue), or a cancel (a JSON ``{"job_id", "run_lease"}`` on
    ``cancel_channel``); anything else is ignored."""
    # A queue named "cancel" has the cancel channel's name: a wake-up carries no
    # payload, a cancel always a JSON object, so the payload tells the two apart.
    if payload and channel == cancel_channel:
        try:
            data = json.loads(payload)
            pending.cancels.append((int(data["job_id"]), int(data["run_lease"])))
        except (ValueError, KeyError, TypeError):
            log.debug("qstore listener: ignored cancel payload %r", payload)
        return
    queue = channels.get(channel)
    if queue is not None:
        pending.queues.add(queue)


def listen_channels(config: QueueStorageConfig, queues: Iterable[str], cancel: bool
                    ) -> tuple[dict[str, str], str | None]:
    """What a listener LISTENs on: each of ``queues``' notify channel mapped to its queue
    (names validated; one string instead of a list is refused) and the cancel channel when
    ``cancel``. Shared by the sync and the async listener."""
    if isinstance(queues, str):
        raise ValidationError("queues", queues, "expected a list of queue names, not one string")
    names = [validate_queue(q, "queues") for q in queues]
    return {config.notify_channel(q): q for q in names}, config.cancel_channel if cancel else None


class Listener:
    """``LISTEN`` on the channels of ``queues`` (and the cancel channel when ``cancel``) of
    one install, on a connection of its own taken from ``engine``.

    The connection is opened by :meth:`open` (or on entering the context) and re-opened by
    :meth:`wait` whenever it is lost; :meth:`close` ends it. :meth:`wait` must be called
    from one thread at a time; :meth:`interrupt` may be called from any thread. Losing and
    regaining the connection is logged through ``outages`` (a worker passes its own, so its
    outage ends with one recovery line; by default the listener's own, on ``qstore.listen``).
    """

    def __init__(self, engine: Engine, config: QueueStorageConfig, queues: Iterable[str],
                 *, cancel: bool = True, outages: OutageLog | None = None) -> None:
        if not isinstance(engine, Engine):
            raise ValidationError("engine", engine, "the listener needs a synchronous Engine")
        self.engine = engine
        self.config = config
        #: channel -> logical queue it wakes
        self.channels, self.cancel_channel = listen_channels(config, queues, cancel)
        self._conn: psycopg.Connection[Any] | None = None
        self._pending = _Collected()
        self._idle_since = time.monotonic()
        self._retry_delay = RECONNECT_FIRST
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._closed = False
        self._lock = threading.Lock()  # guards the pipe against close() racing interrupt()
        self._outages = outages if outages is not None else OutageLog(log, "qstore listener")

    # -- connection ----------------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        """Whether the listening connection is currently open."""
        return self._conn is not None and not self._conn.closed

    def open(self) -> Listener:
        """Open the connection and ``LISTEN`` on every channel (raises when the database
        cannot be reached; :meth:`wait` retries by itself afterwards)."""
        if not self.connected:
            self._connect()
        return self

    def _connect(self) -> None:
        raw = self.engine.raw_connection()
        driver = raw.driver_connection
        # This connection is the listener's alone and never goes back to the pool: detached,
        # it is closed below when it fails (a pool would reset it, which fails on a dead one).
        raw.detach()
        if not isinstance(driver, psycopg.Connection):
            raw.close()
            raise ValidationError("engine", self.engine.url.render_as_string(),
                                  "the listener needs the synchronous psycopg driver "
                                  "(postgresql+psycopg://...)")
        try:
            if driver.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                driver.rollback()
            driver.autocommit = True
            driver.add_notify_handler(self._on_notify)
            for channel in dict.fromkeys([*self.channels, *([self.cancel_channel] if self.cancel_channel else [])]):
                driver.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        except BaseException:
            raw.invalidate()  # the pool forgets it without a reset
            with contextlib.suppress(Exception):
                driver.close()
            raise
        self._conn = driver
        self._idle_since = time.monotonic()
        self._retry_delay = RECONNECT_FIRST

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    # -- notifications ---------------------------------------------------------------------------
    def _on_notify(self, n: psycopg.Notify) -> None:
        self._take(n.channel, n.payload)

    def _take(self, channel: str, payload: str) -> None:
        collect(self._pending, self.channels, self.cancel_channel, channel, payload)

    def _drain(self, conn: psycopg.Connection[Any]) -> None:
        """Read whatever the server sent and collect its notifications (no waiting)."""
        pgconn = conn.pgconn
        pgconn.consume_input()
        encoding = conn.info.encoding
        while (n := pgconn.notifies()) is not None:
            self._take(n.relname.decode(encoding), n.extra.decode(encoding))

    def _lost(self, err: BaseException) -> None:
        self._outages.failed("LISTEN connection", err, 0.0, detail="lost; every queue polls",
                             expected=True)
        self._drop()
        self._pending.missed = True

    def wait(self, timeout: float) -> Wakeup:
        """Wait up to ``timeout`` seconds for notifications; returns as soon as one arrives
        (with every other one already received), when :meth:`interrupt` is called, or when
        the time is up (an empty :class:`Wakeup`). A lost connection is re-opened here: the
        result then has ``missed=True``; while the server stays unreachable each call
        waits out its timeout (or the reconnect delay) and returns ``missed=True``."""
        if self._closed:
            raise ValidationError("listener", "closed", "this listener was closed")
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            if self._conn is None and not self._reconnect(deadline):
                return self._pending.take()
            conn = self._conn
            assert conn is not None
            try:
                self._drain(conn)  # also picks up what arrived during our own statements
                if self._pending.queues or self._pending.cancels or self._pending.missed:
                    return self._pending.take()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._keepalive(conn)
                    return self._pending.take()
                ready, _, _ = select.select([conn.fileno(), self._wake_r], [], [],
                                            min(remaining, KEEPALIVE_EVERY))
                if self._wake_r in ready:
                    self._clear_interrupt()
                    self._drain(conn)
                    return self._pending.take()
                if not ready:
                    self._keepalive(conn)
            except (psycopg.Error, OSError, ValueError) as err:  # ValueError: fileno of a closed conn
                self._lost(err)

    def _keepalive(self, conn: psycopg.Connection[Any]) -> None:
        now = time.monotonic()
        if now - self._idle_since >= KEEPALIVE_EVERY:
            conn.execute("SELECT 1")
            self._idle_since = now

    def _reconnect(self, deadline: float) -> bool:
        """Try to re-open the connection; True when it is open. On failure, wait the
        current retry delay (not beyond ``deadline``, and cut short by :meth:`interrupt`)."""
        try:
            self._connect()
            self._pending.missed = True
            log.debug("qstore listener reconnected")
            self._outages.ok("LISTEN connection")
            return True
        except Exception as err:
            delay = min(self._retry_delay, max(0.0, deadline - time.monotonic()))
            self._outages.failed("LISTEN connection", err, delay, detail="reconnecting")
            self._retry_delay = min(self._retry_delay * 2, RECONNECT_CAP)
            self._pending.missed = True
            with contextlib.suppress(OSError, ValueError):
                ready, _, _ = select.select([self._wake_r], [], [], delay)
                if ready:
                    self._clear_interrupt()
            return False

    def interrupt(self) -> None:
        """Make the current (or next) :meth:`wait` return at once. Thread-safe."""
        with self._lock:
            if not self._closed:
                with contextlib.suppress(BlockingIOError):
                    os.write(self._wake_w, b"x")

    def _clear_interrupt(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_r, 512):
                pass

    def close(self) -> None:
        """Close the connection (its ``LISTEN`` registrations end with it). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._drop()
            os.close(self._wake_r)
            os.close(self._wake_w)

    def __enter__(self) -> Listener:
        return self.open()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - a listener the caller forgot to close
        with contextlib.suppress(Exception):
            self.close()
