"""The qstore error hierarchy and the one place that translates driver errors.

Every public operation raises only :class:`QueueStorageError` subclasses. Driver errors
(SQLAlchemy ``DBAPIError`` / psycopg errors) are wrapped, never leaked raw.
"""

from __future__ import annotations

import functools
import re
import reprlib
import uuid
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import psycopg
from sqlalchemy import exc as sa_exc

__all__ = [
    "CallbackNotFoundError",
    "CallbackWaitEndedError",
    "CallerTransactionRefusedError",
    "DatabaseError",
    "InvariantError",
    "IsolationLevelError",
    "PartialCommitError",
    "QueueStorageError",
    "SchemaNotInstalledError",
    "ShapeMismatchError",
    "StaleAttemptError",
    "UniqueConflictError",
    "ValidationError",
    "classify",
    "failure_line",
    "names_missing_schema_object",
    "translate_errors",
    "translated",
    "wrap_driver_error",
]


class QueueStorageError(Exception):
    """Base class of every error qstore raises."""


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = 300
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 10
_REPR.maxlevel = 4


def describe(value: Any) -> str:
    """A bounded ``repr`` of ``value`` for messages: long strings and containers are cut,
    and a value without a printable repr (too deep, an integer too long) is named by type."""
    try:
        return _REPR.repr(value)
    except Exception:
        return f"<{type(value).__name__}>"


class ValidationError(QueueStorageError, ValueError):
    """Bad input: the message names the offending field and value (its repr, cut to a few
    hundred characters). Nothing was written."""

    def __init__(self, field: str, value: Any, reason: str) -> None:
        self.field = field
        self.value = value
        self.reason = reason
        super().__init__(f"invalid {field}={describe(value)}: {reason}")


class StaleAttemptError(ValidationError):
    """An operation on a live attempt refused attempt ``(job_id, run_lease)``: it is not
    running (it ended — completed, retried, rescued, cancelled — or that run lease was never
    the job's). Nothing was written. ``field`` is ``"job"`` and ``value`` the pair."""

    def __init__(self, job_id: int, run_lease: int, reason: str = "job is not in running state") -> None:
        self.job_id = job_id
        self.run_lease = run_lease
        super().__init__("job", (job_id, run_lease), reason)


class CallerTransactionRefusedError(ValidationError):
    """An operation that must run in a transaction of its own was given a caller's
    ``Connection`` or ``Session`` (or their async twins). Refused before anything is sent
    to the database, so the caller's transaction is untouched and still usable.
    ``operation`` names the operation; the message says why it needs an ``Engine``."""

    def __init__(self, operation: str, target: str, why: str) -> None:
        self.operation = operation
        super().__init__("target", target, f"{operation} cannot run in a caller's transaction: {why}; "
                                           f"pass an Engine (or AsyncEngine)")


class ShapeMismatchError(ValidationError):
    """An explicit shape value (slot counts, stripes, receipt mode) conflicts with the shape
    the install recorded. The recorded shape wins: the message names each conflicting field
    with both values. An install is never resized; nothing was written."""

    def __init__(self, schema: str, conflicts: dict[str, tuple[Any, Any]]) -> None:
        self.schema = schema
        self.conflicts = dict(conflicts)
        recorded = ", ".join(f"{k}={rec!r}" for k, (rec, _) in conflicts.items())
        asked = ", ".join(f"{k}={got!r}" for k, (_, got) in conflicts.items())
        first = next(iter(conflicts))
        reason = (f"schema {schema!r} is installed with a different shape ({recorded}); the "
                  f"recorded shape wins: leave the value out (QueueStorage.from_existing_schema "
                  f"reads it back) or pass the recorded one. Resizing an install is not "
                  f"supported: install another schema with the new shape")
        super().__init__(first, conflicts[first][1], reason)
        self.args = (f"asked for {asked}, but {reason}",)


#: SQLSTATE the server functions raise for :class:`IsolationLevelError` (class QS: qstore's own).
ISOLATION_SQLSTATE = "QS001"


class IsolationLevelError(QueueStorageError):
    """An operation that ends an attempt (completion, retry, cancel, failure, rescue) or
    hands it to a callback ran in a transaction whose isolation is not READ COMMITTED.

    Ending an attempt exactly once rests on each closer locking the attempt's receipt and
    then checking, in a later statement, that no closure names it yet: only READ COMMITTED
    gives that later statement a snapshot that sees a closure committed while the lock was
    awaited. The operation wrote nothing; the caller's transaction should be rolled back.
    ``isolation`` is the transaction's, as PostgreSQL names it."""

    def __init__(self, isolation: str) -> None:
        self.isolation = isolation
        super().__init__(f"qstore ends attempts only in READ COMMITTED transactions; this one is {isolation}: "
                         "run the operation on an Engine or in a READ COMMITTED transaction")


class UniqueConflictError(QueueStorageError):
    """A unique key is owned by another job (or a 23505 violation). Nothing was written."""

    def __init__(self, constraint: str, detail: str | None = None) -> None:
        self.constraint = constraint
        self.detail = detail
        msg = f"unique conflict on {constraint}"
        super().__init__(f"{msg}: {detail}" if detail else msg)


class CallbackNotFoundError(QueueStorageError):
    """No live attempt holds the given callback id."""

    def __init__(self, callback_id: uuid.UUID) -> None:
        self.callback_id = callback_id
        super().__init__(f"callback {callback_id} not found")


class CallbackWaitEndedError(QueueStorageError):
    """A handler waiting for its callback learned that its attempt no longer waits on it:
    the callback timed out and the attempt was rescued, the job was failed, retried or
    cancelled from outside, or the worker closed the attempt (``outcome`` says which:
    ``stale``, ``unexpected_state``, ``not_found`` or ``cancelled``). The handler should
    stop; whatever it writes for the attempt afterwards is refused as stale."""

    def __init__(self, callback_id: uuid.UUID, outcome: str, state: object = None) -> None:
        self.callback_id = callback_id
        self.outcome = outcome
        self.state = state
        where = f" (job is {getattr(state, 'value', state)})" if state is not None else ""
        super().__init__(f"wait for callback {callback_id} ended: {outcome}{where}")


class SchemaNotInstalledError(QueueStorageError):
    """The storage schema (or its recorded configuration) does not exist in the database,
    or lacks an object this release uses (an operation found a table, function, type or
    the schema itself missing: ``missing`` holds the server's words, and the driver's error
    is the ``__cause__``). ``found`` lists the qstore installs the database does hold, when
    they were looked up (may be empty)."""

    def __init__(self, schema: str, found: list[str] | None = None, missing: str | None = None,
                 sqlstate: str | None = None) -> None:
        self.schema = schema
        self.found = list(found or [])
        self.missing = missing
        #: The SQLSTATE of the statement that found the object missing (42P01, 42883, 42704 or
        #: 3F000), None when the install was looked up and not found.
        self.sqlstate = sqlstate
        seen = ("; this database holds " + ", ".join(self.found)) if self.found else \
            "; this database holds no qstore install"
        code = f"; SQLSTATE {sqlstate}" if sqlstate else ""
        what = f" or not completely ({missing}{code})" if missing else ""
        super().__init__(
            f"qstore schema {schema!r} is not installed{what}{seen if found is not None else ''}; "
            f"install it with `qstore install --schema {schema}` (or QueueStorage.install), or "
            f"through your application's Alembic (`alembic upgrade heads`)"
        )


class DatabaseError(QueueStorageError):
    """A database failure, wrapped. The message is one line: what failed (the operation,
    when known), ``reason``, the SQLSTATE and the server's (or driver's) own words, never
    SQL text or parameters.

    ``sqlstate`` is the PostgreSQL error code; for a connection the driver could not make
    or lost, which carries none, the code PostgreSQL gives that condition (08001 could not
    connect, 08006 connection lost, 57P03 starting up or shutting down, ...) or None when
    the driver's words say nothing known. ``reason`` is a short, stable name for a log line
    (``"connection refused"``, ``"admin shutdown"``, ``"undefined table"``, ...).
    ``operation`` names the operation that failed; ``original`` is the exception caught
    (also the ``__cause__``; the driver's own error is chained below it)."""

    def __init__(self, original: BaseException, operation: str | None = None) -> None:
        self.original = original
        self.operation = operation
        self.sqlstate, self.reason = classify(original)
        self.detail = _detail(original)
        super().__init__(self._message())

    @property
    def summary(self) -> str:
        """The message without what failed: ``reason (SQLSTATE x): detail`` (for a line that
        names the failing activity itself)."""
        code = f"SQLSTATE {self.sqlstate}" if self.sqlstate else "no SQLSTATE"
        return f"{self.reason} ({code}): {self.detail}"

    @property
    def connection_lost(self) -> bool:
        """True when the failure is the connection itself (could not connect, lost, closed,
        or the server shutting down / starting up), whatever the exact words."""
        state = self.sqlstate or ""
        return state.startswith("08") or state in ("57P01", "57P02", "57P03")

    def _message(self) -> str:
        what = f"{self.operation} failed" if self.operation else "database call failed"
        return f"{what}: {self.summary}"

    def failed_in(self, operation: str) -> DatabaseError:
        """Name ``operation`` as what failed, unless a name is already given; returns self."""
        if self.operation is None:
            self.operation = operation
            self.args = (self._message(),)
        return self


class InvariantError(QueueStorageError):
    """The database holds a state qstore's own writes never produce (a storage invariant is
    broken, e.g. by a manual edit); the operation wrote nothing."""


class PartialCommitError(DatabaseError):
    """An operation that commits in more than one transaction failed after an earlier one
    committed. ``committed`` lists what is done for good (do not redo it: a repeat would
    report it as missing); ``pending`` lists what is in an unknown state only in the sense
    that it was *not* done by this call (it is still live: repeat the call for it)."""

    def __init__(self, original: BaseException, committed: list[Any], pending: list[Any]) -> None:
        self.committed = committed
        self.pending = pending
        super().__init__(original)

    def _message(self) -> str:
        return f"{super()._message()} (committed: {len(self.committed)}, not done: {len(self.pending)})"


def _sqlstate(err: BaseException) -> str | None:
    orig = getattr(err, "orig", err)
    return getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)


def _is_driver_error(err: BaseException) -> bool:
    return isinstance(err, sa_exc.DBAPIError | psycopg.Error)


def _first_line(message: str) -> str:
    """The first line of ``message`` with its whitespace collapsed (libpq's second line is a
    generic hint; a server's primary message is one line)."""
    lines = [line for line in message.splitlines() if line.strip()]
    return " ".join(lines[0].split()) if lines else ""


def _detail(err: BaseException) -> str:
    """What went wrong in the server's or driver's words, one line, without SQL text,
    parameters or SQLAlchemy's background link."""
    if _is_driver_error(err):
        return _first_line(_server_message(err))
    if isinstance(err, sa_exc.SQLAlchemyError):
        return _first_line(str(err.args[0])) if err.args else type(err).__name__
    return " ".join(str(err).split())


#: Reasons where the condition's name (the psycopg class name, spelled out) reads badly.
_REASON_BY_STATE = {
    "08001": "could not connect",  # sqlclient_unable_to_establish_sqlconnection
    "08006": "connection lost",  # connection_failure
}

#: What the driver says when a connection fails without a SQLSTATE (libpq's words, or the
#: server's FATAL while connecting): (pattern, SQLSTATE of that condition, reason), first
#: match wins.
_CONNECTION_FAILURES = tuple((re.compile(pattern, re.IGNORECASE), code, reason) for pattern, code, reason in (
    ("connection refused", "08001", "connection refused"),
    ("server closed the connection unexpectedly", "08006", "server closed the connection unexpectedly"),
    ("terminating connection due to administrator command", "57P01", "admin shutdown"),
    ("the database system is shutting down", "57P03", "server shutting down"),
    ("the database system is starting up", "57P03", "server starting up"),
    ("the database system is in recovery mode", "57P03", "server in recovery"),
    ("too many clients", "53300", "too many connections"),
    ("password authentication failed", "28P01", "password authentication failed"),
    ("no pg_hba.conf entry", "28000", "no pg_hba.conf entry"),
    ('role ".*" does not exist', "28000", "role does not exist"),
    ('database ".*" does not exist', "3D000", "database does not exist"),
    ("name or service not known|failed to resolve host|could not translate host name", "08001",
     "unknown host"),
    ("timeout expired|connection timed out", "08001", "connection timed out"),
    ("no route to host", "08001", "no route to host"),
    ("on socket .* no such file or directory", "08001", "no server at the socket"),
    ("the connection is closed", "08003", "connection closed"),
    ("the connection is lost|ssl syscall error|eof detected|could not (receive|send) data|"
     "consuming input failed|sending query failed", "08006", "connection lost"),
    ("connection failed|connection is bad", "08001", "could not connect"),
))


def _spelled(name: str) -> str:
    """``UndefinedTable`` -> ``undefined table`` (``InternalError_`` -> ``internal error``)."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", " ", name.rstrip("_")).lower()


def classify(err: BaseException) -> tuple[str | None, str]:
    """``(sqlstate, reason)`` of an error (see :class:`DatabaseError`)."""
    state = _sqlstate(err)
    if state is not None:
        if state in _REASON_BY_STATE:
            return state, _REASON_BY_STATE[state]
        try:
            return state, _spelled(psycopg.errors.lookup(state).__name__)
        except KeyError:
            return state, "database error"
    orig = getattr(err, "orig", None) or err
    if isinstance(orig, psycopg.OperationalError | psycopg.InterfaceError) or \
            isinstance(err, sa_exc.OperationalError | sa_exc.InterfaceError):
        words = str(orig)
        for pattern, code, reason in _CONNECTION_FAILURES:
            if pattern.search(words):
                return code, reason
        return None, "connection failure"
    return None, _spelled(type(orig).__name__)


#: SQLSTATEs of a missing relation, function, type or schema: on an install's own objects
#: they mean the install is not there (or not at the revision this release uses).
_MISSING_OBJECT = frozenset({"42P01", "42883", "42704", "3F000"})


def _server_message(err: BaseException) -> str:
    """The server's primary message of a driver error (never the SQL text), else the
    driver's own text."""
    orig = getattr(err, "orig", None) or err
    diag = getattr(orig, "diag", None)
    primary = getattr(diag, "message_primary", None) if diag is not None else None
    return str(primary) if primary else str(orig)


def names_missing_schema_object(err: BaseException, schema: str) -> bool:
    """True when ``err`` says an object of ``schema`` (a table, sequence, view, function
    or type qualified by it, or the schema itself) does not exist."""
    if _sqlstate(err) not in _MISSING_OBJECT:
        return False
    pattern = rf'(?<![\w$])"?{re.escape(schema)}"?\.|schema "{re.escape(schema)}"'
    return re.search(pattern, _server_message(err)) is not None


def wrap_driver_error(err: BaseException) -> QueueStorageError:
    """Map a driver error to the qstore hierarchy (23505 → UniqueConflictError)."""
    if isinstance(err, QueueStorageError):
        return err
    state = _sqlstate(err)
    if state == ISOLATION_SQLSTATE:
        return IsolationLevelError(_server_message(err).rpartition("this one is ")[2])
    if state == "23505":
        orig = getattr(err, "orig", err)
        diag = getattr(orig, "diag", None)
        constraint = getattr(diag, "constraint_name", None) or "unique"
        return UniqueConflictError(constraint, " ".join(str(getattr(diag, "message_detail", "") or "").split()))
    return DatabaseError(err)


P = ParamSpec("P")
R = TypeVar("R")


def translated(err: BaseException, schema: str | None = None) -> BaseException:
    """The qstore error to raise for ``err``: driver errors (SQLAlchemy's and psycopg's own,
    e.g. from statements run on the raw driver connection) become
    :class:`QueueStorageError` subclasses; anything else is returned as it is. With
    ``schema`` (the install an operation works on), a missing object of that schema is
    :class:`SchemaNotInstalledError`."""
    if isinstance(err, QueueStorageError):
        return err
    if isinstance(err, sa_exc.DBAPIError | sa_exc.OperationalError | psycopg.Error):
        if schema is not None and names_missing_schema_object(err, schema):
            return SchemaNotInstalledError(schema, missing=_first_line(_server_message(err)),
                                           sqlstate=_sqlstate(err))
        return wrap_driver_error(err)
    if isinstance(err, sa_exc.SQLAlchemyError):
        return DatabaseError(err)
    return err


def failure_line(err: BaseException) -> str:
    """``err`` as one line for a log: the qstore error it translates to (a database error
    names its reason and SQLSTATE), never SQL text, parameters or a traceback."""
    mapped = translated(err)
    return " ".join(str(mapped).split()) or type(mapped).__name__


def translate_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """Decorator: re-raise driver errors as :class:`QueueStorageError` subclasses (see
    :func:`translated`)."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except Exception as err:
            mapped = translated(err)
            if isinstance(mapped, DatabaseError):
                mapped.failed_in(getattr(fn, "__name__", "database call"))
            if mapped is err:
                raise
            raise mapped from err

    return wrapper



class MissingExtraError(QueueStorageError, ImportError):
    """A feature needs an optional dependency that is not installed; the one-line message
    names the package and the extra that installs it (``pip install 'qstore[cron]'``)."""

    def __init__(self, feature: str, extra: str, package: str) -> None:
        self.feature = feature
        self.extra = extra
        self.package = package
        super().__init__(f"{feature} needs the {package} package, which is not installed; "
                         f"install it with the extra: pip install 'qstore[{extra}]'")
