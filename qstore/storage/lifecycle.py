"""Install, upgrade, activate, discover and reset storage schemas."""

from __future__ import annotations

from sqlalchemy import (
    Connection,
    DateTime,
    Text,
    column,
    inspect,
    literal,
    select,
    table,
    text,
    union_all,
)
from sqlalchemy.schema import CreateSchema

from qstore import migrate
from qstore.config import DEFAULT_SCHEMA, QueueStorageConfig
from qstore.errors import SchemaNotInstalledError, ValidationError
from qstore.migrate import REVISIONS
from qstore.schema import storage_schema
from qstore.storage.context import StorageContext
from qstore.storage.planes import control

__all__ = [
    "activate_backend",
    "active_schema_in_tx",
    "create_all",
    "install",
    "load_config",
    "prepare_schema",
    "reset",
]


def prepare_schema(ctx: StorageContext, conn: Connection) -> bool:
    """Install or upgrade the schema to head through Alembic, on ``conn``'s transaction,
    serialised per schema by an advisory lock. Returns True if any revision ran.

    An install already at head is left alone without running Alembic (so a role that may
    not create anything can call it). An install made through a host application's Alembic
    (the ``qstore`` branch's row in the host's version table) is recognised: at head it is a
    no-op; behind head it is refused, since the host's ``alembic upgrade heads`` upgrades it.

    Raises ``ShapeMismatchError`` (a ``ValidationError``) naming both values when the schema
    is installed with another shape, and ``ValidationError`` saying what was found when the
    install has no version row or is at a revision this release does not know.
    """
    config = ctx.config
    migrate.lock_install(conn, config.schema)
    state = migrate.install_state(conn, config.schema)
    migrate.resolve_shape(config.schema, state.config, migrate.shape_of(config))
    if state.installed and state.version is None:
        raise ValidationError(
            "schema", config.schema,
            f"{state.describe()}; run `alembic -x schema={config.schema} stamp head` once to "
            f"let Alembic carry it, or drop it")
    if state.version is not None and state.version.revision not in REVISIONS:
        raise ValidationError(
            "schema", config.schema,
            f"{state.describe()}, which this qstore release does not know (its newest is "
            f"{REVISIONS[-1]}); run a release that has it")
    if state.at_head:
        return False
    if state.version is not None and state.version.host:
        raise ValidationError(
            "schema", config.schema,
            f"{state.describe()}, behind head {REVISIONS[-1]}; upgrade it with your "
            f"application's `alembic upgrade heads`")
    before = state.version.revision if state.version is not None else None
    migrate.upgrade(conn, config, "heads")
    return migrate.current_revision(conn, config) != before


def activate_backend(ctx: StorageContext, conn: Connection) -> None:
    """Register this schema as the active queue-storage backend (idempotent)."""
    if not inspect(conn).has_table(ctx.schema.backends.name, schema=ctx.config.schema):
        raise SchemaNotInstalledError(ctx.config.schema)
    control.activate(conn, ctx.schema)


def install(ctx: StorageContext, conn: Connection) -> None:
    """``prepare_schema`` then ``activate_backend``, on one transaction."""
    prepare_schema(ctx, conn)
    activate_backend(ctx, conn)


def reset(ctx: StorageContext, conn: Connection, *, force: bool = False) -> None:
    """Drop this schema entirely (every table, function, sequence and version row). Refuses
    the default schema — usually the production install — unless ``force=True``."""
    schema = ctx.config.schema
    if schema == DEFAULT_SCHEMA and not force:
        raise ValidationError("schema", schema, "refusing to reset the default schema; call "
                              "reset(engine, force=True) if you really mean to drop it")
    migrate.lock_install(conn, schema)
    prep = conn.dialect.identifier_preparer
    conn.execute(text(f"DROP SCHEMA IF EXISTS {prep.quote_schema(schema)} CASCADE"))


def active_schema_in_tx(conn: Connection) -> str | None:
    """The most recently activated qstore schema of this database, read on ``conn``."""
    schemas = conn.execute(text(
        "SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE c.relname = 'runtime_storage_backends' AND c.relkind = 'r' "
        "AND EXISTS (SELECT 1 FROM pg_class s WHERE s.relnamespace = n.oid "
        "            AND s.relname = 'storage_config')"
    )).scalars().all()
    if not schemas:
        return None
    parts = []
    for name in schemas:
        t = table("runtime_storage_backends", column("backend", Text), column("schema_name", Text),
                  column("updated_at", DateTime(timezone=True)), schema=name)
        parts.append(select(t.c.schema_name, t.c.updated_at).where(t.c.backend == literal(control.BACKEND)))
    q = union_all(*parts).subquery()
    return conn.execute(select(q.c.schema_name).order_by(q.c.updated_at.desc()).limit(1)).scalar()


def create_all(conn: Connection, config: QueueStorageConfig) -> None:
    """Fast install for tests/embedding without Alembic: schema + ``metadata.create_all``.
    The install has no version row; ``prepare_schema`` would then refuse to re-create it."""
    conn.execute(CreateSchema(config.schema, if_not_exists=True))
    storage_schema(config).metadata.create_all(conn)


def load_config(conn: Connection, schema: str) -> QueueStorageConfig:
    """The shape recorded by an install of ``schema``; ``SchemaNotInstalledError`` if none."""
    cfg = migrate.read_recorded_config(conn, schema)
    if cfg is None:
        raise SchemaNotInstalledError(schema, migrate.found_installs(conn))
    return cfg
