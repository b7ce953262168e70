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
``ATOMIC``                    one transaction, committed                   a SAVEPOINT inside the caller's
                                                                           transaction: an error leaves nothing
                                                                           half-written and the caller's
                                                                           transaction usable
``STATEMENT``                 one autocommitted statement (no BEGIN/       the caller's transaction
                              COMMIT round trips; locks held for the
                              statement alone)
``UNITS``                     one transaction per unit the operation       every unit in the caller's transaction
                              asks for (see :class:`Transactions`)
``NO_TRANSACTION``            an autocommit connection, outside any        refused (``ValidationError``): the
                              transaction block (``VACUUM``)                statement cannot run in a transaction
============================  ==========================================  ==================================
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy.orm import Session

from qstore.errors import ValidationError

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession

__all__ = [
    "OWNED",
    "AsyncTarget",
    "Policy",
    "Target",
    "Transactions",
    "reads_committed_state",
    "run",
    "sync_target",
]

Target: TypeAlias = Engine | Connection | Session
AsyncTarget: TypeAlias = "AsyncEngine | AsyncConnection | AsyncSession"

R = TypeVar("R")

#: Execution option marking a connection whose transaction the storage opened itself: what
#: it reads is committed work or its own, so process caches may keep it.
OWNED = "qstore_owned_transaction"


class Policy(enum.Enum):
    """The transaction an operation gets, per kind of target (see the module's table)."""

    JOIN = "join"
    ATOMIC = "atomic"
    STATEMENT = "statement"
    UNITS = "units"
    NO_TRANSACTION = "no_transaction"


def _refuse(target: object) -> ValidationError:
    return ValidationError("target", type(target).__name__,
                           "expected an Engine, Connection or Session (AsyncEngine, AsyncConnection "
                           "or AsyncSession on the async face)")


def _callers_connection(target: Connection | Session) -> Connection:
    return target.connection() if isinstance(target, Session) else target


@contextmanager
def _own_transaction(engine: Engine) -> Iterator[Connection]:
    with engine.begin() as conn:
        yield conn.execution_options(**{OWNED: True})


@contextmanager
def _own_statement(engine: Engine) -> Iterator[Connection]:
    with engine.connect() as conn:
        yield conn.execution_options(isolation_level="AUTOCOMMIT", **{OWNED: True})


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
    def statement(self) -> Iterator[Connection]:
        """A connection for one statement: autocommitted with an Engine (it commits in the
        same round trip), the caller's transaction otherwise."""
        if isinstance(self._target, Engine):
            with _own_statement(self._target) as conn:
                yield conn
        else:
            yield _callers_connection(self._target)


def run(policy: Policy, target: Target, body: Callable[[Any], R]) -> R:
    """Run ``body`` under ``policy`` on ``target``; ``body`` gets a ``Connection`` (a
    :class:`Transactions` for ``UNITS``)."""
    if not isinstance(target, Engine | Connection | Session):
        raise _refuse(target)
    if policy is Policy.UNITS:
        return body(Transactions(target))
    if isinstance(target, Engine):
        if policy is Policy.STATEMENT or policy is Policy.NO_TRANSACTION:
            with _own_statement(target) as conn:
                return body(conn)
        with _own_transaction(target) as conn:
            return body(conn)
    if policy is Policy.NO_TRANSACTION:
        raise ValidationError("target", type(target).__name__,
                              "this operation runs VACUUM, which cannot run inside a transaction block: pass an Engine")
    conn = _callers_connection(target)
    if policy is Policy.ATOMIC:
        with conn.begin_nested():
            return body(conn)
    return body(conn)


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
