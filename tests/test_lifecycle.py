"""Install, upgrade, activate, discover and reset storage schemas."""

from __future__ import annotations

import io
import subprocess
import sys
import threading
import uuid

import pytest
from sqlalchemy import create_engine, inspect, pool, text
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import make_url

from qstore import (
    DatabaseError,
    QueueStorage,
    QueueStorageConfig,
    QueueStorageError,
    SchemaNotInstalledError,
    ValidationError,
    cli,
)
from qstore.migrate import REVISIONS, current_revision
from qstore.storage import lifecycle


def _fast_install(engine, **fields) -> QueueStorage:
    """create_all install into ``engine``'s database (a fresh one: dropped with it)."""
    s = QueueStorage(QueueStorageConfig(**fields))
    with engine.begin() as conn:
        lifecycle.create_all(conn, s.config)
    return s


def _schemas(engine) -> set[str]:
    return set(inspect(engine).get_schema_names())


# -- prepare_schema -----------------------------------------------------------------------


def test_prepare_schema_from_eight_threads_on_empty_database_installs_exactly_once(fresh_engine):
    storage = QueueStorage()
    barrier = threading.Barrier(8)
    results: list[bool] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def run() -> None:
        barrier.wait()
        try:
            ran = storage.prepare_schema(fresh_engine)
        except BaseException as err:  # collected and asserted below
            with lock:
                errors.append(err)
        else:
            with lock:
                results.append(ran)

    threads = [threading.Thread(target=run) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == []
    assert sorted(results) == [False] * 7 + [True]
    with fresh_engine.connect() as conn:
        assert current_revision(conn, storage.config) == REVISIONS[-1]


def test_prepare_schema_returns_true_when_it_installs(make_storage, engine):
    s = QueueStorage(QueueStorageConfig(schema=f"t_{uuid.uuid4().hex[:8]}"))
    try:
        assert s.prepare_schema(engine) is True
        with engine.connect() as conn:
            assert current_revision(conn, s.config) == REVISIONS[-1]
    finally:
        with engine.begin() as conn:
            conn.execute(text(f"DROP SCHEMA IF EXISTS {s.schema()} CASCADE"))


def test_prepare_schema_is_idempotent(make_storage, engine):
    s = make_storage(via_alembic=True)
    assert s.prepare_schema(engine) is False
    assert s.prepare_schema(engine) is False
    with engine.connect() as conn:
        assert current_revision(conn, s.config) == REVISIONS[-1]
        assert conn.execute(text(f"SELECT count(*) FROM {s.schema()}.queue_ring_state")).scalar() == 1


def test_prepare_schema_with_different_shape_for_installed_schema_raises(make_storage, engine):
    s = make_storage(via_alembic=True, queue_slot_count=4)
    other = QueueStorage(QueueStorageConfig(schema=s.schema(), queue_slot_count=5))
    with pytest.raises(ValidationError) as info:
        other.prepare_schema(engine)
    assert "different shape" in str(info.value)


def test_prepare_schema_does_not_activate(fresh_engine):
    QueueStorage(QueueStorageConfig(schema="inactive")).prepare_schema(fresh_engine)
    assert QueueStorage.active_schema(fresh_engine) is None


def test_prepare_schema_on_a_caller_connection_rolls_back_with_the_caller(fresh_engine):
    s = QueueStorage(QueueStorageConfig(schema="rolled"))
    with fresh_engine.connect() as conn, conn.begin() as tx:
        assert s.prepare_schema(conn) is True
        tx.rollback()
    assert "rolled" not in _schemas(fresh_engine)


# -- install / activate / discover --------------------------------------------------------


def test_install_makes_the_schema_the_active_schema(fresh_engine):
    s = QueueStorage(QueueStorageConfig(schema="shop"))
    s.install(fresh_engine)
    assert QueueStorage.active_schema(fresh_engine) == "shop"


def test_active_schema_in_tx_reads_on_the_callers_connection(fresh_engine):
    s = QueueStorage(QueueStorageConfig(schema="shop"))
    s.install(fresh_engine)
    with fresh_engine.connect() as conn:
        assert QueueStorage.active_schema_in_tx(conn) == "shop"


def test_active_schema_in_tx_sees_the_callers_uncommitted_activation(fresh_engine):
    s = _fast_install(fresh_engine, schema="shop")
    with fresh_engine.connect() as conn:
        s.activate_backend(conn)
        assert QueueStorage.active_schema_in_tx(conn) == "shop"
        assert QueueStorage.active_schema(fresh_engine) is None
        conn.rollback()


def test_active_schema_is_none_when_nothing_is_installed(fresh_engine):
    assert QueueStorage.active_schema(fresh_engine) is None


def test_installed_but_never_activated_schema_is_not_active(fresh_engine):
    _fast_install(fresh_engine, schema="idle")
    assert QueueStorage.active_schema(fresh_engine) is None


def test_most_recently_activated_schema_wins(fresh_engine):
    a = _fast_install(fresh_engine, schema="first")
    b = _fast_install(fresh_engine, schema="second")
    a.activate_backend(fresh_engine)
    b.activate_backend(fresh_engine)
    assert QueueStorage.active_schema(fresh_engine) == "second"
    a.activate_backend(fresh_engine)
    assert QueueStorage.active_schema(fresh_engine) == "first"


def test_activate_backend_is_idempotent_and_marks_transition_active(storage, engine):
    storage.activate_backend(engine)
    storage.activate_backend(engine)
    with engine.connect() as conn:
        backends = conn.execute(text(
            f"SELECT backend, schema_name FROM {storage.schema()}.runtime_storage_backends")).all()
        state = conn.execute(text(
            f"SELECT state, current_engine, transition_epoch "
            f"FROM {storage.schema()}.storage_transition_state")).one()
    assert [tuple(r) for r in backends] == [("queue_storage", storage.schema())]
    assert tuple(state) == ("active", "queue_storage", 1)


def test_activate_backend_of_missing_schema_raises_schema_not_installed(engine):
    s = QueueStorage(QueueStorageConfig(schema=f"t_{uuid.uuid4().hex[:8]}"))
    with pytest.raises(SchemaNotInstalledError):
        s.activate_backend(engine)


def test_from_existing_schema_with_engine_reads_the_recorded_shape(make_storage, engine):
    s = make_storage(queue_slot_count=6, lease_slot_count=3, claim_slot_count=2,
                     queue_stripe_count=2, lease_claim_receipts=False)
    again = QueueStorage.from_existing_schema(s.schema(), engine)
    assert again.config == s.config


def test_from_existing_schema_of_missing_schema_raises_schema_not_installed(engine):
    with pytest.raises(SchemaNotInstalledError) as info:
        QueueStorage.from_existing_schema("missing", engine)
    assert info.value.schema == "missing"
    assert "alembic upgrade head" in str(info.value)


# -- reset --------------------------------------------------------------------------------


def test_reset_drops_the_schema(make_storage, engine):
    s = make_storage()
    s.reset(engine)
    assert s.schema() not in _schemas(engine)


def test_reset_of_missing_schema_is_a_no_op(engine):
    QueueStorage(QueueStorageConfig(schema=f"t_{uuid.uuid4().hex[:8]}")).reset(engine)


def test_reset_of_default_schema_without_force_raises_and_says_how(fresh_engine):
    QueueStorage().prepare_schema(fresh_engine)
    with pytest.raises(ValidationError) as info:
        QueueStorage().reset(fresh_engine)
    assert "force=True" in str(info.value)
    assert "qstore" in _schemas(fresh_engine)


def test_reset_of_default_schema_with_force_drops_it(fresh_engine):
    QueueStorage().prepare_schema(fresh_engine)
    QueueStorage().reset(fresh_engine, force=True)
    assert "qstore" not in _schemas(fresh_engine)


def test_prepare_schema_after_reset_reinstalls(make_storage, engine):
    s = make_storage(via_alembic=True)
    s.reset(engine)
    assert s.prepare_schema(engine) is True


# -- errors -------------------------------------------------------------------------------


def test_driver_error_surfaces_as_database_error(db_url):
    url = make_url(db_url).set(database=f"no_such_db_{uuid.uuid4().hex[:8]}")
    eng = create_engine(url, poolclass=pool.NullPool)
    with pytest.raises(DatabaseError) as info:
        QueueStorage.active_schema(eng)
    eng.dispose()
    assert isinstance(info.value, QueueStorageError)
    assert not isinstance(info.value, sa_exc.SQLAlchemyError)
    assert isinstance(info.value.__cause__, sa_exc.DBAPIError)


def test_driver_error_inside_an_operation_carries_its_sqlstate(storage, engine):
    with engine.connect() as conn:
        with pytest.raises(sa_exc.DBAPIError):
            conn.execute(text("SELECT 1/0"))
        # the caller's transaction is now aborted: the next statement fails with 25P02
        with pytest.raises(DatabaseError) as info:
            storage.activate_backend(conn)
        conn.rollback()
    assert info.value.sqlstate == "25P02"


# -- command line (python -m qstore) ------------------------------------------------------


def test_cli_install_installs_and_activates_the_schema(fresh_db_url, fresh_engine):
    proc = subprocess.run(
        [sys.executable, "-m", "qstore", "install", "--url", fresh_db_url, "--schema", "shop",
         "--queue-slot-count", "4"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "'shop' installed/upgraded and active" in proc.stdout
    assert QueueStorage.active_schema(fresh_engine) == "shop"
    assert QueueStorage.from_existing_schema("shop", fresh_engine).queue_slot_count() == 4


def test_cli_demo_prints_the_three_rings_and_the_tables(fresh_db_url):
    out = io.StringIO()
    assert cli.main(["demo", "--url", fresh_db_url, "--schema", "demo", "--show-tables", "--jobs", "0",
                     "--queue-slot-count", "4", "--lease-slot-count", "2"], out=out) == 0
    text_out = out.getvalue()
    assert "queue ring: current_slot=0 generation=0 slot_count=4" in text_out
    assert "lease ring: current_slot=0 generation=0 slot_count=2" in text_out
    assert "claim ring: current_slot=0 generation=0 slot_count=8" in text_out
    assert "slot   3 (unused): ready_entries_3, ready_tombstones_3" in text_out
    assert "lease_claims_7, lease_claim_closures_7" in text_out
    assert "tables in schema 'demo'" in text_out
    assert "deferred_jobs" in text_out


def test_cli_rejects_a_bad_schema_with_exit_code_one(fresh_db_url, capsys):
    assert cli.main(["install", "--url", fresh_db_url, "--schema", "Bad"]) == 1
    assert "invalid schema='Bad'" in capsys.readouterr().err


def test_prepare_schema_on_a_create_all_install_says_how_to_adopt_it(engine):
    config = QueueStorageConfig(schema=f"t_{uuid.uuid4().hex[:8]}")
    with engine.begin() as conn:
        lifecycle.create_all(conn, config)
    try:
        with pytest.raises(ValidationError, match="stamp head"):
            QueueStorage(config).prepare_schema(engine)
    finally:
        with engine.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{config.schema}" CASCADE'))
