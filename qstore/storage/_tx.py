"""The one transaction contract every operation follows.

An operation's target is one of:

* ``Engine`` — the operation opens a connection, runs in its own transaction and commits
  (rolls back on error) before returning;
* ``Connection`` — the operation joins the caller's transaction (autobegun if none is open)
  and never commits or rolls back: the caller decides;
* ORM ``Session`` — the operation runs on ``session.connection()`` and likewise leaves
  commit/rollback to the session's owner.

Async targets are served by :class:`qstore.aio.AsyncQueueStorage`, which hands the sync
connection of an ``AsyncConnection``/``AsyncSession`` to the same code through ``run_sync``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeAlias

from sqlalchemy import Connection, Engine
from sqlalchemy.orm import Session

from qstore.errors import ValidationError

__all__ = ["OWNED", "Target", "owns_transaction", "reads_committed_state", "single_statement",
           "transaction"]

Target: TypeAlias = Engine | Connection | Session


@contextmanager
def transaction(target: Target) -> Iterator[Connection]:
    """Yield a connection inside a transaction according to the contract above."""
    if isinstance(target, Engine):
        with target.begin() as conn:
            yield conn.execution_options(**{OWNED: True})
    elif isinstance(target, Connection):
        yield target
    elif isinstance(target, Session):
        yield target.connection()
    else:
        raise ValidationError("target", type(target).__name__,
                              "expected an Engine, Connection or Session")


@contextmanager
def single_statement(target: Target) -> Iterator[Connection]:
    """Like :func:`transaction`, for an operation that is exactly one statement.

    With an ``Engine`` the statement runs on an autocommit connection: it is its own
    transaction and commits in the same round trip (no ``BEGIN``/``COMMIT`` exchanges), so
    any row lock it takes is held for the statement alone. Connection/Session targets join
    the caller's transaction exactly as with :func:`transaction`.
    """
    if isinstance(target, Engine):
        with target.connect() as conn:
            yield conn.execution_options(isolation_level="AUTOCOMMIT", **{OWNED: True})
    else:
        with transaction(target) as conn:
            yield conn


#: Execution option marking a connection whose transaction the storage opened itself (every
#: statement it reads is committed work or its own): process caches may keep what it reads.
OWNED = "qstore_owned_transaction"


def reads_committed_state(conn: Connection) -> bool:
    """True when ``conn`` runs a transaction the storage opened itself, so what it reads is
    not an uncommitted change of a caller that may still roll back."""
    return bool(conn.get_execution_options().get(OWNED))


def owns_transaction(target: Target) -> bool:
    """True when the operation commits its own transaction (an ``Engine`` target)."""
    return isinstance(target, Engine)
