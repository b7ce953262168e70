"""The transaction policies (qstore.storage.targets): Engine commits its own transaction;
Connection and ORM Session join the caller's, which alone commits or rolls back."""

from __future__ import annotations

import pytest
from sqlalchemy import Column, MetaData, Table, Text, bindparam, event, func, insert, select, text
from sqlalchemy.orm import Session

from qstore import ValidationError
from qstore.storage.statements import HotStatement
from qstore.storage.targets import Policy, Runner, Transactions, reads_committed_state, run


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


def _count(engine, schema: str) -> int:
    with engine.connect() as other:
        return int(other.execute(text(f"SELECT count(*) FROM {schema}.queue_meta")).scalar())


def _insert(schema: str, queue: str):
    def body(conn):
        conn.execute(text(f"INSERT INTO {schema}.queue_meta (queue) VALUES ('{queue}')"))
    return body


def _insert_then_fail(schema: str):
    def body(conn):
        _insert(schema, "a")(conn)
        raise RuntimeError("boom")
    return body


def test_join_policy_on_an_engine_commits_on_success(storage, engine):
    run(Policy.JOIN, engine, _insert(storage.schema(), "a"))
    assert _count(engine, storage.schema()) == 1


def test_join_policy_on_an_engine_rolls_back_on_error(storage, engine):
    with pytest.raises(RuntimeError):
        run(Policy.JOIN, engine, _insert_then_fail(storage.schema()))
    assert _count(engine, storage.schema()) == 0


def test_join_policy_on_a_connection_hands_the_body_that_connection(engine):
    with engine.connect() as conn:
        assert run(Policy.JOIN, conn, lambda inner: inner) is conn


def test_join_policy_on_a_session_hands_the_body_the_session_connection(engine):
    with Session(engine) as session:
        assert run(Policy.JOIN, session, lambda inner: inner) is session.connection()


def test_atomic_policy_error_leaves_the_callers_transaction_usable_and_unwritten(storage, engine):
    schema = storage.schema()
    with engine.connect() as conn:
        _insert(schema, "mine")(conn)
        with pytest.raises(RuntimeError):
            run(Policy.ATOMIC, conn, _insert_then_fail(schema))
        rows = conn.execute(text(f"SELECT queue FROM {schema}.queue_meta")).scalars().all()
        assert rows == ["mine"]
        conn.commit()
    assert _count(engine, schema) == 1


def _hot_insert(schema: str, queue: str) -> HotStatement:
    meta = MetaData(schema=schema)
    t = Table("queue_meta", meta, Column("queue", Text))
    return HotStatement(insert(t).values(queue=bindparam("q")).returning(t.c.queue))


def _hot_txid() -> HotStatement:
    return HotStatement(select(func.txid_current_if_assigned(), func.txid_current()))


def test_statement_policy_on_an_engine_autocommits_its_statement(storage, engine):
    def body(runner: Runner) -> None:
        assert runner.rows(_hot_insert(storage.schema(), "a"), {"q": "a"}) == [("a",)]
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        run(Policy.STATEMENT, engine, body)
    assert _count(engine, storage.schema()) == 1  # committed with its statement


def test_statement_policy_on_an_engine_runs_each_statement_in_its_own_transaction(engine):
    def body(runner: Runner) -> tuple:
        (first,) = runner.rows(_hot_txid(), {})
        (second,) = runner.rows(_hot_txid(), {})
        return first, second

    (assigned1, id1), (assigned2, id2) = run(Policy.STATEMENT, engine, body)
    assert assigned1 is None and assigned2 is None and id1 != id2  # no transaction block


def test_statement_policy_hands_the_pooled_connection_back_out_of_autocommit(engine):
    run(Policy.STATEMENT, engine, lambda runner: runner.rows(_hot_txid(), {}))
    raw = engine.raw_connection()
    try:
        assert raw.driver_connection.autocommit is False
    finally:
        raw.close()


def test_a_statement_operation_that_fails_hands_the_pooled_connection_back_out_of_autocommit(storage, db_url):
    from sqlalchemy import create_engine

    from qstore import InsertOpts, InsertParams, UniqueConflictError, UniqueOpts

    one = create_engine(db_url, pool_size=1, max_overflow=0)
    keyed = InsertParams("k", {"n": 1}, InsertOpts(queue="q", unique=UniqueOpts()))
    try:
        storage.enqueue(one, keyed)
        with pytest.raises(UniqueConflictError):  # refused after its statement ran
            storage.enqueue(one, keyed)
        with pytest.raises(ValidationError):  # refused before its statement
            storage.enqueue(one, InsertParams("k", {"n": float("nan")}, InsertOpts(queue="q")))
        raw = one.raw_connection()
        try:
            assert raw.driver_connection.autocommit is False
        finally:
            raw.close()
    finally:
        one.dispose()


def test_statement_policy_on_a_connection_runs_in_the_callers_transaction(storage, engine):
    with engine.connect() as conn:
        run(Policy.STATEMENT, conn, lambda runner: runner.rows(_hot_insert(storage.schema(), "a"), {"q": "a"}))
        assert conn.in_transaction()
        ((mine, _),) = conn.execute(select(func.txid_current_if_assigned(), func.txid_current())).all()
        assert mine is not None  # the insert ran in this transaction
        conn.rollback()
    assert _count(engine, storage.schema()) == 0


def test_statement_policy_sends_through_cursor_events_when_someone_listens(storage, engine):
    seen: list[str] = []

    def record(conn, cursor, statement, *rest) -> None:
        seen.append(statement)

    event.listen(engine, "before_cursor_execute", record)
    try:
        run(Policy.STATEMENT, engine, lambda runner: runner.rows(_hot_insert(storage.schema(), "a"), {"q": "a"}))
        with engine.connect() as conn:
            run(Policy.STATEMENT, conn, lambda runner: runner.rows(_hot_insert(storage.schema(), "b"), {"q": "b"}))
            conn.commit()
    finally:
        event.remove(engine, "before_cursor_execute", record)
    assert sum("queue_meta" in s for s in seen) == 2
    assert _count(engine, storage.schema()) == 2


def test_units_policy_on_an_engine_commits_each_unit_on_its_own(storage, engine):
    schema = storage.schema()

    def body(tx: Transactions) -> None:
        assert tx.owned
        with tx.unit() as conn:
            _insert(schema, "first")(conn)
        with tx.unit() as conn:
            _insert_then_fail(schema)(conn)

    with pytest.raises(RuntimeError):
        run(Policy.UNITS, engine, body)
    assert _count(engine, schema) == 1


def test_units_policy_on_a_connection_runs_every_unit_in_the_callers_transaction(storage, engine):
    schema = storage.schema()

    def body(tx: Transactions) -> None:
        assert not tx.owned
        with tx.unit() as conn:
            _insert(schema, "first")(conn)
        with tx.statement() as conn:
            _insert(schema, "second")(conn)

    with engine.connect() as conn:
        run(Policy.UNITS, conn, body)
        assert _count(engine, schema) == 0
        conn.rollback()
    assert _count(engine, schema) == 0


def test_no_transaction_policy_is_refused_inside_a_callers_transaction(engine):
    with engine.connect() as conn, pytest.raises(ValidationError, match="transaction block"):
        run(Policy.NO_TRANSACTION, conn, lambda inner: None)


def test_run_rejects_other_targets():
    with pytest.raises(ValidationError, match="target"):
        run(Policy.JOIN, "postgresql://x", lambda conn: None)  # type: ignore[arg-type]


def test_only_an_engine_target_reads_committed_state(engine):
    assert run(Policy.JOIN, engine, reads_committed_state)
    with engine.connect() as conn:
        assert not run(Policy.JOIN, conn, reads_committed_state)
    with Session(engine) as session:
        assert not run(Policy.JOIN, session, reads_committed_state)


def test_operation_on_unsupported_target_raises_validation_error(storage):
    with pytest.raises(ValidationError):
        storage.activate_backend(object())  # type: ignore[arg-type]


def _lock_timeout(conn) -> str:
    return conn.execute(text("SHOW lock_timeout")).scalar()


def test_a_guarded_step_that_waits_for_a_lock_is_blocked_and_leaves_the_transaction_usable(storage, engine):
    from qstore.storage.targets import BLOCKED, guarded

    schema = storage.schema()
    with engine.connect() as holder, engine.connect() as conn:
        _insert(schema, "before")(conn)
        holder.execute(text(f"LOCK TABLE {schema}.queue_claimer_state IN ACCESS EXCLUSIVE MODE"))

        def step(inner):
            _insert(schema, "in step")(inner)
            inner.execute(text(f"LOCK TABLE {schema}.queue_claimer_state IN ACCESS EXCLUSIVE MODE"))
            return "locked"

        assert guarded(conn, step) is BLOCKED
        assert _lock_timeout(conn) == "0"  # the step's timeout went with its savepoint
        assert conn.execute(text(f"SELECT queue FROM {schema}.queue_meta")).scalars().all() == ["before"]
        holder.rollback()
        assert guarded(conn, step) == "locked"
        assert _lock_timeout(conn) == "0"  # restored before the savepoint was released
        conn.commit()
    assert _count(engine, schema) == 2


def test_a_guarded_step_passes_any_other_error_on_and_rolls_its_savepoint_back(storage, engine):
    from qstore.storage.targets import guarded

    schema = storage.schema()
    with engine.connect() as conn:
        with pytest.raises(RuntimeError):
            guarded(conn, _insert_then_fail(schema))
        assert conn.execute(text(f"SELECT count(*) FROM {schema}.queue_meta")).scalar() == 0
        assert _lock_timeout(conn) == "0"


#: Where transactions are opened: the policy table, and the Alembic glue (Alembic runs its
#: revisions in the transaction it is given).
_OPENERS = ("qstore/storage/targets.py", "qstore/migrate.py", "qstore/migrations/")


def _transactions_opened_outside_the_policy_table() -> list[str]:
    import ast
    from pathlib import Path

    from qstore.storage import operations

    root = Path(__file__).resolve().parent.parent
    names = set(operations())
    found = []
    for path in sorted((root / "qstore").rglob("*.py")):
        where = str(path.relative_to(root))
        if where.startswith(_OPENERS):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in ("begin", "begin_nested"):
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)} opens a transaction")
            if not isinstance(node, ast.With):
                continue
            for item in node.items:
                call, var = item.context_expr, item.optional_vars
                if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                        and call.func.attr == "connect" and isinstance(var, ast.Name)):
                    continue
                for inner in (n for stmt in node.body for n in ast.walk(stmt)):
                    if isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute) \
                            and inner.func.attr in names and inner.args \
                            and isinstance(inner.args[0], ast.Name) and inner.args[0].id == var.id:
                        found.append(f"{where}:{inner.lineno}: {ast.unparse(inner)} runs on a "
                                     f"connection opened around it")
    return found


def test_no_code_outside_the_policy_table_opens_a_transaction_around_storage_calls():
    found = _transactions_opened_outside_the_policy_table()
    assert not found, ("make what must commit together one operation, or run it through "
                       "targets.run with a policy:\n" + "\n".join(found))
