"""Least privilege: the grants a runtime role needs on one install, and nothing more.

Two roles run a deployed install:

* the **migration role** owns the storage schema and everything in it, and runs Alembic
  (``alembic upgrade heads``, ``qstore install``). Only it creates, alters or drops objects.
* the **runtime role** enqueues, claims, completes and maintains. It gets
  :func:`runtime_grants`: ``USAGE`` on the schema; ``SELECT, INSERT, UPDATE, DELETE`` on the
  tables; ``TRUNCATE`` only on the tables upkeep reclaims by ``TRUNCATE`` (every ring slot
  child and its partitioned parent, and the terminal live counts a counter rebuild
  empties); ``USAGE, SELECT, UPDATE`` on the sequences (lane cursors are ``nextval``, ring
  rotation is ``setval``); ``EXECUTE`` on the functions; read-only access to the recorded
  shape (``storage_config``) and to the install's own version table. It owns nothing and
  has no ``CREATE`` on the schema, so every ``CREATE``, ``ALTER`` and ``DROP`` is refused.

Why ``TRUNCATE`` and not ownership: PostgreSQL lets a role truncate a table it does not own
when it holds the ``TRUNCATE`` privilege on it (for a partitioned table, on the parent and
each partition), and ``LOCK TABLE … IN ACCESS EXCLUSIVE MODE``, which prune takes first,
needs ``UPDATE``, ``DELETE`` or ``TRUNCATE``. Ownership would also allow ``ALTER`` and
``DROP``. ``VACUUM`` (only :meth:`QueueStorage.vacuum_leases`, a manual fallback that the
maintainer never runs) is the one call that needs the owner: as the runtime role PostgreSQL
skips the table with a warning.

``ALTER DEFAULT PRIVILEGES`` in the list gives the runtime role the same data privileges on
tables, sequences and functions the migration role creates later; a later revision that adds
ring tables needs the grants applied again (``qstore install --grant ROLE`` after each
upgrade does both in one transaction). Applying them twice changes nothing.
"""

from __future__ import annotations

from sqlalchemy import Connection, text

from qstore.config import QueueStorageConfig
from qstore.errors import ValidationError
from qstore.schema import storage_schema
from qstore.schema.functions import execute_ddl

__all__ = ["apply_runtime_grants", "quote_ident", "runtime_grants", "truncated_tables"]

_MAX_ROLE_BYTES = 63


def quote_ident(name: str) -> str:
    """``name`` as a quoted PostgreSQL identifier."""
    return '"' + name.replace('"', '""') + '"'


def _check_role(role: object) -> str:
    if (not isinstance(role, str) or not role or "\x00" in role
            or len(role.encode()) > _MAX_ROLE_BYTES):
        raise ValidationError("role", role, f"must be a role name of 1 to {_MAX_ROLE_BYTES} bytes")
    return role


def truncated_tables(config: QueueStorageConfig) -> list[str]:
    """Every table upkeep truncates (ring slot children, their partitioned parents and the
    terminal live counts), by name, sorted."""
    sch = storage_schema(config)
    names = {sch.live_counts.name}
    for t in sch.metadata.tables.values():
        parent = t.info.get("qstore_partition_of")
        if parent is not None:
            names.add(t.name)
            names.add(getattr(parent, "name", str(parent)))
    return sorted(names)


def runtime_grants(config: QueueStorageConfig, role: str, *, version_table: bool = True) -> list[str]:
    """The statements that give ``role`` what the runtime needs on ``config``'s install
    (run them as the migration role, which owns the schema). ``version_table``: whether the
    install keeps its own version table (False for an install carried by a host's Alembic,
    whose version table is the host's business)."""
    r = quote_ident(_check_role(role))
    s = quote_ident(config.schema)
    sch = storage_schema(config)
    truncated = set(truncated_tables(config))
    not_truncated = sorted(t.name for t in sch.metadata.tables.values() if t.name not in truncated)
    read_only = [sch.storage_config.name] + ([config.version_table] if version_table else [])
    no_truncate = [n for n in not_truncated if n not in read_only]

    def tables(names: list[str]) -> str:
        return ", ".join(f"{s}.{quote_ident(n)}" for n in names)

    return [
        f"GRANT USAGE ON SCHEMA {s} TO {r}",
        f"GRANT SELECT, INSERT, UPDATE, DELETE, TRUNCATE ON ALL TABLES IN SCHEMA {s} TO {r}",
        f"REVOKE TRUNCATE ON {tables(no_truncate)} FROM {r}",
        f"REVOKE INSERT, UPDATE, DELETE, TRUNCATE ON {tables(read_only)} FROM {r}",
        f"GRANT USAGE, SELECT, UPDATE ON ALL SEQUENCES IN SCHEMA {s} TO {r}",
        f"GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA {s} TO {r}",
        f"ALTER DEFAULT PRIVILEGES IN SCHEMA {s} GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO {r}",
        f"ALTER DEFAULT PRIVILEGES IN SCHEMA {s} GRANT USAGE, SELECT, UPDATE ON SEQUENCES TO {r}",
        f"ALTER DEFAULT PRIVILEGES IN SCHEMA {s} GRANT EXECUTE ON FUNCTIONS TO {r}",
    ]


def apply_runtime_grants(conn: Connection, config: QueueStorageConfig, role: str) -> list[str]:
    """Run :func:`runtime_grants` on ``conn``'s transaction; returns the statements run.
    Raises ``ValidationError`` when ``role`` does not exist."""
    _check_role(role)
    if conn.execute(text("SELECT 1 FROM pg_roles WHERE rolname = :r"), {"r": role}).first() is None:
        raise ValidationError("role", role, f"no such role; create it first (CREATE ROLE {quote_ident(role)} LOGIN)")
    own = conn.execute(text("SELECT to_regclass(:t) IS NOT NULL"),
                       {"t": f"{quote_ident(config.schema)}.{quote_ident(config.version_table)}"}).scalar()
    statements = runtime_grants(config, role, version_table=bool(own))
    for statement in statements:
        execute_ddl(conn, statement)  # sent as written: no bind-parameter parsing of names
    return statements
