"""A "classic" PostgreSQL job queue, kept in the repo as the benchmark's point of comparison.

One ``jobs`` table, one partial index that serves the claim, and the usual three statements:

* enqueue — ``COPY … FROM STDIN`` (psycopg 3) or one ``INSERT … SELECT FROM unnest(…)`` per
  batch (a single multi-row insert, one round trip, four array parameters);
* claim — one statement: a CTE picks up to ``n`` available rows ``FOR UPDATE SKIP LOCKED`` and
  the outer ``UPDATE`` marks them ``running`` (attempt + 1, ``locked_at``) and returns them;
* complete — ``DELETE … WHERE id = ANY(:ids)``.

Every claim and every completion leaves one dead heap tuple per job (the ``UPDATE`` is never
HOT: it changes a column of the partial index predicate), which is what the comparison is
about. Functions take a SQLAlchemy ``Connection`` and never commit: the caller owns the
transaction.

For LISTEN-based workers, ``create(conn, notify_channel=...)`` also installs a statement-level
``AFTER INSERT`` trigger that sends one ``NOTIFY`` per enqueue statement (delivered at commit),
so an enqueue stays one statement.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    DateTime,
    Index,
    Integer,
    MetaData,
    SmallInteger,
    Table,
    Text,
    any_,
    bindparam,
    cast,
    delete,
    func,
    insert,
    select,
    text,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.schema import CreateSchema, DropSchema

__all__ = ["ClassicJob", "ClassicQueue"]

DEFAULT_SCHEMA = "bench_classic"
_CHANNEL = re.compile(r"[A-Za-z0-9_:.]{1,63}")


@dataclass(frozen=True)
class ClassicJob:
    """One claimed job."""

    id: int
    kind: str
    queue: str
    priority: int
    args: Any
    attempt: int


class ClassicQueue:
    """The classic queue living in its own schema (default ``bench_classic``)."""

    def __init__(self, schema: str = DEFAULT_SCHEMA) -> None:
        self.schema = schema
        self.metadata = MetaData(schema=schema)
        now = func.clock_timestamp()
        self.jobs = Table(
            "jobs",
            self.metadata,
            Column("id", BigInteger, primary_key=True, autoincrement=True),
            Column("queue", Text, nullable=False),
            Column("kind", Text, nullable=False),
            Column("priority", SmallInteger, nullable=False, server_default=text("2")),
            Column("args", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
            Column("state", Text, nullable=False, server_default=text("'available'")),
            Column("attempt", Integer, nullable=False, server_default=text("0")),
            Column("max_attempts", Integer, nullable=False, server_default=text("25")),
            Column("run_at", DateTime(timezone=True), nullable=False, server_default=now),
            Column("created_at", DateTime(timezone=True), nullable=False, server_default=now),
            Column("locked_at", DateTime(timezone=True)),
        )
        Index(
            "jobs_claim_idx",
            self.jobs.c.queue,
            self.jobs.c.priority,
            self.jobs.c.run_at,
            self.jobs.c.id,
            postgresql_where=self.jobs.c.state == "available",
        )
        self._claim = self._build_claim()
        self._insert = self._build_insert()

    # -- install ----------------------------------------------------------------------
    def create(self, conn: Connection, notify_channel: str | None = None) -> None:
        """Create the schema and the table; with ``notify_channel``, every INSERT or COPY
        statement into ``jobs`` also sends one NOTIFY on that channel (at commit)."""
        conn.execute(CreateSchema(self.schema, if_not_exists=True))
        self.metadata.create_all(conn)
        if notify_channel is not None:
            self._create_notify_trigger(conn, notify_channel)

    def _create_notify_trigger(self, conn: Connection, channel: str) -> None:
        if not _CHANNEL.fullmatch(channel):
            raise ValueError(f"notify channel {channel!r} must match {_CHANNEL.pattern}")
        prep = conn.dialect.identifier_preparer
        fn = f"{prep.quote_schema(self.schema)}.jobs_notify"
        conn.exec_driver_sql(
            f"CREATE FUNCTION {fn}() RETURNS trigger LANGUAGE plpgsql AS $$ "
            f"BEGIN PERFORM pg_notify('{channel}', ''); RETURN NULL; END $$"
        )
        conn.exec_driver_sql(
            f"CREATE TRIGGER jobs_notify AFTER INSERT ON {prep.format_table(self.jobs)} "
            f"FOR EACH STATEMENT EXECUTE FUNCTION {fn}()"
        )

    def drop(self, conn: Connection) -> None:
        conn.execute(DropSchema(self.schema, cascade=True, if_exists=True))

    # -- statements -------------------------------------------------------------------
    def _build_claim(self):  # type: ignore[no-untyped-def]
        j = self.jobs
        picked = (
            select(j.c.id)
            .where(
                j.c.state == "available",
                j.c.queue == bindparam("claim_queue"),
                j.c.run_at <= func.now(),
            )
            .order_by(j.c.priority, j.c.run_at, j.c.id)
            .limit(bindparam("claim_limit"))
            .with_for_update(skip_locked=True)
            .cte("picked")
        )
        return (
            update(j)
            .where(j.c.id == picked.c.id)
            .values(state="running", attempt=j.c.attempt + 1, locked_at=func.now())
            .returning(j.c.id, j.c.kind, j.c.queue, j.c.priority, j.c.args, j.c.attempt)
        )

    def _build_insert(self):  # type: ignore[no-untyped-def]
        rows = func.unnest(
            bindparam("queues", type_=ARRAY(Text)),
            bindparam("kinds", type_=ARRAY(Text)),
            bindparam("priorities", type_=ARRAY(SmallInteger)),
            cast(bindparam("args", type_=ARRAY(Text)), ARRAY(JSONB)),
        ).table_valued("queue", "kind", "priority", "args").render_derived()
        return insert(self.jobs).from_select(
            ["queue", "kind", "priority", "args"],
            select(rows.c.queue, rows.c.kind, rows.c.priority, rows.c.args),
        )

    # -- enqueue ----------------------------------------------------------------------
    def enqueue_insert(self, conn: Connection, jobs: Sequence[tuple[str, str, int, Any]]) -> int:
        """Insert ``(queue, kind, priority, args)`` tuples in one multi-row INSERT."""
        if not jobs:
            return 0
        res = conn.execute(
            self._insert.execution_options(preserve_rowcount=True),
            {
                "queues": [q for q, _, _, _ in jobs],
                "kinds": [k for _, k, _, _ in jobs],
                "priorities": [p for _, _, p, _ in jobs],
                "args": [json.dumps(a, separators=(",", ":")) for _, _, _, a in jobs],
            },
        )
        return res.rowcount

    def enqueue_copy(self, conn: Connection, jobs: Iterable[tuple[str, str, int, Any]]) -> int:
        """``COPY … FROM STDIN`` on the caller's connection (psycopg 3 driver required)."""
        raw = conn.connection.driver_connection
        assert raw is not None, "COPY needs a live DBAPI connection"
        prep = conn.dialect.identifier_preparer
        target = f"{prep.format_table(self.jobs)} (queue, kind, priority, args)"
        n = 0
        with raw.cursor() as cur, cur.copy(f"COPY {target} FROM STDIN") as cp:
            for q, k, p, a in jobs:
                cp.write_row((q, k, p, json.dumps(a, separators=(",", ":"))))
                n += 1
        return n

    # -- claim / complete -------------------------------------------------------------
    def claim(self, conn: Connection, queue: str, n: int) -> list[ClassicJob]:
        rows = conn.execute(self._claim, {"claim_queue": queue, "claim_limit": n}).all()
        return [ClassicJob(*row) for row in rows]

    def complete(self, conn: Connection, ids: Sequence[int]) -> int:
        if not ids:
            return 0
        j = self.jobs
        stmt = delete(j).where(j.c.id == any_(bindparam("ids", type_=ARRAY(BigInteger))))
        return conn.execute(stmt, {"ids": list(ids)}).rowcount

    def count(self, conn: Connection, queue: str | None = None) -> int:
        stmt = select(func.count()).select_from(self.jobs)
        if queue is not None:
            stmt = stmt.where(self.jobs.c.queue == queue)
        return int(conn.execute(stmt).scalar_one())
