"""A pool of installed storage schemas, reused across tests and reset between them.

Installing a schema (``metadata.create_all`` of ~130 tables, ~270 indexes, the functions and
the seed rows) costs 0.3-1.3 s; putting a used install back into its freshly installed state
costs a few tens of milliseconds. :class:`InstallPool` keeps installs by shape (every
:class:`QueueStorageConfig` field but the schema name) and resets each one between two
tests, so a test sees exactly what a fresh install would show it. Resets run on a
background thread (:class:`Worker`) as soon as a test hands its install back, and two
installs of a shape take turns, so the next test rarely waits for one.

What "exactly" means is spelled out by :func:`catalog_structure` (every relation, column,
constraint, index, function, view, trigger, rule, policy, type and sequence definition of
the schema) and :func:`catalog_contents` (every table's rows, every sequence's position and
the planner-visible size statistics). ``tests/test_install_pool.py`` checks that a used and
reset install matches a brand-new one on both.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import date, datetime
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine, text

from qstore import QueueStorageConfig
from qstore.migrate import REVISIONS
from qstore.schema import seed_rows, storage_schema
from qstore.storage import lifecycle

__all__ = [
    "BLOAT_PAGES",
    "InstallPool",
    "Pristine",
    "Worker",
    "catalog_contents",
    "catalog_digest",
    "catalog_fingerprint",
    "catalog_structure",
    "install",
    "record_pristine",
    "reset_install",
    "shape_of",
    "stamp_head",
    "unique_schema",
]

#: A table whose heap has grown to this many pages is truncated by a reset instead of emptied
#: with DELETE: it keeps dead tuples from piling up across tests, and keeps the planner in the
#: regime of a fresh install (a never-vacuumed table of fewer than 10 pages is costed as 10).
BLOAT_PAGES = 10

#: A test that finds no reset install of its shape gets a new one while fewer than this many
#: are being reset, else waits: two installs of a shape take turns, one reset while the
#: other is used.
RESETTING_BEFORE_WAITING = 2

#: How long a released install waits for other sessions' locks on it to go away (a test that
#: leaked a connection holding locks fails its teardown instead of hanging a later test).
LEAKED_LOCK_WAIT_S = 60.0

Shape = tuple[tuple[str, Any], ...]
T = TypeVar("T")


def unique_schema() -> str:
    return f"t_{uuid.uuid4().hex[:8]}"


def shape_of(config: QueueStorageConfig) -> Shape:
    """Every field of ``config`` except the schema name."""
    return tuple((f.name, getattr(config, f.name)) for f in dataclasses.fields(config)
                 if f.name != "schema")


# -- what a schema is made of -------------------------------------------------------------

# Each query lists one kind of object of the schema whose oid is :ns. Names and definitions
# only: oids, relfilenodes and creation order differ between two equal installs. Where
# {derived_too} is false, the columns of partitions and indexes and the definitions of
# partitions' indexes are left out: PostgreSQL derives them from their parent's (a partition
# cannot have columns of its own; a partition's index cannot be dropped or altered apart from
# its parent's), and an extra index on a partition still shows among the relations.
_STRUCTURE: dict[str, str] = {
    "relations": """
        SELECT c.relname, c.relkind, c.relpersistence, c.relispartition,
               coalesce(pg_get_expr(c.relpartbound, c.oid), ''), coalesce(c.reloptions::text, ''),
               c.relrowsecurity, c.relreplident, coalesce(c.relacl::text, ''),
               c.relowner::regrole::text
          FROM pg_class c WHERE c.relnamespace = :ns""",
    "columns": """
        SELECT c.relname, a.attnum, a.attname, format_type(a.atttypid, a.atttypmod),
               a.attnotnull, a.attisdropped, coalesce(pg_get_expr(d.adbin, d.adrelid), ''),
               a.attidentity, a.attgenerated, a.attstattarget, a.attstorage
          FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
          LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
         WHERE c.relnamespace = :ns AND a.attnum > 0 AND {derived_too}""",
    "constraints": """
        SELECT coalesce(c.relname, ''), k.conname, k.contype, pg_get_constraintdef(k.oid),
               k.convalidated
          FROM pg_constraint k LEFT JOIN pg_class c ON c.oid = k.conrelid
         WHERE k.connamespace = :ns""",
    "indexes": """
        SELECT i.relname, pg_get_indexdef(x.indexrelid), x.indisvalid, x.indisready,
               x.indisclustered
          FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid JOIN pg_class c ON c.oid = x.indrelid
         WHERE i.relnamespace = :ns AND {derived_too}""",
    "functions": """
        SELECT p.proname, p.prokind, pg_get_function_identity_arguments(p.oid),
               CASE WHEN p.prokind IN ('f', 'p') THEN pg_get_functiondef(p.oid) ELSE '' END,
               coalesce(p.proacl::text, '')
          FROM pg_proc p WHERE p.pronamespace = :ns""",
    "views": """
        SELECT c.relname, pg_get_viewdef(c.oid)
          FROM pg_class c WHERE c.relnamespace = :ns AND c.relkind IN ('v', 'm')""",
    "triggers": """
        SELECT c.relname, t.tgname, pg_get_triggerdef(t.oid), t.tgenabled
          FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
         WHERE c.relnamespace = :ns AND NOT t.tgisinternal""",
    "rules": """
        SELECT c.relname, r.rulename, pg_get_ruledef(r.oid)
          FROM pg_rewrite r JOIN pg_class c ON c.oid = r.ev_class
         WHERE c.relnamespace = :ns AND r.rulename <> '_RETURN'""",
    "policies": """
        SELECT c.relname, p.polname, p.polcmd, coalesce(pg_get_expr(p.polqual, p.polrelid), '')
          FROM pg_policy p JOIN pg_class c ON c.oid = p.polrelid WHERE c.relnamespace = :ns""",
    "types": """
        SELECT t.typname, t.typtype,
               coalesce((SELECT string_agg(e.enumlabel, ',' ORDER BY e.enumsortorder)
                           FROM pg_enum e WHERE e.enumtypid = t.oid), '')
          FROM pg_type t WHERE t.typnamespace = :ns""",
    "sequences": """
        SELECT c.relname, format_type(s.seqtypid, NULL), s.seqstart, s.seqincrement, s.seqmax,
               s.seqmin, s.seqcache, s.seqcycle
          FROM pg_sequence s JOIN pg_class c ON c.oid = s.seqrelid WHERE c.relnamespace = :ns""",
    "extended statistics": """
        SELECT s.stxname, pg_get_statisticsobjdef(s.oid)
          FROM pg_statistic_ext s WHERE s.stxnamespace = :ns""",
    "column statistics": """
        SELECT c.relname, s.staattnum, s.stainherit
          FROM pg_statistic s JOIN pg_class c ON c.oid = s.starelid WHERE c.relnamespace = :ns""",
    "schema": """
        SELECT n.nspowner::regrole::text, coalesce(n.nspacl::text, '')
          FROM pg_namespace n WHERE n.oid = :ns""",
}

_SCHEMA_OID = "SELECT oid FROM pg_namespace WHERE nspname = :s"
_PAGES = "CASE WHEN c.relkind IN ('r', 'i') THEN pg_relation_size(c.oid) / 8192 ELSE 0 END"


def _schema_oid(conn: Connection, schema: str) -> int | None:
    return conn.execute(text(_SCHEMA_OID), {"s": schema}).scalar()


def _normalise(value: Any, schema: str) -> Any:
    """Definitions name their own schema: put a placeholder there so installs compare."""
    if isinstance(value, str):
        return value.replace(f'"{schema}"', "<schema>").replace(schema, "<schema>")
    return value


def catalog_structure(conn: Connection, schema: str) -> dict[str, list[tuple[Any, ...]]]:
    """Every object ``schema`` holds, by kind, as sorted rows of names and definitions with
    the schema's own name replaced by ``<schema>``. Empty when the schema does not exist."""
    ns = _schema_oid(conn, schema)
    if ns is None:
        return {}
    return {
        kind: sorted(tuple(_normalise(v, schema) for v in row)
                     for row in conn.execute(text(sql.format(derived_too="true")), {"ns": ns}))
        for kind, sql in _STRUCTURE.items()
    }


_DIGEST = " UNION ALL ".join(
    f"SELECT '{kind}', count(*), coalesce(sum(hashtext(r::text)::bigint), 0) FROM ("
    + sql.format(derived_too="NOT c.relispartition AND c.relkind NOT IN ('i', 'I')")
    + ") r"
    for kind, sql in _STRUCTURE.items()
)


def catalog_digest(conn: Connection, schema: str) -> tuple[tuple[str, int, int], ...] | None:
    """A digest of :func:`catalog_structure` without what PostgreSQL derives from a parent
    (computed by the server, names not normalised: compare digests of one schema only).
    None when the schema does not exist."""
    ns = _schema_oid(conn, schema)
    if ns is None:
        return None
    return tuple(sorted(tuple(r) for r in conn.execute(text(_DIGEST), {"ns": ns})))


#: Every catalog row that makes up a definition :data:`_STRUCTURE` lists, by the catalog's
#: link to the schema. A change of a definition inserts, deletes or replaces such a row, and a
#: row a transaction writes carries that transaction's id (``xmin``) from then on. The
#: schema's relation and type oids are gathered once (:data:`_FINGERPRINT_OIDS`) and every
#: catalog keyed by a relation or a type is read by ``= ANY`` of them: one scan per catalog,
#: whatever the planner believes of catalogs that autovacuum never analyzed. (A join to
#: ``pg_class`` per catalog let it pick a nested loop over sequential scans of
#: ``pg_statistic``, ``pg_sequence`` and ``pg_enum``: 25-30 ms a call in a session database
#: of a few dozen installs, a third of the server's time in the fast tier.)
_FINGERPRINT_OIDS = """
    WITH rel AS MATERIALIZED (SELECT oid, xmin FROM pg_class WHERE relnamespace = :ns),
         rels AS MATERIALIZED (SELECT array_agg(oid) AS oids FROM rel),
         typ AS MATERIALIZED (SELECT oid, xmin FROM pg_type WHERE typnamespace = :ns),
         types AS MATERIALIZED (SELECT array_agg(oid) AS oids FROM typ)"""
_IN_RELS = "ANY((SELECT oids FROM rels)::oid[])"
_FINGERPRINT_ROWS = f"""
    SELECT xmin FROM rel
    UNION ALL SELECT xmin FROM pg_attribute WHERE attrelid = {_IN_RELS}
    UNION ALL SELECT xmin FROM pg_attrdef WHERE adrelid = {_IN_RELS}
    UNION ALL SELECT xmin FROM pg_constraint WHERE connamespace = :ns
    UNION ALL SELECT xmin FROM pg_index WHERE indexrelid = {_IN_RELS}
    UNION ALL SELECT xmin FROM pg_proc WHERE pronamespace = :ns
    UNION ALL SELECT xmin FROM pg_rewrite WHERE ev_class = {_IN_RELS}
    UNION ALL SELECT xmin FROM pg_trigger WHERE tgrelid = {_IN_RELS}
    UNION ALL SELECT xmin FROM pg_policy WHERE polrelid = {_IN_RELS}
    UNION ALL SELECT xmin FROM typ
    UNION ALL SELECT xmin FROM pg_enum WHERE enumtypid = ANY((SELECT oids FROM types)::oid[])
    UNION ALL SELECT xmin FROM pg_sequence WHERE seqrelid = {_IN_RELS}
    UNION ALL SELECT xmin FROM pg_statistic_ext WHERE stxnamespace = :ns
    UNION ALL SELECT xmin FROM pg_statistic WHERE starelid = {_IN_RELS}
    UNION ALL SELECT xmin FROM pg_namespace WHERE oid = :ns"""
_FINGERPRINT = (f"{_FINGERPRINT_OIDS} SELECT count(*), coalesce(sum(xmin::text::bigint), 0) "
                f"FROM ({_FINGERPRINT_ROWS}) f")

Fingerprint = tuple[int, int]


def catalog_fingerprint(conn: Connection, schema: str) -> Fingerprint | None:
    """The number of catalog rows of ``schema``'s definitions and the sum of the ids of the
    transactions that wrote them: it changes whenever such a row is written (also by the
    schema's own upkeep: TRUNCATE, a size-statistics update), so an unchanged fingerprint
    means an unchanged :func:`catalog_digest`, read at a fraction of its cost. None when the
    schema does not exist."""
    ns = _schema_oid(conn, schema)
    if ns is None:
        return None
    count, xids = conn.execute(text(_FINGERPRINT), {"ns": ns}).one()
    return int(count), int(xids)


def catalog_contents(conn: Connection, schema: str) -> dict[str, Any]:
    """What the rows of ``schema`` amount to: every table's rows (timestamps reduced to their
    type, the schema name to ``<schema>``), every sequence's position, and the sizes the
    planner reads: each table's and index's pages, tuples and all-visible pages as last
    counted (``pg_class``), and its pages on disk: exactly for a ring slot's table (a
    partition: maintenance reads their sizes to tell a never-written slot), counted as
    :data:`BLOAT_PAGES` below that for every other table and index.

    The planner costs a never-vacuumed table of fewer than 10 pages as 10 pages, so the pages
    that DELETE leaves in a small table are invisible to it. An index keeps the leaf pages
    its entries used (a one-row btree has two pages, an empty one one); below
    :data:`BLOAT_PAGES` that shifts the cost of a scan of it by a fraction of one page read.
    """
    ns = _schema_oid(conn, schema)
    assert ns is not None, f"schema {schema!r} does not exist"
    tables = conn.execute(text(
        "SELECT relname FROM pg_class WHERE relnamespace = :ns AND relkind = 'r' ORDER BY relname"),
        {"ns": ns}).scalars().all()
    rows: dict[str, list[tuple[Any, ...]]] = {}
    for t in tables:
        found = conn.execute(text(f'SELECT * FROM "{schema}"."{t}"')).all()
        rows[t] = sorted((tuple(_stable(v, schema) for v in r) for r in found), key=repr)
    sequences = {
        name: tuple(conn.execute(text(f'SELECT last_value, is_called FROM "{schema}"."{name}"')).one())
        for name in conn.execute(text(
            "SELECT relname FROM pg_class WHERE relnamespace = :ns AND relkind = 'S'"),
            {"ns": ns}).scalars()
    }
    sizes = {
        r.relname: (r.relpages, r.reltuples, r.relallvisible,
                    r.pages if r.relispartition and r.relkind == "r" else max(r.pages, BLOAT_PAGES))
        for r in conn.execute(text(
            f"SELECT relname, relkind, relispartition, relpages, reltuples, relallvisible, "
            f"{_PAGES} AS pages FROM pg_class c WHERE relnamespace = :ns "
            "AND relkind IN ('r', 'p', 'i', 'I')"), {"ns": ns})
    }
    return {"rows": rows, "sequences": sequences, "planner sizes": sizes}


def _stable(value: Any, schema: str) -> Any:
    if isinstance(value, (datetime, date)):
        return type(value).__name__
    return _normalise(value, schema)


# -- install and reset ----------------------------------------------------------------------


def stamp_head(conn: Connection, config: QueueStorageConfig) -> None:
    """Record the head revision the way Alembic does, so ``prepare_schema``/``install`` on
    a fast-installed schema see an up-to-date install (a no-op) instead of re-seeding it."""
    vt = f'"{config.schema}"."{config.version_table}"'
    conn.execute(text(f"CREATE TABLE {vt} (version_num VARCHAR(32) NOT NULL, "
                      f"CONSTRAINT {config.version_table}_pkc PRIMARY KEY (version_num))"))
    conn.execute(text(f"INSERT INTO {vt} (version_num) VALUES (:v)"), {"v": REVISIONS[-1]})


def install(conn: Connection, config: QueueStorageConfig, *, stamp: bool = True) -> None:
    """Fast install (``metadata.create_all``), stamped at the head revision unless
    ``stamp=False``."""
    lifecycle.create_all(conn, config)
    if stamp:
        stamp_head(conn, config)


_LANE_SEQUENCES = r"c.relkind = 'S' AND c.relname ~ '^queue_(enqueue|claim)_seq_'"
#: The schema's relations, filtered by the namespace's oid (a join to ``pg_namespace`` by name
#: let the planner scan all of ``pg_class`` for each of a reset's reads: 3-9 ms a read in a
#: session database of a few dozen installs).
_IN_SCHEMA = "FROM pg_class c WHERE c.relnamespace = (SELECT oid FROM pg_namespace WHERE nspname = :s) AND "

Stats = dict[str, tuple[int, float, int]]


@dataclass(frozen=True)
class Pristine:
    """What one install looked like right after it was made: the digest of its definitions
    and the size statistics (pages, tuples, all-visible pages) of its tables and indexes."""

    digest: tuple[tuple[str, int, int], ...]
    stats: Stats


def _stats(conn: Connection, schema: str) -> Stats:
    return {r.relname: (r.relpages, r.reltuples, r.relallvisible) for r in conn.execute(text(
        f"SELECT c.relname, c.relpages, c.reltuples, c.relallvisible {_IN_SCHEMA}"
        "c.relkind IN ('r', 'p', 'i', 'I')"), {"s": schema})}


def record_pristine(conn: Connection, schema: str) -> Pristine:
    """Record a freshly made install of ``schema`` for :func:`reset_install`."""
    digest = catalog_digest(conn, schema)
    assert digest is not None, f"schema {schema!r} does not exist"
    return Pristine(digest, _stats(conn, schema))


def reset_install(conn: Connection, config: QueueStorageConfig, pristine: Pristine,
                  fingerprint: Fingerprint | None = None) -> Fingerprint | None:
    """Put the install of ``config`` back into the state ``pristine`` recorded, on ``conn``
    (one transaction, the caller's). Returns the install's :func:`catalog_fingerprint` as
    the reset left it, or None when its definitions no longer match, having changed nothing
    but the lane sequences, or when size statistics need putting back and the session may
    not write ``pg_class`` (not a superuser): the caller installs it again.

    Drops the lane sequences enqueues and claims create at run time; compares the
    definitions with ``pristine``'s digest, unless ``fingerprint`` (what the last reset or
    the install returned) shows no catalog row of the schema changed since; empties every
    table (TRUNCATE, ~5 ms a table, for a ring slot's table that was written to, as
    maintenance reads their sizes, and for one whose heap or an index grew to
    :data:`BLOAT_PAGES`; DELETE, much cheaper, for the rest that has a page at all);
    restarts every sequence;
    re-inserts the seed rows and, if the install has one, its head-revision version row; and
    puts back the size statistics (``pg_class``) that TRUNCATE and VACUUM change. Statements
    that take no parameters go to the server together, in one round trip.
    """
    s = config.schema
    # The catalogs of the session database are never analyzed (autovacuum is off on the test
    # server), so the planner takes pg_class (tens of thousands of rows once a few dozen
    # installs exist) for a small table and reads all of it, 8 ms a read, where its index on
    # (relname, relnamespace) finds the schema's rows in 1-2 ms. Only for the catalog reads:
    # TRUNCATE's own lookups are much slower without sequential scans.
    conn.execute(text("SET LOCAL enable_seqscan = off"))
    lane_sequences = conn.execute(text(f"SELECT c.relname {_IN_SCHEMA}{_LANE_SEQUENCES}"),
                                  {"s": s}).scalars().all()
    _run_all(conn, [f'DROP SEQUENCE "{s}"."{seq}"' for seq in lane_sequences])
    unchanged = fingerprint is not None and catalog_fingerprint(conn, s) == fingerprint
    if not unchanged and catalog_digest(conn, s) != pristine.digest:
        return None
    tables = conn.execute(text(
        "SELECT t.relname, t.relkind, t.relispartition, t.heap_pages, "
        "greatest(t.heap_pages, t.index_pages) AS pages FROM ("
        f"SELECT c.relname, c.relkind, c.relispartition, {_PAGES} AS heap_pages, "
        "(SELECT max(pg_relation_size(x.indexrelid)) / 8192 FROM pg_index x "
        f" WHERE x.indrelid = c.oid) AS index_pages {_IN_SCHEMA}c.relkind IN ('r', 'p')) t"),
        {"s": s}).all()
    grown = {t.relname for t in tables if t.relkind == "r"
             and ((t.relispartition and t.heap_pages > 0) or (t.pages or 0) >= BLOAT_PAGES)}
    # A table whose heap has no page never held a row; a partitioned parent holds none of its
    # own, and every partition that was written to is truncated above: neither needs a DELETE.
    emptied = [f'DELETE FROM "{s}"."{t.relname}"' for t in tables
               if t.relkind == "r" and not t.relispartition and t.relname not in grown and t.heap_pages > 0]
    if grown:
        emptied.insert(0, "TRUNCATE " + ", ".join(f'"{s}"."{t}"' for t in sorted(grown)))
    conn.execute(text("SET LOCAL enable_seqscan = on"))
    _run_all(conn, emptied)
    conn.execute(text("SET LOCAL enable_seqscan = off"))
    conn.execute(text(
        "SELECT setval(q.seqrelid::regclass, q.seqstart, false) FROM pg_sequence q "
        f"WHERE q.seqrelid = ANY(ARRAY(SELECT c.oid {_IN_SCHEMA}c.relkind = 'S'))"), {"s": s})
    seed_rows(conn, storage_schema(config))
    if any(t.relname == config.version_table for t in tables):
        conn.execute(text(f'INSERT INTO "{s}"."{config.version_table}" (version_num) VALUES (:v)'),
                     {"v": REVISIONS[-1]})
    changed = [(name, *pristine.stats[name]) for name, now in _stats(conn, s).items()
               if now != pristine.stats[name]]
    if changed and conn.execute(text("SHOW is_superuser")).scalar() != "on":
        return None  # only a superuser may write pg_class: install it again instead
    if changed:
        conn.execute(text(
            "UPDATE pg_catalog.pg_class c SET relpages = v.pages, reltuples = v.tuples, "
            "relallvisible = v.visible FROM unnest(CAST(:names AS text[]), CAST(:pages AS int[]), "
            "CAST(:tuples AS real[]), CAST(:visible AS int[])) AS v(name, pages, tuples, visible) "
            "WHERE c.relnamespace = CAST(:s AS regnamespace) AND c.relname = v.name"),
            {"s": f'"{s}"', "names": [c[0] for c in changed], "pages": [c[1] for c in changed],
             "tuples": [c[2] for c in changed], "visible": [c[3] for c in changed]})
    return catalog_fingerprint(conn, s)


def _run_all(conn: Connection, statements: list[str]) -> None:
    """Run parameterless ``statements`` in one round trip (the simple query protocol)."""
    if statements:
        conn.exec_driver_sql("; ".join(statements))


# -- background work ------------------------------------------------------------------------


class Worker:
    """Daemon threads that run submitted jobs in the order submitted (``threads`` of them at
    a time), so a reset or a database drop overlaps the next test instead of delaying it.
    Start it before any test records the threads it starts (see ``tests/conftest.py``): they
    are no test's threads."""

    def __init__(self, threads: int = 1) -> None:
        self._jobs: queue.Queue[tuple[Callable[[], Any], Future[Any]] | None] = queue.Queue()
        self._threads = [threading.Thread(target=self._run, name=f"test-background-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    def submit(self, job: Callable[[], T]) -> Future[T]:
        done: Future[T] = Future()
        self._jobs.put((job, done))
        return done

    def stop(self) -> None:
        """Run what is queued, then end the threads."""
        for _ in self._threads:
            self._jobs.put(None)
        for t in self._threads:
            t.join()

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, done = item
            try:
                done.set_result(job())
            except BaseException as err:  # handed to whoever waits on the future
                done.set_exception(err)


# -- the pool ---------------------------------------------------------------------------------


@dataclass
class _Install:
    config: QueueStorageConfig
    pristine: Pristine
    fingerprint: Fingerprint | None = None  # as the install or the last reset left it
    reinstalls: int = 0


@dataclass
class InstallPool:
    """Installed schemas kept for the whole session, keyed by shape.

    :meth:`acquire` hands out an install nobody else holds, in its freshly installed state;
    :meth:`release` takes it back once no other session holds locks on it and has ``worker``
    reset it while the next test runs. An install whose definitions a test changed (a
    dropped or renamed table, an added index, a dropped schema…) is dropped and installed
    again by its reset; its data is reset every time.
    """

    engine: Engine
    worker: Worker
    resetting: dict[Shape, list[Future[_Install]]] = field(default_factory=dict)
    held: dict[str, _Install] = field(default_factory=dict)
    retired: list[str] = field(default_factory=list)
    failures: list[BaseException] = field(default_factory=list)
    created: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def acquire(self, **shape: Any) -> QueueStorageConfig:
        """An install of ``shape`` (QueueStorageConfig fields but ``schema``) in its freshly
        installed state: one whose reset is done; else a new one while fewer than
        :data:`RESETTING_BEFORE_WAITING` of that shape are being reset (so a test rarely
        waits for the reset of the install the test before it used); else the one whose
        reset began first, once done."""
        config = QueueStorageConfig(schema=unique_schema(), **shape)
        key = shape_of(config)
        inst = None
        while inst is None:
            with self.lock:
                coming = self.resetting.setdefault(key, [])
                done = [f for f in coming if f.done()]
                if done:
                    pending: Future[_Install] | None = done[0]
                elif len(coming) >= RESETTING_BEFORE_WAITING:
                    pending = coming[0]
                else:
                    pending = None
                if pending is not None:
                    coming.remove(pending)
            if pending is None:
                inst = self._create(config)
            elif pending.exception() is None:
                inst = pending.result()
        with self.lock:
            self.held[inst.config.schema] = inst
        return inst.config

    def reset(self, config: QueueStorageConfig) -> None:
        """Put ``config``'s install (one this pool handed out) into its freshly installed
        state now."""
        with self.lock:
            inst = self.held[config.schema]
        self._reset(inst)

    def release(self, config: QueueStorageConfig, *, drop: bool = False) -> None:
        """Take ``config``'s install back, once no other session holds a lock on any of its
        relations, and reset it in the background; one still locked after
        :data:`LEAKED_LOCK_WAIT_S` is retired (left to the end of the session) and the leak
        reported. ``drop=True`` drops the install instead (its holder may have left threads
        behind that still use it)."""
        with self.lock:
            inst = self.held.pop(config.schema)
        if drop:
            with self._begin() as conn:
                conn.execute(text(f'DROP SCHEMA IF EXISTS "{config.schema}" CASCADE'))
            return
        holders = self._await_unlocked(config.schema)
        if holders:
            with self.lock:
                self.retired.append(config.schema)
            raise AssertionError(
                f"sessions {holders} still hold locks on schema {config.schema!r} "
                f"{LEAKED_LOCK_WAIT_S:.0f} s after the test ended (a leaked connection?)")
        with self.lock:
            self.resetting.setdefault(shape_of(config), []).append(
                self.worker.submit(lambda: self._reset_in_background(inst)))

    def close(self) -> None:
        """Wait for the background resets; raise the first that failed."""
        with self.lock:
            pending = [f for futures in self.resetting.values() for f in futures]
        for f in pending:
            f.exception()
        if self.failures:
            raise self.failures[0]

    # -- internals --------------------------------------------------------------------------

    @contextmanager
    def _begin(self) -> Iterator[Connection]:
        with self.engine.begin() as conn:
            # A connection a test leaked while holding locks fails the reset instead of hanging it.
            conn.execute(text("SET LOCAL lock_timeout = '60s'"))
            yield conn

    def _create(self, config: QueueStorageConfig) -> _Install:
        with self._begin() as conn:
            install(conn, config)
            pristine = record_pristine(conn, config.schema)
            fingerprint = catalog_fingerprint(conn, config.schema)
        with self.lock:
            self.created += 1
        return _Install(config, pristine, fingerprint)

    def _reset(self, inst: _Install) -> None:
        config = inst.config
        with self._begin() as conn:
            inst.fingerprint = reset_install(conn, config, inst.pristine, inst.fingerprint)
        if inst.fingerprint is not None:
            return
        with self._begin() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{config.schema}" CASCADE'))
            install(conn, config)
            inst.pristine = record_pristine(conn, config.schema)
            inst.fingerprint = catalog_fingerprint(conn, config.schema)
        inst.reinstalls += 1
        with self.lock:
            self.created += 1

    def _reset_in_background(self, inst: _Install) -> _Install:
        try:
            self._reset(inst)
        except BaseException as err:
            with self.lock:
                self.retired.append(inst.config.schema)
                self.failures.append(err)
            raise
        return inst

    def _await_unlocked(self, schema: str) -> list[int]:
        deadline = time.monotonic() + LEAKED_LOCK_WAIT_S
        while True:
            with self.engine.connect() as conn:
                holders = conn.execute(text(
                    "SELECT DISTINCT l.pid FROM pg_locks l "
                    "JOIN pg_class c ON c.oid = l.relation "
                    "JOIN pg_namespace n ON n.oid = c.relnamespace "
                    "WHERE n.nspname = :s AND l.pid <> pg_backend_pid() AND l.database = "
                    "(SELECT oid FROM pg_database WHERE datname = current_database())"),
                    {"s": schema}).scalars().all()
            if not holders or time.monotonic() > deadline:
                return list(holders)
            time.sleep(0.05)
