"""What an operation raises when the database is not what it needs: a schema that is not
installed is named as such (``SchemaNotInstalledError``), never as a driver error carrying
SQL; every other database failure is one line naming the operation, what failed and the
SQLSTATE, with the driver's exception kept as ``__cause__``."""

from __future__ import annotations

import socket
import uuid
from dataclasses import replace

import psycopg
import pytest
from jobtools import params
from operation_cases import CASES
from sqlalchemy import create_engine, pool, text
from sqlalchemy import exc as sa_exc

from qstore import DatabaseError, QueueStorage, QueueStorageConfig, SchemaNotInstalledError
from qstore.cli.common import one_line
from qstore.errors import translated


def _schema_exists(engine, schema: str) -> bool:
    with engine.connect() as c:
        return bool(c.execute(text("SELECT count(*) FROM pg_namespace WHERE nspname = :s"), {"s": schema}).scalar())


@pytest.mark.parametrize("name", sorted(CASES))
def test_an_operation_on_a_schema_that_is_not_installed_says_so(engine, make_storage, name):
    """Each operation, on an Engine, for a schema the database does not hold (with the
    arguments that make it do its work on an installed one): ``SchemaNotInstalledError``
    naming the schema, in one line, the driver's error as its cause. The lifecycle calls
    that create or drop a schema do that instead."""
    case = CASES[name]
    st = make_storage(**case.shape)
    given = case.setup(engine, st)
    schema = f"t_missing_{uuid.uuid4().hex[:8]}"
    missing = QueueStorage(replace(st.config, schema=schema))
    if case.other_schema:
        given = {**given, "storage": QueueStorage(QueueStorageConfig(schema=schema))}
    assert not _schema_exists(engine, schema)
    try:
        if case.on_missing_schema == "raises":
            with pytest.raises(SchemaNotInstalledError) as info:
                case.call(missing, engine, given)
            err = info.value
            assert err.schema == schema
            assert "\n" not in str(err) and "SELECT" not in str(err) and "sqlalche.me" not in str(err), str(err)
            if name != "activate_backend":  # looks the table up itself, before any statement fails
                assert isinstance(err.__cause__, sa_exc.DBAPIError | psycopg.Error), repr(err.__cause__)
        elif case.on_missing_schema == "installs":
            case.call(missing, engine, given)
            assert _schema_exists(engine, schema)
        else:
            case.call(missing, engine, given)
            assert not _schema_exists(engine, schema)
    finally:
        with engine.begin() as c:
            c.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))


# -- one line: what failed, why, the SQLSTATE ----------------------------------------------------

#: One operation of each transaction policy's way to the database: a transaction of its own
#: (JOIN), a REPEATABLE READ one (SNAPSHOT), an autocommitted statement on the raw driver
#: connection (STATEMENT), a hot statement per unit (UNITS).
CALLS = {
    "queue_counts": lambda st, e: st.queue_counts(e, "q"),
    "load_job": lambda st, e: st.load_job(e, 1),
    "enqueue": lambda st, e: st.enqueue(e, params()),
    "claim_runtime_batch": lambda st, e: st.claim_runtime_batch(e, "q", 1),
}


def closed_port() -> int:
    """A local TCP port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def assert_one_clean_line(message: str) -> None:
    assert "\n" not in message, message
    for leak in ("[SQL", "SELECT", "[parameters", "sqlalche.me", "Background on this error"):
        assert leak not in message, message


def driver_error_of(err: BaseException) -> BaseException:
    cause = err.__cause__
    assert cause is not None
    return cause.orig if isinstance(cause, sa_exc.DBAPIError) else cause


@pytest.mark.parametrize("name", CALLS)
def test_a_refused_connection_is_one_line_naming_the_operation(name):
    eng = create_engine(f"postgresql+psycopg://postgres@127.0.0.1:{closed_port()}/postgres",
                        poolclass=pool.NullPool)
    try:
        with pytest.raises(DatabaseError) as info:
            CALLS[name](QueueStorage(), eng)
    finally:
        eng.dispose()
    err = info.value
    assert (err.operation, err.reason, err.sqlstate) == (name, "connection refused", "08001")
    assert str(err).startswith(f"{name} failed: connection refused (SQLSTATE 08001): "), str(err)
    assert_one_clean_line(str(err))
    assert isinstance(driver_error_of(err), psycopg.OperationalError)
    assert one_line(err) == str(err)


@pytest.mark.parametrize("name", CALLS)
def test_a_terminated_backend_is_one_line_naming_the_operation_and_the_next_call_works(db_url, engine, st, name):
    st.enqueue_params_batch(engine, [params(args={"n": i}) for i in range(3)])
    eng = create_engine(db_url, pool_size=1, max_overflow=0)  # every call on one connection
    try:
        CALLS[name](st, eng)
        with eng.connect() as c:
            pid = c.execute(text("SELECT pg_backend_pid()")).scalar_one()
        with engine.connect() as other:
            assert other.execute(text("SELECT pg_terminate_backend(:p, 5000)"), {"p": pid}).scalar()
        with pytest.raises(DatabaseError) as info:
            CALLS[name](st, eng)
        err = info.value
        assert err.operation == name
        assert (err.reason, err.sqlstate) in {("admin shutdown", "57P01"), ("connection lost", "08006"),
                                              ("server closed the connection unexpectedly", "08006")}, str(err)
        assert str(err).startswith(f"{name} failed: {err.reason} (SQLSTATE {err.sqlstate}): "), str(err)
        assert_one_clean_line(str(err))
        assert isinstance(driver_error_of(err), psycopg.OperationalError)
        CALLS[name](st, eng)  # the dead connection left the pool
    finally:
        eng.dispose()


def test_an_undefined_table_is_one_line_with_its_reason_and_no_sql(engine):
    """A missing table outside the install (here read directly: the operations name their
    own schema's as ``SchemaNotInstalledError``, tested above)."""
    with engine.connect() as c, pytest.raises(sa_exc.ProgrammingError) as raw:
        c.execute(text("SELECT secret FROM no_such_schema.t WHERE x = :v"), {"v": "hunter2"})
    err = translated(raw.value)
    assert isinstance(err, DatabaseError)
    assert (err.reason, err.sqlstate) == ("undefined table", "42P01")
    assert str(err) == ('database call failed: undefined table (SQLSTATE 42P01): '
                        'relation "no_such_schema.t" does not exist')
    assert "hunter2" not in str(err)
    assert err.__cause__ is None and err.original is raw.value  # chained where it is raised


def test_an_error_inside_an_operation_names_it(storage, engine):
    with engine.connect() as conn:
        with pytest.raises(sa_exc.DBAPIError):
            conn.execute(text("SELECT 1/0"))
        with pytest.raises(DatabaseError) as info:  # the caller's transaction is aborted
            storage.activate_backend(conn)
        conn.rollback()
    err = info.value
    assert (err.operation, err.reason, err.sqlstate) == ("activate_backend", "in failed sql transaction", "25P02")
    assert str(err).startswith("activate_backend failed: in failed sql transaction (SQLSTATE 25P02): current "
                               "transaction is aborted"), str(err)
    assert_one_clean_line(str(err))
