"""Alembic glue: config resolution for revisions, the shared ``env.py`` logic, the
``include_object``/``include_name`` filters partitions need, and programmatic upgrade.

Revisions live in ``qstore/migrations/versions`` (shipped in the wheel, branch label
``qstore``). The repository's top-level ``alembic/`` environment and the packaged
``qstore/migrations`` environment both call :func:`run_env`; a host application adds
:func:`version_location` to its own ``version_locations`` instead.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from alembic.config import Config as AlembicConfig
from sqlalchemy import Connection, create_engine, func, inspect, literal, pool, select, text
from sqlalchemy.schema import CreateSchema

from alembic import command
from qstore.config import DEFAULT_SCHEMA, QueueStorageConfig
from qstore.errors import ValidationError
from qstore.schema import StorageSchema, storage_schema
from qstore.schema.functions import execute_ddl

__all__ = [
    "BRANCH_LABEL",
    "alembic_config",
    "config_from_x_args",
    "current_revision",
    "downgrade",
    "include_name_for",
    "include_object_for",
    "lock_install",
    "migration_config",
    "read_recorded_config",
    "revision_shape",
    "run_env",
    "run_statements",
    "serialise_migrations",
    "upgrade",
    "version_location",
]

BRANCH_LABEL = "qstore"
PACKAGE_MIGRATIONS = Path(__file__).with_name("migrations")
CONFIG_ATTRIBUTE = "qstore_config"
_X_FIELDS: dict[str, Callable[[str], Any]] = {
    "queue_slot_count": int,
    "lease_slot_count": int,
    "claim_slot_count": int,
    "queue_stripe_count": int,
    "lease_claim_receipts": lambda v: str(v).lower() in ("1", "true", "yes", "on"),
}


def version_location() -> str:
    """Filesystem path of qstore's revision modules, for a host's ``version_locations``."""
    return str(PACKAGE_MIGRATIONS / "versions")


def config_from_x_args(x_args: Mapping[str, str]) -> QueueStorageConfig | None:
    """Build a config from ``alembic -x schema=… -x queue_slot_count=…``; None if absent."""
    schema = x_args.get("qstore_schema") or x_args.get("schema")
    shape = {k: conv(x_args[k]) for k, conv in _X_FIELDS.items() if k in x_args}
    if schema is None and not shape:
        return None
    return QueueStorageConfig(schema=schema or DEFAULT_SCHEMA, **shape)


def read_recorded_config(connection: Connection, schema: str) -> QueueStorageConfig | None:
    """The configuration recorded by the first revision, or None if not installed."""
    if not inspect(connection).has_table("storage_config", schema=schema):
        return None
    sch = storage_schema(QueueStorageConfig(schema=schema) if schema != DEFAULT_SCHEMA
                         else QueueStorageConfig())
    row = connection.execute(select(sch.storage_config)).mappings().first()
    if row is None:
        return None
    return QueueStorageConfig(
        schema=schema,
        queue_slot_count=row["queue_slot_count"],
        lease_slot_count=row["lease_slot_count"],
        claim_slot_count=row["claim_slot_count"],
        queue_stripe_count=row["queue_stripe_count"],
        lease_claim_receipts=row["lease_claim_receipts"],
    )


def migration_config(kw: Mapping[str, Any] | None = None) -> QueueStorageConfig:
    """Resolve the install a revision is running for.

    Order: an explicit ``qstore_config`` (programmatic runs), ``-x`` arguments, the
    configuration recorded in the database for the resolved schema, then the default.
    """
    from alembic import context, op

    if kw and isinstance(kw.get(CONFIG_ATTRIBUTE), QueueStorageConfig):
        return kw[CONFIG_ATTRIBUTE]
    attrs = context.config.attributes if context.config is not None else {}
    cfg = attrs.get(CONFIG_ATTRIBUTE)
    if isinstance(cfg, QueueStorageConfig):
        return cfg
    from_x = config_from_x_args(context.get_x_argument(as_dictionary=True))
    schema = from_x.schema if from_x else DEFAULT_SCHEMA
    recorded = read_recorded_config(op.get_bind(), schema)
    if recorded is not None:
        if from_x is not None and from_x != recorded and not from_x.uses_defaults():
            raise ValidationError(
                "config", from_x, f"schema {schema!r} is installed with {recorded}"
            )
        return recorded
    return from_x or QueueStorageConfig()


def revision_shape(kw: Mapping[str, Any] | None = None) -> QueueStorageConfig:
    """The shape of the install a revision's ``upgrade``/``downgrade`` is running for (see
    :func:`migration_config`), with that install's migration lock held (so a host
    application's Alembic run and :meth:`QueueStorage.prepare_schema` never interleave).
    Revisions read only its plain fields."""
    from alembic import op

    cfg = migration_config(kw)
    lock_install(op.get_bind(), cfg.schema)
    return cfg


def run_statements(connection: Connection, statements: Sequence[str]) -> None:
    """Execute a revision's frozen statements, each exactly as rendered (no bind-parameter
    parsing: ``%`` and ``:name`` inside function bodies reach the server unchanged)."""
    for statement in statements:
        execute_ddl(connection, statement)


def _children(sch: StorageSchema) -> set[str]:
    return {t.name for t in sch.metadata.tables.values() if "qstore_partition_of" in t.info}


def include_name_for(sch: StorageSchema) -> Callable[[str | None, str, Mapping[str, Any]], bool]:
    """``include_name``: only this install's schema, never the Alembic version table."""
    schema = sch.config.schema

    def include_name(name: str | None, type_: str, parent_names: Mapping[str, Any]) -> bool:
        if type_ == "schema":
            return name == schema
        if type_ == "table":
            return name != sch.config.version_table and parent_names.get("schema_name") == schema
        return True

    return include_name


def include_object_for(sch: StorageSchema) -> Callable[[Any, str | None, str, bool, Any], bool]:
    """``include_object``: skip PostgreSQL's derived child indexes and foreign entities."""
    children = _children(sch)
    schema = sch.config.schema

    def include_object(obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
        if type_ == "index" and reflected and compare_to is None:
            table = getattr(obj, "table", None)
            if table is not None and table.name in children:
                return False  # created by PostgreSQL from the parent's index
        entity_schema = getattr(obj, "schema", None)
        if type_ not in ("table", "column", "index", "unique_constraint", "foreign_key_constraint"):
            # alembic_utils entities (functions, views) of other installs in this process
            return entity_schema in (None, schema)
        return True

    return include_object


def _register_entities(sch: StorageSchema) -> None:
    try:
        from alembic_utils.pg_function import PGFunction
        from alembic_utils.pg_view import PGView
        from alembic_utils.replaceable_entity import register_entities
    except ImportError:  # the runtime does not need alembic_utils; only diffing does
        return
    register_entities(
        [PGFunction(schema=f.schema, signature=f.signature, definition=f.definition)
         for f in sch.functions]
        + [PGView(schema=v.schema, signature=v.name, definition=v.definition) for v in sch.views]
    )


def run_env() -> None:
    """Body of ``env.py`` (repository ``alembic/`` and packaged ``qstore/migrations``)."""
    from alembic import context

    acfg = context.config
    connection = acfg.attributes.get("connection")
    if connection is None:
        url = (context.get_x_argument(as_dictionary=True).get("url")
               or os.environ.get("QSTORE_DATABASE_URL")
               or acfg.get_main_option("sqlalchemy.url"))
        if not url:
            raise ValidationError("sqlalchemy.url", url, "set -x url=…, QSTORE_DATABASE_URL or alembic.ini")
        engine = create_engine(url, poolclass=pool.NullPool)
        with engine.connect() as conn:
            _run_with_connection(context, conn, owned=True)
        engine.dispose()
    else:
        _run_with_connection(context, connection, owned=False)


def _resolve_env_config(context: Any, connection: Connection) -> QueueStorageConfig:
    cfg = context.config.attributes.get(CONFIG_ATTRIBUTE)
    if isinstance(cfg, QueueStorageConfig):
        return cfg
    from_x = config_from_x_args(context.get_x_argument(as_dictionary=True))
    schema = from_x.schema if from_x else DEFAULT_SCHEMA
    return read_recorded_config(connection, schema) or from_x or QueueStorageConfig()


def _run_with_connection(context: Any, connection: Connection, *, owned: bool) -> None:
    cfg = _resolve_env_config(context, connection)
    if owned:
        connection.commit()  # end the read above: the migration runs in a transaction of its own
    context.config.attributes[CONFIG_ATTRIBUTE] = cfg
    sch = storage_schema(cfg)
    _register_entities(sch)
    context.configure(
        connection=connection,
        target_metadata=sch.metadata,
        version_table=cfg.version_table,
        version_table_schema=cfg.schema,
        include_schemas=True,
        include_name=include_name_for(sch),
        include_object=include_object_for(sch),
        compare_type=True,
        transactional_ddl=True,
    )
    with context.begin_transaction():
        # One run at a time per install: a concurrent run (another deploy, prepare_schema)
        # waits here, then finds the schema and version table as the first one left them.
        lock_install(connection, cfg.schema)
        # The version table lives inside the storage schema, so the schema must exist first.
        connection.execute(CreateSchema(cfg.schema, if_not_exists=True))
        context.run_migrations(qstore_config=cfg)


def lock_install(connection: Connection, schema: str) -> None:
    """Take the transaction-scoped advisory lock that serialises installs, upgrades and
    downgrades of ``schema`` (held until the transaction ends; re-entrant)."""
    connection.execute(select(func.pg_advisory_xact_lock(install_lock_key(schema))))


def serialise_migrations(connection: Connection) -> None:
    """For a host application's ``env.py``: call inside ``context.begin_transaction()``,
    before ``context.run_migrations()``. Concurrent ``alembic upgrade`` runs against the same
    database (two pods deploying at once) then run one after the other: the second waits,
    sees the version table the first committed, and has nothing left to do."""
    connection.execute(select(func.pg_advisory_xact_lock(
        func.hashtextextended(literal("qstore.alembic:") + func.current_database(), 0))))


def alembic_config(config: QueueStorageConfig, connection: Connection | None = None) -> AlembicConfig:
    """An Alembic ``Config`` for the packaged environment, bound to ``connection``."""
    acfg = AlembicConfig()
    acfg.set_main_option("script_location", str(PACKAGE_MIGRATIONS))
    acfg.set_main_option("path_separator", "os")
    acfg.set_main_option("version_locations", version_location())
    acfg.attributes[CONFIG_ATTRIBUTE] = config
    if connection is not None:
        acfg.attributes["connection"] = connection
    return acfg


def upgrade(connection: Connection, config: QueueStorageConfig, target: str = "heads") -> None:
    """Run ``alembic upgrade`` for ``config`` on ``connection`` (inside its transaction)."""
    command.upgrade(alembic_config(config, connection), target)


def downgrade(connection: Connection, config: QueueStorageConfig, target: str = "base") -> None:
    command.downgrade(alembic_config(config, connection), target)


def current_revision(connection: Connection, config: QueueStorageConfig) -> str | None:
    """The install's Alembic revision (None when not installed)."""
    if not inspect(connection).has_table(config.version_table, schema=config.schema):
        return None
    prep = connection.dialect.identifier_preparer
    return connection.execute(
        text(f"SELECT version_num FROM {prep.quote_schema(config.schema)}."
             f"{prep.quote(config.version_table)}")
    ).scalar()


def install_lock_key(schema: str) -> Any:
    """Advisory-lock key serialising installs/upgrades of one schema."""
    return func.hashtextextended(f"qstore.install:{schema}", 0)
