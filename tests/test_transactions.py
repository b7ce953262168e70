"""The one transaction contract (qstore.storage._tx): Engine commits its own transaction;
Connection and ORM Session join the caller's, which alone commits or rolls back."""

from __future__ import annotations

import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session

from qstore import ValidationError
from qstore.storage._tx import owns_transaction, transaction


def _activated(engine, schema: str) -> bool:
    """Read on a separate connection: only committed work is visible."""
    with engine.connect() as other:
        return bool(other.execute(text(
            f"SELECT count(*) FROM {schema}.runtime_storage_backends")).scalar())


def test_engine_target_commits_the_operation(storage, engine):
    storage.activate_backend(engine)
    assert _activated(engine, storage.schema())


def test_connection_target_commits_nothing_until_the_caller_commits(storage, engine):
    with engine.connect() as conn:
        tx = conn.begin()
        storage.activate_backend(conn)
        assert conn.in_transaction()
        assert not _activated(engine, storage.schema())
        tx.commit()
    assert _activated(engine, storage.schema())


def test_connection_target_is_discarded_by_caller_rollback(storage, engine):
    with engine.connect() as conn, conn.begin() as tx:
        storage.activate_backend(conn)
        tx.rollback()
    assert not _activated(engine, storage.schema())


def test_connection_without_begin_autobegins_and_leaves_commit_to_caller(storage, engine):
    with engine.connect() as conn:
        storage.activate_backend(conn)
        assert conn.in_transaction()
        assert not _activated(engine, storage.schema())
        conn.commit()
    assert _activated(engine, storage.schema())


def test_connection_closed_without_commit_discards_the_operation(storage, engine):
    with engine.connect() as conn:
        storage.activate_backend(conn)
    assert not _activated(engine, storage.schema())


def test_operation_joins_work_the_caller_did_earlier_in_the_same_transaction(storage, engine):
    with engine.connect() as conn, conn.begin() as tx:
        conn.execute(text(f"INSERT INTO {storage.schema()}.queue_meta (queue) VALUES ('mail')"))
        storage.activate_backend(conn)
        tx.rollback()
    with engine.connect() as other:
        assert other.execute(text(f"SELECT count(*) FROM {storage.schema()}.queue_meta")).scalar() == 0
    assert not _activated(engine, storage.schema())


def test_session_target_is_discarded_by_session_rollback(storage, engine):
    with Session(engine) as session:
        storage.activate_backend(session)
        assert not _activated(engine, storage.schema())
        session.rollback()
    assert not _activated(engine, storage.schema())


def test_session_target_is_kept_by_session_commit(storage, engine):
    with Session(engine) as session:
        storage.activate_backend(session)
        assert not _activated(engine, storage.schema())
        session.commit()
    assert _activated(engine, storage.schema())


def test_transaction_helper_with_engine_commits_on_success(storage, engine):
    with transaction(engine) as conn:
        conn.execute(text(f"INSERT INTO {storage.schema()}.queue_meta (queue) VALUES ('a')"))
    with engine.connect() as other:
        assert other.execute(text(f"SELECT count(*) FROM {storage.schema()}.queue_meta")).scalar() == 1


def test_transaction_helper_with_engine_rolls_back_on_error(storage, engine):
    with pytest.raises(RuntimeError), transaction(engine) as conn:
        conn.execute(text(f"INSERT INTO {storage.schema()}.queue_meta (queue) VALUES ('a')"))
        raise RuntimeError("boom")
    with engine.connect() as other:
        assert other.execute(text(f"SELECT count(*) FROM {storage.schema()}.queue_meta")).scalar() == 0


def test_transaction_helper_with_connection_yields_the_same_connection(engine):
    with engine.connect() as conn, transaction(conn) as inner:
        assert inner is conn


def test_transaction_helper_with_session_yields_the_session_connection(engine):
    with Session(engine) as session, transaction(session) as inner:
        assert inner is session.connection()


def test_transaction_helper_rejects_other_targets():
    with pytest.raises(ValidationError, match="target"), transaction("postgresql://x"):  # type: ignore[arg-type]
        pass


def test_only_an_engine_target_owns_its_transaction(engine):
    assert owns_transaction(engine)
    with engine.connect() as conn:
        assert not owns_transaction(conn)
    with Session(engine) as session:
        assert not owns_transaction(session)


def test_operation_on_unsupported_target_raises_validation_error(storage):
    with pytest.raises(ValidationError):
        storage.activate_backend(object())  # type: ignore[arg-type]
