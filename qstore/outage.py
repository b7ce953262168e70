"""Database failures of the runtime's recurring work, logged as a few lines per outage.

A worker retries what fails while the database is away: claims, completions, outcome
writes, heartbeats, the ``LISTEN`` connection, maintenance and its leadership. Logged one
line per failed try, an outage of a few seconds would fill the log. :class:`OutageLog` keeps
it to:

* one WARNING when an activity (``what``: ``claims on queue 'mail'``, ``completions``,
  ``maintenance``...) starts failing, or fails differently from its last failure (another
  exception type or SQLSTATE; every way of losing the connection counts as one):
  ``qstore worker: claims on queue 'mail' failed: connection refused (SQLSTATE 08001):
  <the server's or driver's words>; retrying in 1.0 s``. Repeats go to DEBUG;
* one INFO line once every activity that failed has worked again: ``qstore worker: back
  after 15.2 s, 14 failed attempts (claims on queue 'mail', maintenance)``; the time runs
  from the first failure to the first success after the last one.

A traceback is logged only at DEBUG, except for an unexpected error (neither a
:class:`~qstore.errors.QueueStorageError`, a driver error nor an ``OSError``), whose first
occurrence is logged at WARNING with its traceback: that is a bug, not an outage.

One activity may run several operations that fail and recover separately (each job's
outcome write, each maintenance task): they pass a ``key``, and the activity counts as
failing while any of its keys does. Thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import psycopg
from sqlalchemy.exc import SQLAlchemyError

from qstore.errors import DatabaseError, QueueStorageError, translated

__all__ = ["OutageLog", "describe_failure", "expected_failure"]

_EXPECTED: tuple[type[BaseException], ...] = (QueueStorageError, SQLAlchemyError, psycopg.Error, OSError)


def expected_failure(err: BaseException) -> bool:
    """True for what an unreachable or failing database raises (a qstore error, a driver
    error, an ``OSError``); False for anything else, which is a bug."""
    return isinstance(err, _EXPECTED)


def describe_failure(err: BaseException) -> tuple[str, str | None]:
    """``(one line of text, SQLSTATE or None)`` for ``err``; driver errors are described as
    the qstore error they translate to (a database error by its reason, SQLSTATE and the
    server's words, without the name of the operation: the line names the activity)."""
    err = translated(err)
    text = err.summary if isinstance(err, DatabaseError) else str(err)
    return " ".join(text.split()) or type(err).__name__, getattr(err, "sqlstate", None)


def _signature(err: BaseException) -> tuple[str, str | None]:
    """What makes two failures "the same" for the log: the error's type and SQLSTATE, except
    that every way of losing the connection (refused, lost, server shutting down...) is one
    failure: an outage moves through several of them."""
    mapped = translated(err)
    if isinstance(mapped, DatabaseError) and mapped.connection_lost:
        return ("connection", None)
    return type(mapped).__name__, getattr(mapped, "sqlstate", None)


@dataclass
class _Activity:
    failing: set[object] = field(default_factory=set)
    signature: tuple[str, str | None] | None = None  # of the last failure logged at WARNING


class OutageLog:
    """Logs the failures and recoveries of recurring operations on ``logger``, each line
    starting with ``prefix`` (see the module docstring)."""

    def __init__(self, logger: logging.Logger, prefix: str) -> None:
        self.logger = logger
        self.prefix = prefix
        self._lock = threading.Lock()
        self._activities: dict[str, _Activity] = {}
        self._since: float | None = None  # first failure of the current outage
        self._last_failure = 0.0
        self._back_at: float | None = None  # first success after the last failure
        self._failures = 0

    @property
    def failing(self) -> bool:
        """Whether some activity's last try failed."""
        with self._lock:
            return any(a.failing for a in self._activities.values())

    def failed(self, what: str, err: BaseException, retry_in: float | None = None, *,
               key: object = None, detail: str | None = None, expected: bool | None = None) -> None:
        """Record that ``what`` (its operation ``key``) failed with ``err`` and is tried again
        in ``retry_in`` seconds (``None``: not retried). ``detail`` is added to the line
        (which job, which task) but does not make the failure a different one. ``expected``
        overrides :func:`expected_failure` (a caller that knows ``err`` means a lost
        connection)."""
        text, sqlstate = describe_failure(err)
        if expected is None:
            expected = expected_failure(err)
        signature = _signature(err)
        now = time.monotonic()
        with self._lock:
            activity = self._activities.setdefault(what, _Activity())
            activity.failing.add(key)
            if self._since is None:
                self._since = now
                self._failures = 0
            self._failures += 1
            self._last_failure = now
            self._back_at = None
            first = activity.signature != signature
            activity.signature = signature
        where = f" ({detail})" if detail else ""
        state = "" if sqlstate is None or sqlstate in text else f" (SQLSTATE {sqlstate})"
        then = "; not retried" if retry_in is None else f"; retrying in {retry_in:.1f} s"
        message = f"{self.prefix}: {what}{where} failed: {text}{state}{then}"
        if first:
            self.logger.warning(message, exc_info=None if expected else err)
            if expected and self.logger.isEnabledFor(logging.DEBUG):
                self.logger.debug("%s: %s failed here:", self.prefix, what, exc_info=err)
        else:
            self.logger.debug(message, exc_info=err)

    def ok(self, what: str, *, key: object = None) -> None:
        """Record that ``what`` (its operation ``key``) worked. Logs the recovery line when
        it was the last failing one."""
        if self._since is None:  # the common case, without the lock: nothing is failing
            return
        now = time.monotonic()
        with self._lock:
            if self._since is None:
                return
            if self._back_at is None:
                self._back_at = now
            self._settle(what, key)
            back = self._close_if_recovered()
        if back:
            self.logger.info("%s: %s", self.prefix, back)

    def forget(self, what: str, *, key: object = None) -> None:
        """Stop counting ``what``'s operation ``key`` as failing without a success (it was
        given up, or there is nothing left to try). The recovery line waits for a success."""
        with self._lock:
            self._settle(what, key)
            back = self._close_if_recovered()
        if back:
            self.logger.info("%s: %s", self.prefix, back)

    def _settle(self, what: str, key: object) -> None:
        activity = self._activities.get(what)
        if activity is not None:
            activity.failing.discard(key)
            if not activity.failing:
                activity.signature = None

    def _close_if_recovered(self) -> str | None:
        """End the outage once nothing fails and a success came after the last failure;
        returns the recovery line then."""
        if self._since is None or self._back_at is None:
            return None
        if any(a.failing for a in self._activities.values()):
            return None
        took = self._back_at - self._since
        whats = ", ".join(self._activities)
        failures = self._failures
        self._since, self._back_at, self._failures = None, None, 0
        self._activities.clear()
        return f"back after {took:.1f} s, {failures} failed attempt{'' if failures == 1 else 's'} ({whats})"
