"""The one place that knows every kind of target an operation can run on, and the
transaction each operation gets there.

Targets: ``Engine``, ``Connection`` and ORM ``Session`` (sync face); ``AsyncEngine``,
``AsyncConnection`` and ``AsyncSession`` (async face). The async face maps each async
target to its synchronous counterpart (``sync_engine``, ``sync_connection``,
``sync_session``) and runs the very same code in a greenlet, so an operation gets the same
transaction on an ``AsyncEngine`` as on an ``Engine``.

Every operation declares a :class:`Policy`; :func:`run` applies it:

============================  ==========================================  ==================================
policy                        ``Engine`` / ``AsyncEngine``                  ``Connection`` / ``Session`` (and async twins)
============================  ==========================================  ==================================
``JOIN``                      one transaction, committed (rolled back on   the caller's transaction (autobegun),
                              error)                                       never committed here
``SNAPSHOT``                  one REPEATABLE READ, read-only transaction:  the caller's transaction (its
                              every statement of a read sees one           isolation is the caller's choice; see
                              snapshot, taken after the read's locks       :func:`hold`)
                              (see :func:`holding`)
``ATOMIC``                    one transaction, committed                   a SAVEPOINT inside the caller's
                                                                           transaction: an error leaves nothing
                                                                           half-written and the caller's
                                                                           transaction usable
``STATEMENT``                 one autocommitted statement (no BEGIN/       the caller's transaction
                              COMMIT round trips; locks held for the       (the body gets a :class:`Runner`)
                              statement alone; the body gets a
                              :class:`Runner`)
``UNITS``                     one transaction per unit the operation       every unit in the caller's transaction
                              asks for (see :class:`Transactions`)
``OWN``                       one transaction, committed (rolled back on   refused (``CallerTransactionRefusedError``)
                              error)                                       before anything is sent: what the
                                                                           operation does (a ring cursor's
                                                                           ``setval``) would outlive a rollback
``NO_TRANSACTION``            an autocommit connection, outside any        refused (``CallerTransactionRefusedError``):
                              transaction block (``VACUUM``)                the statement cannot run in a transaction
============================  ==========================================  ==================================

Inside an operation, the units of work also come from here; a body never begins, commits
or rolls back anything itself:

============================  ========================================================================
unit                          what it is
============================  ========================================================================
``Transactions.unit()``       a ``UNITS`` operation's unit of work: its own transaction with an
                              ``Engine``, the caller's transaction otherwise (``.statement()`` /
                              ``.hot()``: one autocommitted statement with an ``Engine``;
                              ``.atomic()``: a SAVEPOINT in the caller's transaction, as ``ATOMIC``)
:func:`guarded` step          a lock-guarded upkeep step (prune, counter rollup): a SAVEPOINT with
                              ``lock_timeout`` = 50 ms (:data:`LOCK_TIMEOUT`), restored before the
                              savepoint is released; a lock timeout or deadlock (SQLSTATE 55P03 /
                              40P01) rolls the step back and is :data:`BLOCKED`, never raised, and
                              the transaction around it stays usable
============================  ========================================================================

Reads that promise one snapshot take ``SNAPSHOT``: ``load_job``, ``queue_counts`` and
``queue_counts_fast``, and the status reports (:mod:`qstore.status`). Nothing outside this
module opens a transaction around storage calls: what must commit together is one operation
(``wait_for_callback`` parks an attempt, registering its callback first;
``complete_runtime_batch_with_followups`` completes attempts with their follow-up jobs), and
code that composes calls of its own (``qstore install``) runs them through :func:`run` under
a policy (``tests/test_transactions.py`` checks the package for any other ``begin()``).

A rollback of the caller's transaction undoes everything an operation did there, with
three kinds of exception, none of which changes what a later call sees: sequences that
only hand out numbers (job ids, lane positions, the lane rotor) keep the numbers they gave
(a gap is skipped by design); a lane's claim-cursor hint may have moved forward, but only
over positions that committed claims consumed or that hold no row (it is a hint a claim
moves over committed evidence alone); and the process's cache of enqueue shard counts may
have lost entries (it is re-read), never gained one. Operations whose effect would outlive
a rollback take the ``OWN`` policy instead.

Hot statements (claim, fast completion, enqueue) go through a :class:`Runner`: on a
synchronous psycopg connection it sends a :class:`~qstore.storage.statements.HotStatement` on the
driver cursor directly, skipping SQLAlchemy's per-execute work; with an ``Engine`` it also
skips the ``Connection`` and its isolation-level round about (a pooled driver connection in
autocommit mode for the one statement, or for as long as a thread keeps it: see
:func:`keeping_engine`). On psycopg's ``AsyncConnection`` (an ``AsyncEngine``, or a
caller's ``AsyncConnection`` or ``AsyncSession`` in its transaction) the same holds: the
statement goes to the driver's cursor, awaited from the greenlet the async face runs the
operation in. Where someone listens to SQLAlchemy's cursor events (tracing, statement
logging), the same statement goes through ``Connection.execute`` instead, so those
listeners see every statement.

A ``SNAPSHOT`` read of several statements names the tables it reads that upkeep truncates
(:func:`holding`); it takes ``ACCESS SHARE`` on them (:func:`hold`) before its first
``SELECT``, which is when a REPEATABLE READ transaction takes its snapshot. ``TRUNCATE`` is
not MVCC-safe: a snapshot taken before a prune commits would see the pruned children empty
while the rows the prune wrote stay invisible to it, so a read that has not yet opened a
child would under-count. Held first, the locks keep every prune, counter rollup and rebuild
of those tables off until the read ends (prune and rollup give up after their 50 ms lock
timeout and report ``Blocked``); ``ACCESS SHARE`` conflicts with no enqueue, claim or
completion.
"""

from __future__ import annotations

import enum
import functools
import json
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeAlias, TypeVar

import psycopg
from psycopg.types.json import set_json_loads
from sqlalchemy import Connection, Engine, Table, func, select, text
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine.base import OptionEngine
from sqlalchemy.orm import Session
from sqlalchemy.util import await_only, greenlet_spawn

from qstore.errors import CallerTransactionRefusedError, ValidationError

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession

    from qstore.storage.context import StorageContext
    from qstore.storage.statements import HotStatement

__all__ = [
    "BLOCKED",
    "KEEP_LIMIT",
    "LOCK_TIMEOUT",
    "OWNED",
    "AsyncTarget",
    "Blocked",
    "KeptConnection",
    "Policy",
    "Runner",
    "Target",
    "Transactions",
    "guarded",
    "hold",
    "holding",
    "is_lock_failure",
    "keeping_engine",
    "kept_connection",
    "reads_committed_state",
    "refuse_callers_transaction",
    "release_kept",
    "run",
    "statement_on_engine",
    "sync_target",
]

Target: TypeAlias = Engine | Connection | Session
AsyncTarget: TypeAlias = "AsyncEngine | AsyncConnection | AsyncSession"

R = TypeVar("R")
P = ParamSpec("P")

#: Execution option marking a connection whose transaction the storage opened itself: what
#: it reads is committed work or its own, so process caches may keep it.
OWNED = "qstore_owned_transaction"


class Policy(enum.Enum):
    """The transaction an operation gets, per kind of target (see the module's table)."""

    JOIN = "join"
    SNAPSHOT = "snapshot"
    ATOMIC = "atomic"
    STATEMENT = "statement"
    UNITS = "units"
    OWN = "own"
    NO_TRANSACTION = "no_transaction"


#: Why each policy that needs an Engine refuses a caller's transaction.
_NEEDS_ENGINE = {
    Policy.OWN: "it moves a ring cursor, a sequence, which a rollback of your transaction "
                "would not undo (and other sessions would see the move before you commit)",
    Policy.NO_TRANSACTION: "it runs VACUUM, which cannot run inside a transaction block",
}


def refuse_callers_transaction(policy: Policy, target: object, operation: str = "this operation") -> None:
    """Raise :class:`~qstore.errors.CallerTransactionRefusedError` when ``policy`` needs a
    transaction of its own and ``target`` is a caller's (anything but an ``Engine`` or
    ``AsyncEngine``). Sends nothing to the database."""
    why = _NEEDS_ENGINE.get(policy)
    if why is None or isinstance(target, Engine):
        return
    from sqlalchemy.ext.asyncio import AsyncEngine

    if isinstance(target, AsyncEngine):
        return
    raise CallerTransactionRefusedError(operation, type(target).__name__, why)


def _refuse(target: object) -> ValidationError:
    return ValidationError("target", type(target).__name__,
                           "expected an Engine, Connection or Session (AsyncEngine, AsyncConnection "
                           "or AsyncSession on the async face)")


def _callers_connection(target: Connection | Session) -> Connection:
    return target.connection() if isinstance(target, Session) else target


@contextmanager
def _own_transaction(engine: Engine) -> Iterator[Connection]:
    # READ COMMITTED whatever the engine's default: ending an attempt needs a new snapshot
    # per statement (see IsolationLevelError); psycopg sends the level with the BEGIN
    with engine.connect() as conn:
        conn = conn.execution_options(isolation_level="READ COMMITTED", **{OWNED: True})
        with conn.begin():
            yield conn


@contextmanager
def _own_snapshot(engine: Engine) -> Iterator[Connection]:
    # psycopg sends the level and READ ONLY with the BEGIN, and the pool restores both at
    # check-in: no round trip of their own. Nothing is sent before the body's first
    # statement, so the body's hold() is what the transaction runs first.
    with engine.connect() as conn:
        conn = conn.execution_options(isolation_level="REPEATABLE READ", postgresql_readonly=True,
                                      **{OWNED: True})
        with conn.begin():
            yield conn


def hold(conn: Connection, tables: Sequence[Table]) -> Connection:
    """``LOCK TABLE <tables> IN ACCESS SHARE MODE`` in ``conn``'s transaction (a partitioned
    parent locks every child too); returns ``conn``. Nothing is sent for no tables.

    The locks last until the transaction ends. ``ACCESS SHARE`` conflicts only with
    ``ACCESS EXCLUSIVE``: enqueues, claims and completions go on, while a ``TRUNCATE`` of a
    held table (prune, counter rollup or rebuild) cannot happen before the transaction
    ends. ``LOCK`` takes no snapshot, so as the first statement of a REPEATABLE READ
    transaction it makes the snapshot, taken by the next statement, agree with every held
    table for the whole transaction. Later in a transaction that already has its snapshot
    it cannot undo a truncation committed since; it only keeps further ones off."""
    if tables:
        prep = conn.dialect.identifier_preparer
        names = ", ".join(prep.format_table(t) for t in tables)
        conn.execute(text(f"LOCK TABLE {names} IN ACCESS SHARE MODE"))
    return conn


def holding(tables: Callable[[StorageContext], Sequence[Table]]
            ) -> Callable[[Callable[Concatenate[StorageContext, Connection, P], R]],
                          Callable[Concatenate[StorageContext, Connection, P], R]]:
    """Declare the body of a ``SNAPSHOT`` read: ``tables(ctx)`` are the tables it reads that
    upkeep truncates. The declared body takes them with :func:`hold` before anything else,
    which in the snapshot transaction of an Engine is before the snapshot is taken. On a
    caller's connection the locks join the caller's transaction (see :func:`hold` for what
    they do there). The undeclared function stays as it was, for reads inside other
    operations."""

    def declare(body: Callable[Concatenate[StorageContext, Connection, P], R]
                ) -> Callable[Concatenate[StorageContext, Connection, P], R]:
        @functools.wraps(body)
        def held(ctx: StorageContext, conn: Connection, *args: P.args, **kwargs: P.kwargs) -> R:
            return body(ctx, hold(conn, tables(ctx)), *args, **kwargs)

        return held

    return declare


@contextmanager
def _own_statement(engine: Engine) -> Iterator[Connection]:
    with engine.connect() as conn:
        yield conn.execution_options(isolation_level="AUTOCOMMIT", **{OWNED: True})


_CURSOR = "qstore_hot_cursor"  # key of a driver connection's reused cursor in its pool record


def _listened(dispatch: Any) -> bool:
    return bool(dispatch.before_cursor_execute or dispatch.after_cursor_execute)


_JSON = json.JSONDecoder()


def _loads(data: bytes | bytearray | memoryview | str) -> Any:
    """``json.loads`` of a json/jsonb value as the driver hands it over (UTF-8 bytes):
    decoded first, so ``json`` has no encoding to detect (which costs more than the parse
    of a small job's args)."""
    return _JSON.decode(data if isinstance(data, str) else bytes(data).decode())


def _cursor(info: dict[str, Any], driver: Any) -> Any:
    """The driver connection's reused cursor (kept in its pool record's ``info``; an
    ``AsyncCursor`` of an ``AsyncConnection``). JSON values it reads are parsed by
    :func:`_loads`; the connection's other cursors keep the application's settings."""
    cur = info.get(_CURSOR)
    if cur is None or cur.closed or cur.connection is not driver:
        cur = info[_CURSOR] = driver.cursor()
        set_json_loads(_loads, cur)
    return cur


class Runner:
    """Sends hot statements on one connection; see the module docstring. Rows come back as
    tuples (or tuple-like rows on the fallback path), in the statement's column order."""

    __slots__ = ("_conn", "_cursor", "_dialect")

    def __init__(self, dialect: Any, cursor: psycopg.Cursor[Any] | None = None,
                 conn: Connection | None = None) -> None:
        self._dialect = dialect
        self._cursor = cursor
        self._conn = conn

    @classmethod
    def on(cls, conn: Connection) -> Runner:
        """A runner on ``conn``'s transaction (begun here if the caller has not begun it, as
        ``Connection.execute`` would autobegin it)."""
        if not conn.in_transaction():
            conn.begin()
        driver = conn.connection.driver_connection
        if not _listened(conn.dispatch):
            if isinstance(driver, psycopg.Connection):
                return cls(conn.dialect, _cursor(conn.connection.info, driver), conn)
            if isinstance(driver, psycopg.AsyncConnection):  # (in the async face's greenlet)
                return _AsyncRunner(conn.dialect, _cursor(conn.connection.info, driver), conn)
        return cls(conn.dialect, None, conn)

    def rows(self, hot: HotStatement, values: dict[str, Any]) -> list[Any]:
        """Run ``hot`` with ``values``; all its rows."""
        cur = self._cursor
        if cur is None:
            assert self._conn is not None
            return list(self._conn.execute(hot.statement, values).all())
        sql, params = hot.parameters(self._dialect, values)
        return self._send(cur, hot, sql, params)

    def rows_in_order(self, hot: HotStatement, keys: tuple[str, ...], values: Sequence[Any]) -> list[Any]:
        """:meth:`rows` with ``values`` given in the order of ``keys`` (see
        :meth:`HotStatement.in_order`)."""
        cur = self._cursor
        if cur is None:
            assert self._conn is not None
            return list(self._conn.execute(hot.statement, dict(zip(keys, values, strict=True))).all())
        sql, params = hot.in_order(self._dialect, keys, values)
        return self._send(cur, hot, sql, params)

    def _send(self, cur: psycopg.Cursor[Any], hot: HotStatement, sql: str, params: Sequence[Any]) -> list[Any]:
        try:
            cur.execute(sql, params, prepare=_prepare(hot, cur))
        except psycopg.OperationalError:
            self._lost(cur)
            raise
        return cur.fetchall()

    def _lost(self, cur: Any) -> None:
        """After a driver error: invalidate the caller's connection if the driver's is
        closed, as SQLAlchemy does on a disconnect (a pooled one is handled by
        :func:`_release`)."""
        if cur.connection.closed and self._conn is not None:
            self._conn.invalidate()


def _prepare(hot: HotStatement, cur: Any) -> bool | None:
    """The driver's ``prepare`` flag for ``hot`` on ``cur``: prepared at once when the
    statement asks for it and the connection prepares at all, else the driver's default."""
    return True if hot.prepared and cur.connection.prepare_threshold is not None else None


class _AsyncRunner(Runner):
    """A :class:`Runner` on a psycopg ``AsyncConnection``'s cursor, for code running in the
    greenlet of an async operation: each send is awaited there (``await_only``)."""

    __slots__ = ()

    def _send(self, cur: Any, hot: HotStatement, sql: str, params: Sequence[Any]) -> list[Any]:
        try:
            await_only(cur.execute(sql, params, prepare=_prepare(hot, cur)))
        except psycopg.OperationalError:
            self._lost(cur)
            raise
        rows: list[Any] = await_only(cur.fetchall())
        return rows


def _hot_checkout(engine: Engine) -> tuple[Any, Any, Runner] | None:
    """A pooled driver connection of ``engine`` in autocommit mode and a :class:`Runner` on
    its reused cursor; None when someone listens to cursor events or the driver is not
    psycopg (then the statement goes through a ``Connection``). On an async engine (the
    sync engine of an ``AsyncEngine``) this runs in the operation's greenlet, and the
    runner awaits each statement there. Hand the connection back with :func:`_release`."""
    if _listened(engine.dispatch):
        return None
    raw = engine.raw_connection()
    driver = raw.driver_connection
    try:
        if isinstance(driver, psycopg.Connection):
            driver.autocommit = True
            return raw, driver, Runner(engine.dialect, _cursor(raw.info, driver))
        if isinstance(driver, psycopg.AsyncConnection):
            await_only(driver.set_autocommit(True))
            return raw, driver, _AsyncRunner(engine.dialect, _cursor(raw.info, driver))
    except BaseException as err:
        _release(raw, driver, err)
        raise
    raw.close()
    return None


def _release(raw: Any, driver: Any, err: BaseException | None = None) -> None:
    """Hand back a connection of :func:`_hot_checkout`: out of autocommit mode, or
    invalidated after a disconnect (as SQLAlchemy does)."""
    try:
        if isinstance(err, psycopg.OperationalError) and (driver is None or driver.closed):
            raw.invalidate()
        elif isinstance(driver, psycopg.AsyncConnection):
            if not driver.closed:
                await_only(driver.set_autocommit(False))
        elif driver is not None and not driver.closed:
            driver.autocommit = False
    finally:
        raw.close()


def statement_on_engine(engine: Engine, body: Callable[..., R], lead: Any,
                        args: tuple[Any, ...], kwargs: dict[str, Any]) -> R:
    """``body(lead, runner, *args, **kwargs)`` as one autocommitted statement on ``engine``:
    the ``STATEMENT`` policy on an ``Engine``, exactly as :func:`run` applies it (a pooled
    connection, checked out for the call alone, or the kept one of a :func:`keeping_engine`),
    in the fewest Python frames, since every enqueue, claim and fast completion on an
    ``Engine`` comes through here."""
    kept: KeptConnection | None = engine.__dict__.get(_KEPT)
    got = _hot_checkout(engine) if kept is None else kept.take()
    if got is None:
        with _own_statement(engine) as conn:
            return body(lead, Runner.on(conn), *args, **kwargs)
    raw, driver, runner = got
    try:
        result = body(lead, runner, *args, **kwargs)
    except BaseException as err:
        if kept is None:
            _release(raw, raw.driver_connection, err)
        else:
            kept.settle(err)
        raise
    if kept is None:
        _release(raw, driver)  # a runner without a Connection never invalidates: the same driver
    return result


class _HotOnEngine:
    """A runner for one autocommitted statement on a pooled connection of ``engine``, as a
    context manager (see :func:`statement_on_engine`).

    A class rather than a generator context manager: a generator's set-up and tear-down
    cost more client time than the few lines they wrap."""

    __slots__ = ("_engine", "_fallback", "_kept", "_raw")

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._raw: Any = None
        self._fallback: Any = None
        self._kept: KeptConnection | None = engine.__dict__.get(_KEPT)

    def __enter__(self) -> Runner:
        kept = self._kept
        got = _hot_checkout(self._engine) if kept is None else kept.take()
        if got is not None:
            self._raw, _, runner = got
            return runner
        # someone listens to cursor events, or the driver is not psycopg's sync one
        self._kept = None
        self._fallback = _own_statement(self._engine)
        return Runner.on(self._fallback.__enter__())

    def __exit__(self, kind: Any, err: Any, tb: Any) -> None:
        if self._fallback is not None:
            self._fallback.__exit__(kind, err, tb)
            return
        if self._kept is not None:
            self._kept.settle(err)
            return
        raw = self._raw
        _release(raw, raw.driver_connection, err)


_KEPT = "qstore_kept_connection"  # key of a keeping engine's KeptConnection in its __dict__

#: How long (seconds) a kept connection serves before it goes back to the pool and the next
#: statement checks out a fresh one (so the pool's recycling and pre-ping still apply to it).
KEEP_LIMIT = 30.0


class KeptConnection:
    """The connection of a :func:`keeping_engine`: one pooled driver connection in autocommit
    mode, checked out at its first hot statement and kept for the next ones, so a thread
    that sends hot statements one after the other pays the pool's checkout and check-in
    and the switches in and out of autocommit once, not per statement.

    Each statement still commits on its own (autocommit), as on any ``Engine``. The
    connection goes back to the pool on :meth:`release`, after an error (a disconnect
    invalidates it, as SQLAlchemy does), when someone starts listening to cursor events
    (the statements then go through a ``Connection``), and once it has served
    :data:`KEEP_LIMIT` seconds. Not thread-safe: one thread uses it."""

    __slots__ = ("_engine", "_got", "_since")

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._got: tuple[Any, Any, Runner] | None = None
        self._since = 0.0

    @property
    def held(self) -> bool:
        """True while a connection is checked out for the next statement."""
        return self._got is not None

    def take(self) -> tuple[Any, Any, Runner] | None:
        """The kept ``(pool connection, driver connection, runner)``, checked out now if none
        is kept; None when statements must go through a ``Connection`` (cursor listeners,
        a driver other than psycopg's sync one)."""
        got = self._got
        if got is not None:
            if not _listened(self._engine.dispatch) and time.monotonic() - self._since < KEEP_LIMIT:
                return got
            self.release()
        got = _hot_checkout(self._engine)
        if got is not None:
            self._got, self._since = got, time.monotonic()
        return got

    def settle(self, err: BaseException | None) -> None:
        """After a statement on the kept connection: keep it when the statement succeeded;
        after an error hand it back (invalidated after a disconnect), so the next statement
        starts on a connection in a known state."""
        if err is not None and self._got is not None:
            raw, driver, _ = self._got
            self._got = None
            _release(raw, driver, err)

    def release(self) -> None:
        """Hand the kept connection back to the pool (out of autocommit mode), if one is
        kept; the next statement checks one out again."""
        got, self._got = self._got, None
        if got is not None:
            _release(got[0], got[1])


def keeping_engine(engine: Engine) -> Engine:
    """``engine`` for one thread that sends hot statements (claims, fast completions,
    enqueues) one after the other: they run on a :class:`KeptConnection` instead of a
    connection checked out per statement, with the same transactions (each one
    autocommitted). Every other operation on it checks connections out of ``engine``'s pool
    as on ``engine`` itself. Hand the kept connection back with :func:`release_kept` before
    the thread waits for long and when it is done."""
    keeping = OptionEngine(engine, {})
    keeping.__dict__[_KEPT] = KeptConnection(keeping)
    return keeping


@contextmanager
def kept_connection(engine: Engine) -> Iterator[Engine]:
    """``with kept_connection(engine) as producing:`` — an engine for one thread's burst of
    hot calls (a loop of ``defer``, ``enqueue``, claims or fast completions): they run on one
    pooled connection kept for the block (see :func:`keeping_engine`), each still committed on
    its own as on ``engine``, instead of a checkout and check-in per call. The connection is
    handed back when the block ends, and earlier after an error, when someone starts
    listening to cursor events, or after :data:`KEEP_LIMIT` seconds. Everything else run on
    ``producing`` behaves as on ``engine``. Use it from the thread that entered it.

    Raises :class:`~qstore.errors.ValidationError` naming ``engine`` for anything but a
    synchronous ``Engine`` (a caller's ``Connection`` is one connection already)."""
    if not isinstance(engine, Engine):
        raise ValidationError("engine", type(engine).__name__,
                              "expected a synchronous Engine (a Connection or Session already is one "
                              "connection)")
    keeping = keeping_engine(engine)
    try:
        yield keeping
    finally:
        release_kept(keeping)


def release_kept(engine: Engine) -> None:
    """Hand back the kept connection of a :func:`keeping_engine` (nothing for another
    engine, or when none is kept)."""
    kept: KeptConnection | None = engine.__dict__.get(_KEPT)
    if kept is not None:
        kept.release()


async def release_kept_async(engine: Engine) -> None:
    """:func:`release_kept` for a :func:`keeping_engine` of an ``AsyncEngine``'s sync engine:
    the check-in runs in a greenlet, as the pool of an async driver needs (nothing is
    spawned when no connection is kept)."""
    kept: KeptConnection | None = engine.__dict__.get(_KEPT)
    if kept is not None and kept.held:
        await greenlet_spawn(kept.release)


#: ``lock_timeout`` of a guarded step (every ``ACCESS EXCLUSIVE`` request of prune and
#: counter rollup).
LOCK_TIMEOUT = "50ms"
_LOCK_FAILURES = frozenset({"55P03", "40P01"})  # lock_not_available, deadlock_detected


class Blocked:
    """Sentinel type: a lock request of a guarded step was not granted in time."""

    def __repr__(self) -> str:
        return "BLOCKED"


BLOCKED = Blocked()


def is_lock_failure(err: BaseException) -> bool:
    """True for a driver error meaning "could not get the lock in time" (55P03 / 40P01)."""
    if not isinstance(err, sa_exc.DBAPIError):
        return False
    orig = err.orig
    return (getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)) in _LOCK_FAILURES


def guarded(conn: Connection, step: Callable[[Connection], R]) -> R | Blocked:
    """A guarded step of an operation (see the module docstring): ``step(conn)`` in a
    SAVEPOINT of ``conn``'s transaction with ``lock_timeout`` = :data:`LOCK_TIMEOUT`.

    Returns the step's result, or :data:`BLOCKED` when a lock wait inside it timed out or
    deadlocked (SQLSTATE 55P03 / 40P01): the savepoint is rolled back, so nothing the step
    wrote survives, and the transaction around it stays usable. Any other error rolls the
    savepoint back and propagates. On success the previous ``lock_timeout`` is restored
    before the savepoint is released, so the short timeout never outlives the step."""
    previous = conn.execute(select(func.current_setting("lock_timeout"))).scalar_one()
    savepoint = conn.begin_nested()
    try:
        conn.execute(select(func.set_config("lock_timeout", LOCK_TIMEOUT, True)))
        result = step(conn)
        conn.execute(select(func.set_config("lock_timeout", previous, True)))
    except BaseException as err:
        if savepoint.is_active:
            savepoint.rollback()
        if is_lock_failure(err):
            return BLOCKED
        raise
    savepoint.commit()
    return result


class Transactions:
    """What a ``UNITS`` operation gets instead of a connection: it asks for each unit of work
    and the target decides. With an ``Engine`` each :meth:`unit` is a transaction of its own
    and each :meth:`statement` an autocommitted statement; with a caller's connection every
    unit runs in the caller's transaction. :attr:`owned` says which."""

    def __init__(self, target: Target) -> None:
        self._target = target
        self.owned = isinstance(target, Engine)

    @contextmanager
    def unit(self) -> Iterator[Connection]:
        """A connection for one unit: its own transaction (committed on leaving) with an
        Engine, the caller's transaction otherwise."""
        if isinstance(self._target, Engine):
            with _own_transaction(self._target) as conn:
                yield conn
        else:
            yield _callers_connection(self._target)

    @contextmanager
    def atomic(self) -> Iterator[Connection]:
        """A unit that leaves nothing half-written: its own transaction (committed on
        leaving) with an Engine, a SAVEPOINT of the caller's transaction otherwise (an error
        rolls it back and leaves the caller's transaction usable), as ``ATOMIC`` gives."""
        if isinstance(self._target, Engine):
            with _own_transaction(self._target) as conn:
                yield conn
        else:
            conn = _callers_connection(self._target)
            with conn.begin_nested():
                yield conn

    def hot(self) -> AbstractContextManager[Runner]:
        """A :class:`Runner` for one hot statement: autocommitted with an Engine, in the
        caller's transaction otherwise."""
        if isinstance(self._target, Engine):
            return _HotOnEngine(self._target)
        return nullcontext(Runner.on(_callers_connection(self._target)))

    @contextmanager
    def statement(self) -> Iterator[Connection]:
        """A connection for one statement: autocommitted with an Engine (it commits in the
        same round trip), the caller's transaction otherwise."""
        if isinstance(self._target, Engine):
            with _own_statement(self._target) as conn:
                yield conn
        else:
            yield _callers_connection(self._target)


def run(policy: Policy, target: Target, body: Callable[[Any], R], operation: str = "this operation") -> R:
    """Run ``body`` under ``policy`` on ``target``; ``body`` gets a ``Connection`` (a
    :class:`Transactions` for ``UNITS``, a :class:`Runner` for ``STATEMENT``). ``operation``
    names the operation in a refusal."""
    if not isinstance(target, Engine | Connection | Session):
        raise _refuse(target)
    refuse_callers_transaction(policy, target, operation)
    if policy is Policy.UNITS:
        return body(Transactions(target))
    if policy is Policy.STATEMENT:
        if isinstance(target, Engine):
            return statement_on_engine(target, _call_with_runner, body, (), {})
        return body(Runner.on(_callers_connection(target)))
    if isinstance(target, Engine):
        if policy is Policy.NO_TRANSACTION:
            with _own_statement(target) as conn:
                return body(conn)
        if policy is Policy.SNAPSHOT:
            with _own_snapshot(target) as conn:
                return body(conn)
        with _own_transaction(target) as conn:
            return body(conn)
    conn = _callers_connection(target)
    if policy is Policy.ATOMIC:
        with conn.begin_nested():
            return body(conn)
    return body(conn)


def _call_with_runner(body: Callable[[Runner], R], runner: Runner) -> R:
    return body(runner)


def reads_committed_state(conn: Connection) -> bool:
    """True when ``conn`` runs a transaction the storage opened itself, so what it reads is
    not an uncommitted change of a caller that may still roll back."""
    return bool(conn.get_execution_options().get(OWNED))


async def sync_target(target: object) -> Target:
    """The synchronous counterpart of an async target (its ``sync_engine``,
    ``sync_connection`` or ``sync_session``), which the async face hands to the same code
    inside a greenlet."""
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession

    if isinstance(target, AsyncEngine):
        return target.sync_engine
    if isinstance(target, AsyncConnection):
        if not target.sync_connection:  # pragma: no cover - a connection not yet started
            await target.start()
        assert target.sync_connection is not None
        return target.sync_connection
    if isinstance(target, AsyncSession):
        return target.sync_session
    raise ValidationError("target", type(target).__name__,
                          "expected an AsyncEngine, AsyncConnection or AsyncSession")
