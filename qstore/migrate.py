"""Alembic glue: config resolution for revisions, the shared ``env.py`` logic, the
``include_object``/``include_name`` filters partitions need, programmatic upgrade, and what
a host application's own Alembic environment needs to carry qstore's revisions.

Revisions live in ``qstore/migrations/versions`` (shipped in the wheel, branch label
``qstore``). The repository's top-level ``alembic/`` environment and the packaged
``qstore/migrations`` environment both call :func:`run_env`; a host application adds
``qstore:migrations/versions`` to its own ``version_locations`` instead and, in its
``env.py``, passes :func:`host_revision_directives` and ``include_name_for(host=True)`` to
``context.configure`` and calls :func:`guard_host_migrations` before running migrations
(``docs/embedding.md``).

Where an install's revision is recorded (:func:`install_state`): in its own version table
``<schema>.qstore_alembic_version`` (installed by ``qstore install``, ``prepare_schema`` or
qstore's own Alembic environment), or as the ``qstore`` branch's row in a host
application's version table (installed through the host's Alembic). One host version table
carries one storage schema.

The shape rule, everywhere (:func:`resolve_shape`): the shape an install recorded wins; an
explicit value that conflicts with it is a :class:`~qstore.errors.ShapeMismatchError`
naming both values; an install is never resized.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from alembic.config import Config as AlembicConfig
from alembic.util import CommandError
from sqlalchemy import Connection, create_engine, func, inspect, literal, pool, select, text
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import make_url
from sqlalchemy.schema import CreateSchema

from alembic import command
from qstore.config import DEFAULT_SCHEMA, QueueStorageConfig
from qstore.errors import QueueStorageError, ShapeMismatchError, ValidationError
from qstore.schema import StorageSchema, storage_schema
from qstore.schema.control_plane import unique_claim_trigger
from qstore.schema.functions import execute_ddl

__all__ = [
    "BRANCH_LABEL",
    "REVISIONS",
    "SHAPE_FIELDS",
    "InstallState",
    "VersionRecord",
    "alembic_config",
    "config_from_x_args",
    "current_revision",
    "downgrade",
    "guard_host_migrations",
    "host_revision_directives",
    "include_name_for",
    "include_object_for",
    "install_state",
    "lock_install",
    "migration_config",
    "qstore_schemas",
    "read_recorded_config",
    "resolve_shape",
    "revision_shape",
    "run_env",
    "run_statements",
    "serialise_migrations",
    "upgrade",
    "version_location",
]


_REVISION_FILE = re.compile(r"qstore_(\d{4})_\w+\.py")


def _revisions() -> tuple[str, ...]:
    versions = resources.files("qstore.migrations").joinpath("versions")
    return tuple(sorted(m.group(1) for entry in versions.iterdir()
                        if (m := _REVISION_FILE.fullmatch(entry.name))))


#: Ids of the shipped revisions in order, read from the file names in
#: ``qstore/migrations/versions`` (``qstore_<id>_<slug>.py``; ids are four digits that sort in
#: revision order). The last one is the head, whose declaration :mod:`qstore.schema` and
#: :mod:`qstore.sql` hold.
REVISIONS = _revisions()

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


#: The fields of :class:`QueueStorageConfig` an install records and never changes.
SHAPE_FIELDS = tuple(_X_FIELDS)
#: Where the qstore branch's revision is kept when qstore keeps it itself.
OWN_VERSION_TABLE = "qstore_alembic_version"


def version_location() -> str:
    """Filesystem path of qstore's revision modules (``qstore:migrations/versions`` in a
    host's ``version_locations``)."""
    return str(PACKAGE_MIGRATIONS / "versions")


def _x_schema(x_args: Mapping[str, str]) -> str | None:
    return x_args.get("qstore_schema") or x_args.get("schema")


def _x_shape(x_args: Mapping[str, str]) -> dict[str, Any]:
    """The shape values given with ``-x`` (converted; a bad number names the option)."""
    shape: dict[str, Any] = {}
    for k, conv in _X_FIELDS.items():
        if k in x_args:
            try:
                shape[k] = conv(x_args[k])
            except ValueError:
                raise ValidationError(k, x_args[k], "must be an integer") from None
    return shape


def config_from_x_args(x_args: Mapping[str, str]) -> QueueStorageConfig | None:
    """Build a config from ``alembic -x schema=… -x queue_slot_count=…``; None if absent."""
    schema = _x_schema(x_args)
    shape = _x_shape(x_args)
    if schema is None and not shape:
        return None
    return QueueStorageConfig(schema=schema or DEFAULT_SCHEMA, **shape)


def resolve_shape(schema: str, recorded: QueueStorageConfig | None,
                  explicit: Mapping[str, Any]) -> QueueStorageConfig:
    """The one shape rule of every entry point. ``explicit`` holds only the shape values the
    caller gave (``-x`` options, command-line options, every field of a config passed to
    ``install``). Not installed: the defaults with ``explicit`` over them. Installed: the
    recorded shape, unless an explicit value differs from it, which raises
    :class:`ShapeMismatchError` naming every conflicting field with both values."""
    unknown = set(explicit) - set(SHAPE_FIELDS)
    if unknown:
        name = sorted(unknown)[0]
        raise ValidationError(name, explicit[name], f"not a shape field ({', '.join(SHAPE_FIELDS)})")
    if recorded is None:
        return QueueStorageConfig(schema=schema, **explicit)
    conflicts = {k: (getattr(recorded, k), v) for k, v in explicit.items() if getattr(recorded, k) != v}
    if conflicts:
        raise ShapeMismatchError(schema, conflicts)
    return recorded


def shape_of(config: QueueStorageConfig) -> dict[str, Any]:
    """Every shape field of ``config`` (what ``install`` treats as explicit)."""
    return {k: getattr(config, k) for k in SHAPE_FIELDS}


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
    x_args = context.get_x_argument(as_dictionary=True)
    schema = _x_schema(x_args) or DEFAULT_SCHEMA
    return resolve_shape(schema, read_recorded_config(op.get_bind(), schema), _x_shape(x_args))


def revision_shape(kw: Mapping[str, Any] | None = None) -> QueueStorageConfig:
    """The shape of the install a revision's ``upgrade``/``downgrade`` is running for (see
    :func:`migration_config`), with that install's migration lock held (so a host
    application's Alembic run and :meth:`QueueStorage.prepare_schema` never interleave).
    Revisions read only its plain fields."""
    from alembic import op

    try:
        cfg = migration_config(kw)
    except QueueStorageError as err:  # from a host's `alembic` command: one line, no traceback
        raise CommandError(f"qstore: {err}") from err
    lock_install(op.get_bind(), cfg.schema)
    return cfg


def run_statements(connection: Connection, statements: Sequence[str]) -> None:
    """Execute a revision's frozen statements, each exactly as rendered (no bind-parameter
    parsing: ``%`` and ``:name`` inside function bodies reach the server unchanged)."""
    for statement in statements:
        execute_ddl(connection, statement)


def _children(sch: StorageSchema) -> set[str]:
    return {t.name for t in sch.metadata.tables.values() if "qstore_partition_of" in t.info}


IncludeName = Callable[[str | None, str, Mapping[str, Any]], bool]


def include_name_for(*installs: StorageSchema | QueueStorageConfig | str,
                     host: bool = False) -> IncludeName:
    """An ``include_name`` filter for ``context.configure``.

    ``host=False`` (qstore's own environment): exactly one install; only its schema, never
    its Alembic version table.

    ``host=True`` (a host application's ``env.py``, with ``include_schemas=True``):
    everything except qstore's storage schemas, so the host's ``alembic check`` and
    ``revision --autogenerate`` never see qstore's tables as drift. Excluded: the schemas
    given, ``qstore``, and every schema holding a qstore install on the connection being
    compared (looked up once per run), so installs added later need no edit."""
    schemas = {i.config.schema if isinstance(i, StorageSchema)
               else i.schema if isinstance(i, QueueStorageConfig) else i for i in installs}
    for name in schemas:
        if not isinstance(name, str):
            raise ValidationError("install", name, "expected a StorageSchema, QueueStorageConfig or schema name")
    if host:
        excluded = schemas | {DEFAULT_SCHEMA}
        discovered: dict[int, set[str]] = {}

        def installed_here() -> set[str]:
            from alembic import context

            try:
                bind = context.get_bind()
            except Exception:  # no migration context: only the named schemas are known
                return set()
            key = id(bind)
            if key not in discovered:
                discovered.clear()
                discovered[key] = set(qstore_schemas(bind))
            return discovered[key]

        def include_host_name(name: str | None, type_: str, parent_names: Mapping[str, Any]) -> bool:
            schema = name if type_ == "schema" else parent_names.get("schema_name")
            return schema not in excluded and schema not in installed_here()

        return include_host_name
    if len(schemas) != 1:
        raise ValidationError("installs", sorted(schemas), "qstore's own environment compares exactly one install")
    (schema,) = schemas

    def include_name(name: str | None, type_: str, parent_names: Mapping[str, Any]) -> bool:
        if type_ == "schema":
            return name == schema
        if type_ == "table":
            return name != OWN_VERSION_TABLE and parent_names.get("schema_name") == schema
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


@contextmanager
def _registered_entities(sch: StorageSchema) -> Iterator[None]:
    """While the block runs, alembic_utils compares this install's functions, views and
    trigger (so ``alembic check`` diffs their bodies); afterwards its process-wide registry is as it was,
    so a later autogenerate in the same process (a host application's) never simulates
    another database's functions."""
    try:
        from alembic_utils.pg_function import PGFunction
        from alembic_utils.pg_trigger import PGTrigger
        from alembic_utils.pg_view import PGView
        from alembic_utils.replaceable_entity import register_entities, registry
    except ImportError:  # the runtime does not need alembic_utils; only diffing does
        yield
        return
    saved = (registry.entities(), set(registry.schemas), set(registry.exclude_schemas),
             set(registry.entity_types))
    register_entities(
        [PGFunction(schema=f.schema, signature=f.signature, definition=f.definition)
         for f in sch.functions]
        + [PGView(schema=v.schema, signature=v.name, definition=v.definition) for v in sch.views]
        + [PGTrigger.from_sql(unique_claim_trigger(sch.config))]
    )
    try:
        yield
    finally:
        registry.clear()
        entities, schemas, excluded, types = saved
        registry.register(entities, list(schemas), excluded, types)


def _display_url(url: str) -> str:
    try:
        return make_url(url).render_as_string(hide_password=True)
    except sa_exc.ArgumentError:
        return url


def engine_for_url(url: object, source: str = "url", *, pooled: bool = False) -> Any:
    """An engine for ``url`` (pool-less unless ``pooled``); a string that is not a
    SQLAlchemy URL raises ``ValidationError`` naming it and the expected form."""
    if not isinstance(url, str) or not url.strip():
        raise ValidationError(source, url, "expected a database URL such as "
                              "postgresql+psycopg://user@host:5432/dbname")
    try:
        parsed = make_url(url)
    except sa_exc.ArgumentError:
        raise ValidationError(source, url, "not a database URL; expected e.g. "
                              "postgresql+psycopg://user@host:5432/dbname") from None
    try:
        return create_engine(parsed) if pooled else create_engine(parsed, poolclass=pool.NullPool)
    except (sa_exc.ArgumentError, ImportError) as err:
        raise ValidationError(source, _display_url(url), f"cannot use it: {err}") from None


def connection_failure(url: str, err: BaseException) -> str:
    """One line for a failed connection: where, the server's or driver's first words (no
    SQLAlchemy background link), and what to check."""
    orig = getattr(err, "orig", None) or err
    words = " ".join(str(orig).split())
    words = re.sub(r"\s*\(Background on this error at: [^)]*\)", "", words)
    return (f"cannot connect to {_display_url(url)}: {words}; check that the server is running "
            f"and the URL (host, port, user, database) is right")


def run_env() -> None:
    """Body of ``env.py`` (repository ``alembic/`` and packaged ``qstore/migrations``).

    From the ``alembic`` command line every refusal is one ``FAILED:`` line: no URL, a URL
    that is not one, a server that cannot be reached, a conflicting ``-x`` shape value."""
    from alembic import context

    acfg = context.config
    connection = acfg.attributes.get("connection")
    if connection is not None:
        _run_with_connection(context, connection, owned=False)
        return
    url = (context.get_x_argument(as_dictionary=True).get("url")
           or os.environ.get("QSTORE_DATABASE_URL")
           or acfg.get_main_option("sqlalchemy.url"))
    if not url:
        raise CommandError("qstore: no database URL; pass -x url=postgresql+psycopg://user@host/dbname, "
                           "set QSTORE_DATABASE_URL, or set sqlalchemy.url in alembic.ini")
    try:
        engine = engine_for_url(url, "-x url")
    except QueueStorageError as err:
        raise CommandError(f"qstore: {err}") from None
    try:
        try:
            conn = engine.connect()
        except sa_exc.DBAPIError as err:
            raise CommandError(f"qstore: {connection_failure(url, err)}") from None
        with conn:
            try:
                _run_with_connection(context, conn, owned=True)
            except QueueStorageError as err:
                raise CommandError(f"qstore: {err}") from err
    finally:
        engine.dispose()


def _resolve_env_config(context: Any, connection: Connection) -> QueueStorageConfig:
    cfg = context.config.attributes.get(CONFIG_ATTRIBUTE)
    if isinstance(cfg, QueueStorageConfig):
        return cfg
    x_args = context.get_x_argument(as_dictionary=True)
    schema = _x_schema(x_args) or DEFAULT_SCHEMA
    return resolve_shape(schema, read_recorded_config(connection, schema), _x_shape(x_args))


def _run_with_connection(context: Any, connection: Connection, *, owned: bool) -> None:
    cfg = _resolve_env_config(context, connection)
    if owned:
        state = install_state(connection, cfg.schema)
        if state.version is not None and state.version.host:
            raise ValidationError(
                "schema", cfg.schema,
                f"{state.describe()}; upgrade it with your application's `alembic upgrade heads`")
        connection.commit()  # end the reads above: the migration runs in a transaction of its own
    context.config.attributes[CONFIG_ATTRIBUTE] = cfg
    sch = storage_schema(cfg)
    with _registered_entities(sch):
        _configure_and_run(context, connection, cfg, sch)


def _configure_and_run(context: Any, connection: Connection, cfg: QueueStorageConfig,
                       sch: StorageSchema) -> None:
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


# -- where an install's revision is recorded ----------------------------------------------


@dataclass(frozen=True)
class VersionRecord:
    """The revision an install is at and the version table that records it. ``host`` is
    True when that table is a host application's (the ``qstore`` branch's row among the
    host's own), False for the install's own ``<schema>.qstore_alembic_version``."""

    revision: str
    table: str
    host: bool

    def describe(self) -> str:
        whose = "a host application's Alembic version table" if self.host else "its own version table"
        return f"at revision {self.revision} (recorded in {self.table}, {whose})"


@dataclass(frozen=True)
class InstallState:
    """What the database holds for one storage schema: its recorded shape (``config``, None
    when not installed) and where its revision is recorded (``version``, None when no
    version table records it)."""

    schema: str
    config: QueueStorageConfig | None
    version: VersionRecord | None

    @property
    def installed(self) -> bool:
        return self.config is not None

    @property
    def at_head(self) -> bool:
        return self.version is not None and self.version.revision == REVISIONS[-1]

    def describe(self) -> str:
        """One phrase for messages: what was found for this schema."""
        if self.config is None:
            return f"schema {self.schema!r} holds no qstore install"
        shape = ", ".join(f"{k}={getattr(self.config, k)!r}" for k in SHAPE_FIELDS)
        where = (self.version.describe() if self.version is not None
                 else "with no version row (made by metadata.create_all, not by Alembic)")
        return f"schema {self.schema!r} is installed {where}, shape {shape}"


def _qualified(schema: str, table: str) -> str:
    return f"{schema}.{table}"


def qstore_schemas(connection: Connection) -> list[str]:
    """Every schema of the database holding a qstore install (a ``storage_config`` table
    next to ``runtime_storage_backends``), sorted."""
    return sorted(connection.execute(text(
        "SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE c.relname = 'storage_config' AND c.relkind IN ('r', 'p') "
        "AND EXISTS (SELECT 1 FROM pg_class b WHERE b.relnamespace = n.oid "
        "            AND b.relname = 'runtime_storage_backends')")).scalars())


def host_version_records(connection: Connection) -> list[VersionRecord]:
    """The ``qstore`` branch's rows in Alembic version tables other than qstore's own: any
    table with a ``version_num`` column (how Alembic keeps versions) holding one of qstore's
    revision ids, outside the system schemas."""
    tables = connection.execute(text(
        "SELECT n.nspname, c.relname FROM pg_attribute a "
        "JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE a.attname = 'version_num' AND c.relkind = 'r' AND NOT a.attisdropped "
        "AND c.relname <> :own AND n.nspname NOT IN ('pg_catalog', 'information_schema') "
        "AND n.nspname NOT LIKE 'pg\\_%' AND has_table_privilege(c.oid, 'SELECT') "
        "ORDER BY 1, 2"), {"own": OWN_VERSION_TABLE}).all()
    prep = connection.dialect.identifier_preparer
    found = []
    for schema, name in tables:
        rows = connection.execute(text(
            f"SELECT version_num FROM {prep.quote_schema(schema)}.{prep.quote(name)}")).scalars()
        found += [VersionRecord(str(r), _qualified(schema, name), True) for r in rows if r in REVISIONS]
    return found


def install_state(connection: Connection, schema: str) -> InstallState:
    """Where ``schema``'s install stands. Its own version table wins; otherwise a host
    application's version table that records the ``qstore`` branch is taken to record this
    schema when it is the one qstore install of the database without a version table of its
    own (a host version table carries one storage schema)."""
    config = read_recorded_config(connection, schema)
    if config is None:
        return InstallState(schema, None, None)
    own = current_revision(connection, config)
    if own is not None:
        return InstallState(schema, config, VersionRecord(own, _qualified(schema, OWN_VERSION_TABLE), False))
    hosts = host_version_records(connection)
    if len(hosts) == 1:
        unversioned = [s for s in qstore_schemas(connection)
                       if s == schema or not inspect(connection).has_table(OWN_VERSION_TABLE, schema=s)]
        if unversioned == [schema]:
            return InstallState(schema, config, hosts[0])
    return InstallState(schema, config, None)


def found_installs(connection: Connection, limit: int = 10) -> list[str]:
    """The qstore installs of the database, each described for an error message (the first
    ``limit`` by name, then how many more there are)."""
    names = qstore_schemas(connection)
    out = []
    for name in names[:limit]:
        state = install_state(connection, name)
        rev = state.version.revision if state.version else "no version row"
        where = ", host Alembic" if state.version and state.version.host else ""
        out.append(f"{name!r} ({rev}{where})")
    if len(names) > limit:
        out.append(f"and {len(names) - limit} more")
    return out


# -- a host application's Alembic environment -----------------------------------------------


def _is_qstore_revision(rev: Any) -> bool:
    labels = getattr(rev, "branch_labels", ()) or ()
    path = getattr(rev, "path", None)
    return BRANCH_LABEL in labels or (
        path is not None and Path(path).resolve().parent == Path(version_location()).resolve())


def _host_locations(script: Any) -> list[Path]:
    from alembic.util import coerce_resource_to_filename

    ours = Path(version_location()).resolve()
    locations = [coerce_resource_to_filename(str(p)).resolve() for p in script.version_locations or ()]
    if not locations:
        locations = [Path(script.versions).resolve()]
    return [p for p in locations if p != ours]


def host_revision_directives(context: Any, revision: Any, directives: list[Any]) -> None:
    """``process_revision_directives`` for a host application's ``env.py``: a new revision
    (``alembic revision [--autogenerate] -m …``) never goes into qstore's package and never
    continues qstore's branch.

    Without ``--head`` it continues the host's own head (a new root when the host has no
    revision yet; Alembic's own "multiple heads" error when the host has several) and is
    written to the host's version location (the one in ``version_locations`` that is not
    qstore's). An explicit ``--head`` on qstore's branch, or ``--version-path`` into
    qstore's package, is refused with a ``CommandError``."""
    from alembic.operations.ops import MigrationScript

    script = context.script
    ours = Path(version_location()).resolve()
    for directive in directives:
        if not isinstance(directive, MigrationScript):
            continue
        if directive.head in (None, "head"):
            heads = [h for h in script.get_revisions("heads") if not _is_qstore_revision(h)]
            if len(heads) == 1:
                directive.head = heads[0].revision
            elif not heads:
                directive.head = "base"
        elif any(_is_qstore_revision(r) for r in script.get_revisions(directive.head) if r is not None):
            raise CommandError(
                f"qstore: --head {directive.head} is on qstore's branch; qstore's revisions ship "
                f"inside the qstore package, so a revision of yours continues your own branch: "
                f"leave --head out (or name one of your own revisions)")
        if directive.version_path is None:
            mine = _host_locations(script)
            if len(mine) == 1:
                directive.version_path = str(mine[0])
            elif not mine:
                raise CommandError(
                    "qstore: version_locations names no directory of your own; add your "
                    "migrations/versions directory next to qstore:migrations/versions")
        elif Path(directive.version_path).resolve() == ours:
            raise CommandError("qstore: --version-path points into the qstore package; new "
                               "revisions go into your own versions directory")


_BARE_RELATIVE = re.compile(r"^-\d+$")


def _owner_of_host_branch(connection: Connection, schemas: list[str]) -> str | None:
    unversioned = [s for s in schemas if not inspect(connection).has_table(OWN_VERSION_TABLE, schema=s)]
    return unversioned[0] if len(unversioned) == 1 else None


def guard_host_migrations(connection: Connection) -> None:
    """For a host application's ``env.py``: call inside ``context.begin_transaction()``,
    before ``context.run_migrations()``.

    Serialises concurrent runs like :func:`serialise_migrations`, then refuses, before
    anything runs and with one ``CommandError`` line saying what it found and what to run
    instead:

    * a second storage schema (``-x schema=jobs``) when the host's version table already
      records qstore's branch for another schema: one host history carries one storage
      schema; install further schemas with ``qstore install --schema …`` (or
      ``QueueStorage.install``), which keep their revision in their own version table;
    * a schema that is already installed with its own version table;
    * ``-x`` shape values that conflict with the shape the install recorded;
    * a bare relative downgrade (``alembic downgrade -1``) while qstore's branch is one of
      several heads: it could step qstore's branch down instead of the host's.
    """
    from alembic import context

    serialise_migrations(connection)
    x_args = context.get_x_argument(as_dictionary=True)
    explicit_schema = _x_schema(x_args)
    schema = explicit_schema or DEFAULT_SCHEMA
    try:
        shape = _x_shape(x_args)
        heads = context.get_context().get_current_heads()
        ours = [h for h in heads if h in REVISIONS]
        installs = qstore_schemas(connection)
        if ours:
            owner = _owner_of_host_branch(connection, installs)
            if owner is not None and owner != schema:
                raise ValidationError(
                    "schema", schema,
                    f"this application's version table already records qstore's branch (revision "
                    f"{ours[0]}) for schema {owner!r}, and one Alembic history carries one storage "
                    f"schema; install {schema!r} on its own with `qstore install --url … --schema "
                    f"{schema}` (or QueueStorage(QueueStorageConfig(schema={schema!r})).install(engine)),"
                    f" which keeps its revision in {schema}.{OWN_VERSION_TABLE}")
        if schema in installs:
            state = install_state(connection, schema)
            if state.version is not None and not state.version.host:
                raise ValidationError(
                    "schema", schema,
                    f"{state.describe()}; it is upgraded by `qstore install --schema {schema}` (or "
                    f"QueueStorage.install), not by this application's Alembic")
            resolve_shape(schema, state.config, shape)
        argument = context.get_context().opts.get("destination_rev")  # None outside up/downgrade
        if (ours and len(heads) > 1 and isinstance(argument, str)
                and _BARE_RELATIVE.match(argument)):
            mine = [h for h in heads if h not in REVISIONS]
            raise ValidationError(
                "revision", argument,
                f"with several heads a bare relative downgrade may step qstore's branch down; "
                f"say which head: `alembic downgrade {mine[0]}@{argument}` for your own revisions, "
                f"`alembic downgrade {BRANCH_LABEL}@{argument}` for qstore's")
    except QueueStorageError as err:
        raise CommandError(f"qstore: {err}") from err
