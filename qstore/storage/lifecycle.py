"""Install, upgrade, activate, discover and reset storage schemas."""

from __future__ import annotations

from sqlalchemy import (
    Connection,
    case,
    column,
    func,
    inspect,
    literal,
    select,
    table,
    text,
    union_all,
    update,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.types import DateTime, Text

from qstore import migrate
from qstore.config import DEFAULT_SCHEMA, QueueStorageConfig
from qstore.errors import SchemaNotInstalledError, ValidationError
from qstore.schema import StorageSchema, seed_rows, storage_schema
from qstore.storage._tx import Target, transaction

BACKEND = "queue_storage"


def prepare_schema(engine: Target, config: QueueStorageConfig) -> bool:
    """Install or upgrade ``config``'s schema to head through Alembic, in one transaction,
    serialised per schema by ``pg_advisory_xact_lock``. Returns True if anything ran.

    Raises ``ValidationError`` when the schema is already installed with another shape.
    """
    with transaction(engine) as conn:
        migrate.lock_install(conn, config.schema)
        recorded = migrate.read_recorded_config(conn, config.schema)
        if recorded is not None and recorded != config:
            raise ValidationError(
                "config", config,
                f"schema {config.schema!r} is installed with a different shape: {recorded}",
            )
        before = migrate.current_revision(conn, config)
        if recorded is not None and before is None:
            raise ValidationError(
                "schema", config.schema,
                "is installed without Alembic (metadata.create_all) and has no version row; "
                f"run `alembic -x schema={config.schema} stamp head` once, or drop it",
            )
        migrate.upgrade(conn, config, "heads")
        return migrate.current_revision(conn, config) != before


def activate_backend(engine: Target, sch: StorageSchema) -> None:
    """Register this schema as the active queue-storage backend (idempotent)."""
    with transaction(engine) as conn:
        _require_installed(conn, sch)
        stmt = pg_insert(sch.backends).values(backend=BACKEND, schema_name=sch.config.schema)
        conn.execute(stmt.on_conflict_do_update(
            index_elements=[sch.backends.c.backend],
            set_={"schema_name": stmt.excluded.schema_name, "updated_at": func.clock_timestamp()},
        ))
        res = conn.execute(
            update(sch.transition)
            .where(sch.transition.c.singleton.is_(True))
            .values(
                state="active",
                current_engine=BACKEND,
                transition_epoch=sch.transition.c.transition_epoch
                + case((sch.transition.c.state != "active", 1), else_=0),
                updated_at=func.clock_timestamp(),
            )
        )
        if res.rowcount == 0:
            raise ValidationError("storage_transition_state", None,
                                  "transition singleton is missing; reinstall the schema")


def _require_installed(conn: Connection, sch: StorageSchema) -> None:
    if not inspect(conn).has_table(sch.backends.name, schema=sch.config.schema):
        raise SchemaNotInstalledError(sch.config.schema)


def active_schema_in_tx(conn: Connection) -> str | None:
    """The most recently activated qstore schema of this database, read on ``conn``."""
    schemas = conn.execute(
        text(
            "SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE c.relname = 'runtime_storage_backends' AND c.relkind = 'r' "
            "AND EXISTS (SELECT 1 FROM pg_class s WHERE s.relnamespace = n.oid "
            "            AND s.relname = 'storage_config')"
        )
    ).scalars().all()
    if not schemas:
        return None
    parts = []
    for name in schemas:
        t = table("runtime_storage_backends", column("backend", Text), column("schema_name", Text),
                  column("updated_at", DateTime(timezone=True)), schema=name)
        parts.append(select(t.c.schema_name, t.c.updated_at).where(t.c.backend == literal(BACKEND)))
    q = union_all(*parts).subquery()
    return conn.execute(
        select(q.c.schema_name).order_by(q.c.updated_at.desc()).limit(1)
    ).scalar()


def active_schema(engine: Target) -> str | None:
    with transaction(engine) as conn:
        return active_schema_in_tx(conn)


def reset(engine: Target, sch: StorageSchema, *, force: bool = False) -> None:
    """Drop the install's schema (every table, function, sequence and version row).

    The default schema is refused unless ``force=True``: it is usually the production
    install.
    """
    if sch.config.schema == DEFAULT_SCHEMA and not force:
        raise ValidationError(
            "schema", sch.config.schema,
            "refusing to reset the default schema; call reset(engine, force=True) if you "
            "really mean to drop it",
        )
    with transaction(engine) as conn:
        migrate.lock_install(conn, sch.config.schema)
        prep = conn.dialect.identifier_preparer
        conn.execute(text(f"DROP SCHEMA IF EXISTS {prep.quote_schema(sch.config.schema)} CASCADE"))


def create_all(conn: Connection, config: QueueStorageConfig) -> None:
    """Fast install for tests/embedding without Alembic: schema + ``metadata.create_all``.
    The install has no version row; ``prepare_schema`` would then refuse to re-create it."""
    from sqlalchemy.schema import CreateSchema

    conn.execute(CreateSchema(config.schema, if_not_exists=True))
    storage_schema(config).metadata.create_all(conn)


def load_config(engine: Target, schema: str) -> QueueStorageConfig:
    """Read the shape recorded by an install of ``schema``."""
    with transaction(engine) as conn:
        cfg = migrate.read_recorded_config(conn, schema)
    if cfg is None:
        raise SchemaNotInstalledError(schema)
    return cfg


__all__ = [
    "activate_backend",
    "active_schema",
    "active_schema_in_tx",
    "create_all",
    "load_config",
    "prepare_schema",
    "reset",
    "seed_rows",
]
