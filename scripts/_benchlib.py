"""Helpers shared by the storage benchmarks: database setup, the xmin pin, the threaded
drain loop, the single-job enqueue loop, the paced producer with LISTEN/NOTIFY-woken
workers, latency percentiles, dead-tuple accounting and target verdicts. Nothing here knows
about a particular queue."""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import platform
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from sqlalchemy import Connection, Engine, create_engine, make_url, text

__all__ = [
    "DrainResult",
    "PacedSchedule",
    "PickupResult",
    "ScheduleFigures",
    "ServerMeter",
    "Waker",
    "WireTrace",
    "XminPin",
    "database_wal",
    "dead_tuples",
    "drain",
    "ensure_database",
    "ensure_pgstattuple",
    "finish",
    "force_stats_flush",
    "format_table",
    "latency_summary",
    "make_engine",
    "median",
    "paced_pickup",
    "per_job",
    "percentile",
    "pinned",
    "server_info",
    "thread_cpu_ns",
    "timed_enqueue",
    "timed_single_enqueue",
    "verdict",
    "wal_breakdown",
    "wal_position",
    "wal_since",
]

_SLOT_SUFFIX = re.compile(r"_\d+$")
_RING_CHILD = re.compile(r"_\d+(?=_|$)")  # the slot number of a ring child or its index


def finish(json_path: Path | None, payload: dict[str, Any], problems: list[str]) -> int:
    """End a benchmark run: write ``payload`` as JSON when a path was given, name the
    problems that make the run invalid, and return the exit status (2 when there are any)."""
    if json_path:
        json_path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
        print(f"\nwrote {json_path}")
    if problems:
        print("\nINVALID RUN:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 2
    return 0


# -- setup ------------------------------------------------------------------------------
def ensure_database(url: str) -> None:
    """Create the database named by ``url`` if it does not exist (via the ``postgres``
    maintenance database; nothing else there is touched)."""
    u = make_url(url)
    name = u.database
    if not name:
        raise SystemExit("the --url must name a database")
    admin = create_engine(u.set(database="postgres"), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            exists = conn.execute(
                text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name}
            ).scalar()
            if not exists:
                prep = conn.dialect.identifier_preparer
                conn.execute(text(f"CREATE DATABASE {prep.quote(name)}"))
    finally:
        admin.dispose()


def make_engine(url: str, threads: int, settings: dict[str, str] | None = None) -> Engine:
    """One pooled engine; every worker thread checks out its own connection. ``settings``
    become session GUCs of every connection (libpq ``options``)."""
    connect_args = {}
    if settings:
        connect_args["options"] = " ".join(
            f"-c {k.strip()}={v.strip().replace(' ', chr(92) + ' ')}" for k, v in settings.items()
        )
    return create_engine(url, pool_size=threads + 4, max_overflow=4, pool_timeout=60,
                         connect_args=connect_args)


def ensure_pgstattuple(engine: Engine) -> bool:
    """Install ``pgstattuple`` in the bench database if the server ships it."""
    try:
        with engine.begin() as conn:
            conn.execute(text("CREATE EXTENSION IF NOT EXISTS pgstattuple"))
        return True
    except Exception:
        return False


def server_info(engine: Engine) -> dict[str, Any]:
    names = ("server_version", "shared_buffers", "autovacuum", "synchronous_commit",
             "fsync", "max_connections", "wal_level", "checkpoint_timeout", "max_wal_size",
             "jit", "jit_above_cost")
    with engine.connect() as conn:
        settings = {
            n: conn.execute(text("SELECT current_setting(:n)"), {"n": n}).scalar_one()
            for n in names
        }
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "postgres": settings,
    }


def checkpoint(engine: Engine) -> None:
    """Flush dirty buffers so no phase pays for the previous phase's writes (superuser
    only; silently skipped otherwise)."""
    try:
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("CHECKPOINT"))
    except Exception:
        pass


# -- WAL ------------------------------------------------------------------------------
#: The catalogs a schema's install and drop write rows into.
CATALOGS = ("pg_attribute", "pg_class", "pg_type", "pg_depend", "pg_constraint", "pg_index",
            "pg_inherits", "pg_attrdef", "pg_trigger", "pg_proc", "pg_statistic", "pg_namespace")


def vacuum_catalogs(engine: Engine) -> None:
    """``VACUUM`` this database's catalogs (best effort: a role that may not is skipped).

    The benchmarks drop and reinstall schemas of hundreds of partitions between runs. With
    autovacuum off (as on the development machines) the dropped schemas' catalog rows stay
    dead, and the next session that reads their pages prunes them and writes that WAL
    (full-page images after a checkpoint): a measured stretch would count it as the work of
    whichever system happened to read those pages. With autovacuum on, as in production,
    the catalogs are vacuumed anyway."""
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn, \
            contextlib.suppress(Exception):  # a role without the right to vacuum them
        conn.exec_driver_sql("VACUUM " + ", ".join(f"pg_catalog.{c}" for c in CATALOGS))


def wal_position(engine: Engine) -> str:
    """The server's current WAL insert position (an LSN, as text)."""
    with engine.connect() as conn:
        return str(conn.execute(text("SELECT pg_current_wal_lsn()::text")).scalar_one())


def wal_since(engine: Engine, lsn: str) -> int:
    """Bytes of WAL the whole server wrote since ``lsn``. Unlike throughput on a shared
    2-core machine this is repeatable, so it is the figure to compare write paths by
    (anything else writing to the server in the meantime is counted too)."""
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), :lsn)"),
                                {"lsn": lsn}).scalar_one())


def wal_breakdown(engine: Engine, start_lsn: str, end_lsn: str) -> dict[str, Any] | None:
    """Where the WAL of this database between two positions went, from ``pg_walinspect``
    (None when the server does not ship it; records of other databases and the commits of
    their transactions are left out): bytes and records per relation (heap or index, by name; ring
    children fold into their family; records that touch no relation, such as commits, by
    their type), and per relation and record type (``by_record``: inserts, locks, updates,
    ...). Full-page images are counted in the bytes and also reported apart
    (``fpi_bytes``)."""
    try:
        with engine.begin() as conn:
            conn.execute(text("CREATE EXTENSION IF NOT EXISTS pg_walinspect"))
    except Exception:
        return None
    query = text(
        """
        WITH recs AS (
          SELECT r.resource_manager AS rmgr, r.record_type, r.record_length, r.fpi_length,
                 substring(r.block_ref FROM 'rel ([0-9]+)/[0-9]+/[0-9]+')::oid AS spc,
                 substring(r.block_ref FROM 'rel [0-9]+/([0-9]+)/[0-9]+')::oid AS db,
                 substring(r.block_ref FROM 'rel [0-9]+/[0-9]+/([0-9]+)')::oid AS node, r.xid
            FROM pg_get_wal_records_info(CAST(:a AS pg_lsn), least(CAST(:b AS pg_lsn), pg_current_wal_flush_lsn())) r),
        this_db AS (SELECT oid FROM pg_database WHERE datname = current_database()),
        ours AS (SELECT DISTINCT xid FROM recs WHERE db = (SELECT oid FROM this_db))
        SELECT coalesce(n.nspname || '.' || c.relname,
                        CASE WHEN recs.node IS NULL THEN '(' || recs.rmgr || ' ' || recs.record_type || ')'
                             ELSE '(relation ' || recs.node || ')' END) AS what,
               c.relkind, recs.rmgr || '/' || recs.record_type AS record,
               count(*) AS records, sum(recs.record_length) AS bytes,
               sum(recs.fpi_length) AS fpi_bytes
          FROM recs
          LEFT JOIN pg_class c
            ON c.oid = pg_filenode_relation(
                 CASE WHEN recs.spc = (SELECT dattablespace FROM pg_database
                                        WHERE datname = current_database()) THEN 0
                      ELSE recs.spc END, recs.node)
          LEFT JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE recs.db = (SELECT oid FROM this_db)
            OR (recs.db IS NULL AND recs.xid IN (SELECT xid FROM ours))
         GROUP BY 1, 2, 3 ORDER BY 5 DESC
        """
    )
    with engine.connect() as conn:
        rows = conn.execute(query, {"a": start_lsn, "b": end_lsn}).all()
    out: dict[str, dict[str, Any]] = {}
    by_record: dict[str, dict[str, int]] = {}
    for what, relkind, record, records, nbytes, fpi in rows:
        key = _RING_CHILD.sub("", what, count=1) if relkind else what
        if relkind == "i":
            key += " (index)"
        for entry in (out.setdefault(key, {"records": 0, "bytes": 0, "fpi_bytes": 0}),
                      by_record.setdefault(f"{key} {record}", {"records": 0, "bytes": 0, "fpi_bytes": 0})):
            entry["records"] += int(records)
            entry["bytes"] += int(nbytes)
            entry["fpi_bytes"] += int(fpi or 0)
    total = sum(e["bytes"] for e in out.values())
    return {"total_bytes": total, "by_relation": out, "by_record": by_record}


# -- server and client cost of a measured stretch -------------------------------------------
def _schedstat_ns(path: str) -> int:
    """The first field of a ``schedstat`` file: nanoseconds on a CPU. Raises ``OSError``,
    ``ValueError`` or ``IndexError`` where the file is missing or unreadable."""
    with open(path, "rb") as f:
        return int(f.read().split()[0])


def process_cpu(pid: int) -> float:
    """CPU seconds process ``pid`` has run so far: ``/proc/<pid>/schedstat`` (nanoseconds on
    a CPU), else user + system from ``/proc/<pid>/stat`` (clock ticks of 10 ms)."""
    try:
        return _schedstat_ns(f"/proc/{pid}/schedstat") / 1e9
    except (OSError, ValueError, IndexError):
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_ns() -> dict[int, int]:
    """CPU nanoseconds each thread of this process has run so far, by native thread id
    (``/proc/self/task/<tid>/schedstat``; empty where ``/proc`` has no such file)."""
    out: dict[int, int] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            out[int(tid)] = _schedstat_ns(f"/proc/self/task/{tid}/schedstat")
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
    return out


def database_backends_cpu(db: str) -> dict[int, float]:
    """CPU seconds so far of every server process on this host whose title names database
    ``db`` (its backends), by pid; empty when ``/proc`` shows none."""
    out: dict[int, float] = {}
    needle = f" {db} ".encode()
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return out
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                title = f.read(200)
            if not title.startswith(b"postgres: ") or needle not in title:
                continue
            out[pid] = process_cpu(pid)
        except (OSError, ValueError, IndexError):
            continue
    return out


#: What a sampled backend of :class:`WaitSampler` was doing, by ``pg_stat_activity``'s
#: state and wait event: the categories, in the order they are reported.
WAIT_STATES = ("on_cpu", "wal_flush", "lock_row", "lock_relation", "lock_other", "lwlock", "io",
               "client_in_xact", "other")


def wait_state(state: str | None, kind: str | None, event: str | None) -> str | None:
    """The :data:`WAIT_STATES` category of one ``pg_stat_activity`` row (None: idle outside
    a transaction, which is not counted). ``on_cpu`` is a backend running a statement with
    no wait event (on a CPU, or waiting for one); ``wal_flush`` its commit's WAL write and
    sync; ``lock_row`` a wait for another transaction (a row or tuple lock);
    ``client_in_xact`` a session inside a transaction waiting for its client."""
    if state == "active":
        if kind is None:
            return "on_cpu"
        if event in ("WALSync", "WALWrite", "WALInsert") or (kind == "LWLock" and event and event.startswith("WAL")):
            return "wal_flush"
        if kind == "Lock":
            return {"transactionid": "lock_row", "tuple": "lock_row", "relation": "lock_relation"}.get(
                event or "", "lock_other")
        return {"LWLock": "lwlock", "IO": "io"}.get(kind, "other")
    if state in ("idle in transaction", "idle in transaction (aborted)"):
        return "client_in_xact"
    return None


class WaitSampler:
    """Samples ``pg_stat_activity`` every ``interval`` seconds on a thread of its own, for
    the client backends of one database, and counts what each was doing
    (:func:`wait_state`). Its session is on the server's maintenance database (``postgres``),
    so the backend CPU a :class:`ServerMeter` reads for the measured database leaves it out;
    its thread's CPU is :attr:`cpu_s`. :meth:`summary` gives, per category, the mean number
    of backends in it over the samples and its share of the counted states."""

    def __init__(self, engine: Engine, interval: float = 0.005) -> None:
        self._url = engine.url.set(drivername="postgresql", database="postgres").render_as_string(
            hide_password=False)
        with engine.connect() as conn:
            self._db = str(conn.execute(text("SELECT current_database()")).scalar_one())
        self._interval = interval
        self.counts = dict.fromkeys(WAIT_STATES, 0)
        self.samples = 0
        self.cpu_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="wait-sampler", daemon=True)

    def _run(self) -> None:
        t0 = time.thread_time()
        with psycopg.connect(self._url, autocommit=True) as conn:
            query = ("SELECT state, wait_event_type, wait_event FROM pg_stat_activity "
                     "WHERE datname = %s AND backend_type = 'client backend'")
            while not self._stop.wait(self._interval):
                for row in conn.execute(query, (self._db,), prepare=True).fetchall():
                    cat = wait_state(*row)
                    if cat is not None:
                        self.counts[cat] += 1
                self.samples += 1
        self.cpu_s = time.thread_time() - t0

    def start(self) -> WaitSampler:
        self._thread.start()
        return self

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        return self.summary()

    def summary(self) -> dict[str, Any]:
        counted = sum(self.counts.values())
        n = max(self.samples, 1)
        return {"samples": self.samples,
                "mean_backends": {k: v / n for k, v in self.counts.items()},
                "share": {k: (v / counted if counted else 0.0) for k, v in self.counts.items()}}


class ServerMeter:
    """What the server spent on one database between :meth:`start` and :meth:`stop`:

    * ``wal_bytes``: WAL written by the whole server (``pg_current_wal_lsn`` difference),
      and ``wal_db_bytes``: the part of it that belongs to this database (see
      :func:`database_wal`; None without ``pg_walinspect`` or the right to make a
      replication slot, which keeps the stretch's WAL until it is read); with
      ``breakdown``, ``wal_by_relation`` (:func:`wal_breakdown`);
    * ``active_ms``: time the database's sessions spent running statements
      (``pg_stat_database.active_time``; sessions report it when they go idle, at most
      once a second unless forced, so :meth:`stop` first forces the pooled sessions of
      ``engines`` and waits for closed sessions to report);
    * ``backend_cpu_s``: CPU time of the database's backend processes, read from ``/proc``
      (the server must run on this host; None otherwise), sampled by a thread of its own
      five times a second so a backend that exits early still counts up to its last sample
      (call :meth:`sample` just before closing sessions); that thread's own CPU is reported
      (``sampler_cpu_s``) so callers can take it out of the client's process time;
    * ``xacts``: transactions committed or rolled back in the database;
    * with ``waits``, ``waits``: what the database's backends were doing, sampled every 5 ms
      (:class:`WaitSampler`; its thread's CPU is added to ``sampler_cpu_s``). The sampling
      costs the client and the server some CPU of their own: a run that reports it is not
      one to take rates from."""

    def __init__(self, engine: Engine, breakdown: bool = False, waits: bool = False) -> None:
        self._engine = engine
        self._breakdown = breakdown
        self._waits = WaitSampler(engine) if waits else None
        self._slot: Connection | None = None
        with engine.connect() as conn:
            self._db = str(conn.execute(text("SELECT current_database()")).scalar_one())
            self._local = str(engine.url.host) in ("127.0.0.1", "localhost", "::1", "None")
        self._first: dict[int, float] = {}
        self._last: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sampler_cpu = 0.0
        self._readable = False

    def _stats(self) -> tuple[str, float, int]:
        with self._engine.connect() as conn:
            conn.execute(text("SELECT pg_stat_clear_snapshot()"))
            lsn, active, xacts = conn.execute(text(
                "SELECT pg_current_wal_lsn()::text, active_time, xact_commit + xact_rollback "
                "FROM pg_stat_database WHERE datname = current_database()")).one()
            conn.rollback()
        return str(lsn), float(active or 0.0), int(xacts)

    def _backends(self) -> dict[int, float]:
        """CPU seconds of every process whose title names this database's backends."""
        return database_backends_cpu(self._db)

    def sample(self) -> None:
        """Read the backends' CPU now (before sessions that are about to close go away)."""
        if self._thread is not None and not self._stop.is_set():
            for pid, cpu in self._backends().items():
                self._first.setdefault(pid, 0.0)
                self._last[pid] = cpu

    def _sample(self) -> None:
        t0 = time.thread_time()
        while not self._stop.wait(0.2):
            for pid, cpu in self._backends().items():
                self._first.setdefault(pid, 0.0)  # a backend born in the stretch counts from 0
                self._last[pid] = cpu
            self._sampler_cpu = time.thread_time() - t0
        self._sampler_cpu = time.thread_time() - t0

    def _hold_wal(self) -> None:
        """Keep the stretch's WAL on the server until :meth:`stop` has read it: a temporary
        physical replication slot reserving WAL from now on (it holds no xmin, so it pins no
        MVCC horizon), on a session of its own; a checkpoint would otherwise recycle the
        segments before ``pg_walinspect`` reads them. Skipped when it cannot be made."""
        try:
            conn = self._engine.connect().execution_options(isolation_level="AUTOCOMMIT")
            conn.execute(text("CREATE EXTENSION IF NOT EXISTS pg_walinspect"))
            conn.execute(text("SELECT pg_create_physical_replication_slot(:n, true, true)"),
                         {"n": f"bench_meter_{os.getpid()}_{id(self)}"})
            self._slot = conn
        except Exception:
            self._slot = None

    def _release_wal(self) -> None:
        if self._slot is not None:
            self._slot.close()  # a temporary slot ends with its session
            self._slot = None

    def start(self) -> ServerMeter:
        vacuum_catalogs(self._engine)
        self._hold_wal()
        self._lsn0, self._active0, self._xacts0 = self._stats()
        if self._waits is not None:
            self._waits.start()
        if self._local:
            first = self._backends()
            self._readable = bool(first)
            self._first, self._last = dict(first), dict(first)
            self._thread = threading.Thread(target=self._sample, name="server-meter", daemon=True)
            self._thread.start()
        return self

    def stop(self, *engines: Engine, settle: float = 0.3) -> dict[str, Any]:
        """Stop measuring; ``engines``: engines whose pooled sessions may hold statistics not
        yet reported (each idle pooled session is made to report them)."""
        wal_lsn = wal_position(self._engine)
        waits = self._waits.stop() if self._waits is not None else None
        cpu: float | None = None
        if self._thread is not None:
            last = self._backends()
            self._stop.set()
            self._thread.join()
            self._last.update(last)
            if self._readable:
                cpu = sum(v - self._first.get(pid, 0.0) for pid, v in self._last.items())
        for eng in engines:
            force_stats_flush(eng)
        time.sleep(settle)
        _, active, xacts = self._stats()
        with self._engine.connect() as conn:
            wal = int(conn.execute(text("SELECT pg_wal_lsn_diff(CAST(:b AS pg_lsn), CAST(:a AS pg_lsn))"),
                                   {"a": self._lsn0, "b": wal_lsn}).scalar_one())
        try:
            db_wal = database_wal(self._engine, self._lsn0, wal_lsn) if self._slot is not None else None
            detail = (wal_breakdown(self._engine, self._lsn0, wal_lsn)
                      if self._breakdown and self._slot is not None else None)
        finally:
            self._release_wal()
        return {"wal_bytes": wal, "wal_db_bytes": db_wal, "wal_by_relation": detail,
                "wal_from": self._lsn0, "wal_to": wal_lsn,
                "active_ms": active - self._active0, "backend_cpu_s": cpu,
                "xacts": xacts - self._xacts0, "waits": waits,
                "sampler_cpu_s": self._sampler_cpu + (self._waits.cpu_s if self._waits is not None else 0.0)}


def database_wal(engine: Engine, start_lsn: str, end_lsn: str) -> int | None:
    """Bytes of WAL between two positions that belong to the engine's database: records
    touching its own relations (system catalogs left out: their pruning after the
    benchmarks' reinstalls is not the workload's), and the commit (or abort) records of the
    transactions that wrote them. Other databases' traffic on a shared server is left out,
    which the plain position difference cannot do. None without ``pg_walinspect``."""
    try:
        with engine.begin() as conn:
            conn.execute(text("CREATE EXTENSION IF NOT EXISTS pg_walinspect"))
    except Exception:
        return None
    query = text(
        """
        WITH recs AS (
          SELECT r.xid, r.record_length,
                 substring(r.block_ref FROM 'rel [0-9]+/([0-9]+)/[0-9]+')::oid AS db,
                 substring(r.block_ref FROM 'rel [0-9]+/[0-9]+/([0-9]+)')::bigint AS node
            FROM pg_get_wal_records_info(CAST(:a AS pg_lsn), least(CAST(:b AS pg_lsn), pg_current_wal_flush_lsn())) r),
        mine AS (SELECT * FROM recs
                  WHERE db = (SELECT oid FROM pg_database WHERE datname = current_database())
                    AND node >= 16384),
        ours AS (SELECT DISTINCT xid FROM mine)
        SELECT (SELECT coalesce(sum(record_length), 0) FROM mine)
             + (SELECT coalesce(sum(record_length), 0) FROM recs
                 WHERE db IS NULL AND xid IN (SELECT xid FROM ours))
        """
    )
    with engine.connect() as conn:
        return int(conn.execute(query, {"a": start_lsn, "b": end_lsn}).scalar_one())


def force_stats_flush(engine: Engine) -> None:
    """Make every idle pooled session of ``engine`` report its pending statistics now (each
    runs ``pg_stat_force_next_flush()``, whose transaction's end reports them)."""
    pool = engine.pool
    n = pool.checkedin() if hasattr(pool, "checkedin") else 0
    conns = []
    try:
        for _ in range(n):
            conns.append(engine.connect())
        for c in conns:
            c.execute(text("SELECT pg_stat_force_next_flush()"))
            c.commit()
    finally:
        for c in conns:
            c.close()


def per_job(use: dict[str, Any], jobs: int, client_cpu_s: float) -> dict[str, Any]:
    """The figures of a :class:`ServerMeter` stretch and the client's CPU, per job."""
    n = max(jobs, 1)
    cpu = use.get("backend_cpu_s")
    db = use.get("wal_db_bytes")
    return {
        "wal_bytes_per_job": use["wal_bytes"] / n,
        "wal_db_bytes_per_job": None if db is None else db / n,
        "server_active_us_per_job": use["active_ms"] * 1000.0 / n,
        "server_cpu_us_per_job": None if cpu is None else cpu * 1e6 / n,
        "server_xacts_per_job": use["xacts"] / n,
        "client_cpu_us_per_job": client_cpu_s * 1e6 / n,
    }


class WireTrace:
    """Counts what clients send on the wire: libpq's protocol trace of each connection
    :meth:`attach`\\ ed (a temporary file each). ``round_trips``: every extended-protocol
    exchange ends with ``Sync`` and a simple query is one ``Query``. Tracing costs client
    time, so it is for a run of its own, not a timed one."""

    def __init__(self) -> None:
        self._files: list[Any] = []
        self._conns: list[Any] = []
        self._lock = threading.Lock()

    def attach(self, pgconn: Any) -> None:
        """Trace ``pgconn`` (a ``psycopg.pq`` connection) from now on."""
        import tempfile

        from psycopg import pq

        f = tempfile.TemporaryFile("w+")  # noqa: SIM115 - open until counts() reads it
        pgconn.trace(f.fileno())
        pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS)
        with self._lock:
            self._files.append(f)
            self._conns.append(pgconn)

    @staticmethod
    def detach(pgconn: Any) -> None:
        """Stop tracing ``pgconn`` (libpq flushes its trace): call it before the connection
        closes, or what libpq still buffers is lost."""
        with contextlib.suppress(Exception):
            pgconn.untrace()

    def attach_engine(self, engine: Engine) -> None:
        """Trace every connection ``engine`` opens from now on (a fresh engine traces all)."""
        from sqlalchemy import event

        @event.listens_for(engine, "connect")
        def traced(dbapi_conn: Any, record: Any) -> None:
            self.attach(dbapi_conn.pgconn)

    def counts(self) -> dict[str, int]:
        """Messages sent by the clients, by protocol message name (untraces them first)."""
        out: dict[str, int] = {}
        with self._lock:
            for pgconn in self._conns:
                with contextlib.suppress(Exception):
                    pgconn.untrace()
            for f in self._files:
                f.flush()
                f.seek(0)
                for line in f:
                    parts = line.split("\t", 3)
                    if len(parts) >= 3 and parts[0] == "F":
                        name = parts[2].strip()
                        out[name] = out.get(name, 0) + 1
                f.close()
            self._files.clear()
            self._conns.clear()
        return out

    @staticmethod
    def round_trips(counts: dict[str, int]) -> int:
        return counts.get("Sync", 0) + counts.get("Query", 0)


# -- enqueue --------------------------------------------------------------------------
def timed_enqueue(
    engine: Engine,
    fn: Callable[[Connection, Sequence[Any]], int],
    jobs: Sequence[Any],
    chunk: int,
) -> tuple[float, int]:
    """Enqueue ``jobs`` from one connection, ``chunk`` jobs per call and per transaction.
    Returns (seconds, jobs written)."""
    written = 0
    with engine.connect() as conn:
        t0 = time.perf_counter()
        for i in range(0, len(jobs), chunk):
            with conn.begin():
                written += fn(conn, jobs[i : i + chunk])
        elapsed = time.perf_counter() - t0
    return elapsed, written


# -- the xmin pin -----------------------------------------------------------------------
class XminPin:
    """A separate session that holds a transaction with an assigned xid open and idle
    (``BEGIN; SELECT txid_current();``), so VACUUM/pruning cannot remove anything deleted
    after it started."""

    def __init__(self, engine: Engine, breakdown: bool = False) -> None:
        self._engine = engine
        self._breakdown = breakdown
        self._slot: Connection | None = None
        self._conn: Connection | None = None
        self.xid: int | None = None

    def __enter__(self) -> XminPin:
        self._conn = self._engine.connect()
        self._conn.begin()
        self.xid = int(self._conn.execute(text("SELECT txid_current()")).scalar_one())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._conn is not None:
            self._conn.rollback()
            self._conn.close()
            self._conn = None


@contextlib.contextmanager
def pinned(engine: Engine, pin: bool) -> Iterator[XminPin | None]:
    """An :class:`XminPin` held for the block when ``pin`` is true, else nothing (``None``)."""
    if not pin:
        yield None
        return
    with XminPin(engine) as holder:
        yield holder


# -- the drain --------------------------------------------------------------------------
@dataclass
class DrainResult:
    jobs: int
    seconds: float  # start barrier -> last successful completion
    wall_seconds: float  # start barrier -> every worker exited (includes the empty re-check)
    ids: list[int] = field(repr=False)
    claim_calls: int = 0
    empty_claims: int = 0
    early_exits: int = 0
    per_thread: list[int] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)  # "claim: Type: message" -> count
    handled: int = 0  # calls of the job handler

    @property
    def jobs_per_s(self) -> float:
        return self.jobs / self.seconds if self.seconds > 0 else 0.0

    @property
    def duplicates(self) -> int:
        return len(self.ids) - len(set(self.ids))


def drain(
    engine: Engine,
    *,
    threads: int,
    claim: Callable[[Connection], Sequence[Any]],
    complete: Callable[[Connection, Sequence[Any]], int],
    ids_of: Callable[[Sequence[Any]], list[int]],
    expected: int | None = None,
    recheck_pause: float = 0.01,
    idle_exit: float = 1.0,
    own_transactions: bool = False,
    handle: Callable[[Any], object] | None = None,
    tolerate_errors: bool = False,
) -> DrainResult:
    """``threads`` workers, each on its own pooled connection, loop claim + complete (one
    transaction each). A worker stops once its claims have come back empty (at least twice,
    ``recheck_pause`` apart) for ``idle_exit`` seconds, or as soon as all ``expected`` jobs
    have been completed by the pool. A worker that gave up on empties while jobs were still
    outstanding is counted in ``early_exits``.

    ``own_transactions``: instead of wrapping each call in ``BEGIN ... COMMIT`` on the
    worker's connection, pass the ``Engine`` to ``claim``/``complete`` and let each system
    run the call as its own transaction (each adapter's Engine mode).

    ``handle``: called once per claimed job, in claim order, between the claim and the
    completion of its batch (a worker's job handler; its time is part of the drain).

    ``tolerate_errors``: an exception raised by a claim or a completion is counted in
    ``DrainResult.errors`` (by call, type and message) and the worker goes on after
    ``recheck_pause``; jobs of a batch whose completion raised are not counted as drained.
    Without it the first exception stops the drain and is raised."""
    start = threading.Barrier(threads + 1)
    lock = threading.Lock()
    errors: list[BaseException] = []
    tolerated: dict[str, int] = {}

    def note(call: str, exc: Exception) -> None:
        key = f"{call}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        with lock:
            tolerated[key] = tolerated.get(key, 0) + 1
        time.sleep(recheck_pause)
    all_ids: list[int] = []
    last_done: list[float] = []
    stats = {"calls": 0, "empty": 0, "early_exits": 0, "completed": 0, "handled": 0}
    per_thread: list[int] = [0] * threads

    def worker(idx: int) -> None:
        ids: list[int] = []
        calls = empty = handled = 0
        last = 0.0
        try:
            # own_transactions: no connection per worker; each call checks one out itself
            with contextlib.nullcontext() if own_transactions else engine.connect() as conn:
                start.wait(timeout=120)
                empties = 0
                idle_since = 0.0
                while True:
                    if expected is not None and stats["completed"] >= expected:
                        break
                    try:
                        if own_transactions:
                            got = claim(engine)  # type: ignore[arg-type]
                        else:
                            assert conn is not None
                            with conn.begin():
                                got = claim(conn)
                    except Exception as exc:
                        if not tolerate_errors:
                            raise
                        calls += 1
                        note("claim", exc)
                        continue
                    calls += 1
                    if not got:
                        empty += 1
                        empties += 1
                        now = time.perf_counter()
                        if empties == 1:
                            idle_since = now
                        elif now - idle_since >= idle_exit:
                            with lock:
                                if expected is not None and stats["completed"] < expected:
                                    stats["early_exits"] += 1
                            break
                        time.sleep(recheck_pause)
                        continue
                    empties = 0
                    if handle is not None:
                        for job in got:
                            handle(job)
                            handled += 1
                    try:
                        if own_transactions:
                            done = complete(engine, got)  # type: ignore[arg-type]
                        else:
                            assert conn is not None
                            with conn.begin():
                                done = complete(conn, got)
                    except Exception as exc:
                        if not tolerate_errors:
                            raise
                        note("complete", exc)
                        continue
                    if done != len(got):
                        raise RuntimeError(
                            f"completion reported {done} of {len(got)} claimed jobs"
                        )
                    ids.extend(ids_of(got))
                    last = time.perf_counter()
                    with lock:
                        stats["completed"] += len(got)
                # Make the cumulative statistics (n_dead_tup) visible without waiting.
                with contextlib.nullcontext(conn) if conn is not None else engine.connect() as c, c.begin():
                    c.execute(text("SELECT pg_stat_force_next_flush()"))
        except threading.BrokenBarrierError:
            return
        except BaseException as exc:
            with lock:
                errors.append(exc)
            start.abort()
        finally:
            with lock:
                all_ids.extend(ids)
                stats["calls"] += calls
                stats["empty"] += empty
                stats["handled"] += handled
                per_thread[idx] = len(ids)
                if last:
                    last_done.append(last)

    pool = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(threads)]
    for t in pool:
        t.start()
    with contextlib.suppress(threading.BrokenBarrierError):
        start.wait(timeout=120)
    t0 = time.perf_counter()
    for t in pool:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} drain worker(s) failed") from errors[0]
    seconds = (max(last_done) - t0) if last_done else wall
    return DrainResult(
        jobs=len(all_ids),
        seconds=seconds,
        wall_seconds=wall,
        ids=all_ids,
        claim_calls=stats["calls"],
        empty_claims=stats["empty"],
        early_exits=stats["early_exits"],
        per_thread=per_thread,
        errors=tolerated,
        handled=stats["handled"],
    )


# -- dead tuples ------------------------------------------------------------------------
def family_of(relname: str) -> str:
    """``ready_entries_3`` -> ``ready_entries``; ring children fold into their parent."""
    return _SLOT_SUFFIX.sub("", relname)


def dead_tuples(engine: Engine, schema: str, exact: bool,
                fold: bool = True) -> dict[str, dict[str, int]]:
    """Dead tuples per table family of ``schema`` (per table when ``fold`` is false):
    ``dead`` (``pgstattuple`` when ``exact``, else the statistics counter), ``n_dead_tup``
    (statistics), ``live`` and ``bytes`` (heap + indexes + toast)."""
    rows_sql = text(
        """
        SELECT c.relname,
               c.oid,
               coalesce(s.n_dead_tup, 0) AS n_dead_tup,
               pg_total_relation_size(c.oid) AS bytes
          FROM pg_class c
          JOIN pg_namespace n ON n.oid = c.relnamespace
          LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
         WHERE n.nspname = :schema AND c.relkind = 'r'
         ORDER BY c.relname
        """
    )
    time.sleep(0.3)  # let the workers' forced statistics flush land
    out: dict[str, dict[str, int]] = {}
    with engine.connect() as conn:
        conn.execute(text("SELECT pg_stat_clear_snapshot()"))
        for relname, oid, n_dead, size in conn.execute(rows_sql, {"schema": schema}).all():
            dead = live = None
            if exact:
                dead, live = conn.execute(
                    text("SELECT dead_tuple_count, tuple_count FROM pgstattuple(:oid)"),
                    {"oid": oid},
                ).one()
            fam = out.setdefault(
                family_of(relname) if fold else relname,
                {"dead": 0, "n_dead_tup": 0, "live": 0, "bytes": 0,
                                     "relations": 0},
            )
            fam["dead"] += int(dead if dead is not None else n_dead)
            fam["n_dead_tup"] += int(n_dead)
            fam["live"] += int(live or 0)
            fam["bytes"] += int(size)
            fam["relations"] += 1
        conn.rollback()
    return out


# -- single-job enqueue -----------------------------------------------------------------
def timed_single_enqueue(enqueue_one: Callable[[int], object], seconds: float,
                         warmup_calls: int = 50) -> dict[str, Any]:
    """Call ``enqueue_one(i)`` (one job, its own transaction) back to back from this thread
    for ``seconds``, after ``warmup_calls`` untimed calls (numbered from -warmup_calls, so
    timed jobs are 0, 1, ...). Returns jobs, seconds, jobs/s and the per-call latency."""
    for i in range(-warmup_calls, 0):
        enqueue_one(i)
    calls: list[float] = []
    n = 0
    t0 = time.perf_counter()
    end = t0 + seconds
    now = t0
    while now < end:
        enqueue_one(n)
        after = time.perf_counter()
        calls.append(after - now)
        now = after
        n += 1
    elapsed = now - t0
    return {"jobs": n, "seconds": elapsed, "jobs_per_s": n / elapsed if elapsed > 0 else 0.0,
            "call_ms": latency_summary(calls)}


# -- percentiles and verdicts -------------------------------------------------------------
def median(values: Sequence[float]) -> float | None:
    vals = sorted(values)
    if not vals:
        return None
    mid = len(vals) // 2
    return vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile ``q`` (0-100] of already sorted values; None when empty."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q / 100.0 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def latency_summary(seconds: Sequence[float]) -> dict[str, Any]:
    """Count and p50/p95/p99/max/mean of durations given in seconds, in milliseconds."""
    vals = sorted(seconds)

    def ms(x: float | None) -> float | None:
        return None if x is None else x * 1000.0

    return {
        "n": len(vals),
        "p50_ms": ms(percentile(vals, 50)),
        "p95_ms": ms(percentile(vals, 95)),
        "p99_ms": ms(percentile(vals, 99)),
        "max_ms": ms(vals[-1] if vals else None),
        "mean_ms": ms(sum(vals) / len(vals) if vals else None),
    }


def verdict(value: float | None, op: str, target: float, note: str | None = None) -> dict[str, Any]:
    """``{"value", "target", "result"}`` with result PASS/FAIL (``op`` is ``>=`` or ``<=``),
    or SKIP when nothing was measured; ``note`` qualifies the figure."""
    out: dict[str, Any] = {"value": value, "target": f"{op} {target}"}
    if value is None:
        out["result"] = "SKIP"
    else:
        ok = value >= target if op == ">=" else value <= target
        out["result"] = "PASS" if ok else "FAIL"
    if note:
        out["note"] = note
    return out


# -- LISTEN/NOTIFY wake-ups and the paced producer -----------------------------------------
class Waker:
    """A dedicated LISTEN session on one channel (its own psycopg connection in autocommit,
    outside the engine's pool) and a thread reading its notifications.

    Every notification is a wake-up token: it releases one thread blocked in :meth:`wait`,
    or the next thread to call it. At most ``cap`` tokens are kept (one per worker is enough:
    a woken worker claims a whole batch), so a burst does not cause a train of empty claims.
    """

    def __init__(self, engine: Engine, channel: str, cap: int) -> None:
        cargs, cparams = engine.dialect.create_connect_args(engine.url)
        cparams.pop("context", None)
        self.channel = channel
        self._conn = psycopg.connect(*cargs, **cparams, autocommit=True)
        self._conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        self._cap = max(1, cap)
        self._tokens = 0
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self.received = 0
        self._thread = threading.Thread(target=self._run, name=f"waker:{channel}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for _ in self._conn.notifies(timeout=0.2):
                with self._cond:
                    self.received += 1
                    self._tokens = min(self._tokens + 1, self._cap)
                    self._cond.notify()

    def wait(self, timeout: float) -> bool:
        """Block until a notification's token is available (True; the token is used up) or
        ``timeout`` seconds passed (False)."""
        with self._cond:
            if self._cond.wait_for(lambda: self._tokens > 0, timeout):
                self._tokens -= 1
                return True
            return False

    def wake_all(self, n: int) -> None:
        """Release up to ``n`` waiting threads (used to stop them)."""
        with self._cond:
            self._tokens = max(self._tokens, n)
            self._cond.notify_all()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._conn.close()

    def __enter__(self) -> Waker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class PickupResult:
    offered_rate: float
    window_seconds: float  # the measured part of the schedule (after the warm-up)
    enqueued: int  # jobs whose enqueue committed after the warm-up: the measured jobs
    enqueued_total: int  # including the warm-up
    producer_seconds: float  # end of the warm-up -> the last enqueue returned (>= window)
    lag_seconds: list[float] = field(repr=False)  # how late each measured enqueue started
    latencies: list[float] = field(repr=False)  # commit -> handler start, measured jobs
    enqueue_seconds: list[float] = field(repr=False)  # duration of each measured enqueue call
    claim_seconds: list[float] = field(repr=False)  # duration of each claim that got jobs
    handled: int = 0  # distinct jobs whose handler ran (warm-up included)
    duplicates: int = 0  # handler runs beyond the first for a job
    missing: int = 0  # enqueued, never handled
    completed: int = 0  # jobs the completions reported done
    claim_calls: int = 0
    empty_claims: int = 0
    wakes_notify: int = 0  # waits ended by a notification
    wakes_poll: int = 0  # waits that timed out (the polling fallback)
    poll_claims_with_jobs: int = 0  # claims after a timed-out wait that found jobs
    notifications: int = 0
    negative_latencies: int = 0  # handler started before the producer saw its commit return
    errors: dict[str, int] = field(default_factory=dict)

    @property
    def achieved_rate(self) -> float:
        return self.enqueued / self.producer_seconds if self.producer_seconds > 0 else 0.0


@dataclass
class ScheduleFigures:
    """The measured part of a :class:`PacedSchedule`: jobs committed after the warm-up."""

    jobs: list[int]
    latencies: list[float]  # commit -> handler start, measured jobs that started
    lag_seconds: list[float]  # how late each measured enqueue call began
    enqueue_seconds: list[float]  # duration of each measured enqueue call
    producer_seconds: float  # end of the warm-up -> the last measured commit (>= the window)
    missing: int  # enqueued (warm-up included), never started


class PacedSchedule:
    """``producers`` threads sharing one schedule: job ``i`` is enqueued (``enqueue_one(i)``,
    one job, its own transaction) by the next free producer at ``t0 + i / rate``, for
    ``warmup + seconds``; they never run ahead of the schedule, catch up when late, and stop
    at the schedule's end whatever they managed. The commit time of job ``i`` is the clock
    (``time.perf_counter``) read right after ``enqueue_one`` returned."""

    def __init__(self, *, rate: float, seconds: float, warmup: float,
                 enqueue_one: Callable[[int], object], producers: int = 1,
                 on_error: Callable[[Exception], None] | None = None) -> None:
        self.rate, self.seconds, self.warmup = rate, seconds, warmup
        self._enqueue_one = enqueue_one
        self._producers = producers
        self._on_error = on_error
        self._lock = threading.Lock()
        self._next = itertools.count()
        self.commit_at: dict[int, float] = {}
        self.timing: dict[int, tuple[float, float]] = {}  # job -> (due, enqueue call began)
        self.t0 = 0.0

    def _produce(self) -> None:
        total = self.warmup + self.seconds
        end = self.t0 + total
        while True:
            with self._lock:
                i = next(self._next)
            due = self.t0 + i / self.rate
            if i / self.rate >= total or time.perf_counter() >= end:
                break
            now = time.perf_counter()
            if due > now:
                time.sleep(due - now)
            began = time.perf_counter()
            try:
                self._enqueue_one(i)
            except Exception as exc:
                if self._on_error is not None:
                    self._on_error(exc)
                continue
            done = time.perf_counter()
            with self._lock:
                self.commit_at[i] = done
                self.timing[i] = (due, began)

    def run(self) -> None:
        """Run the schedule to its end (blocks)."""
        self.t0 = time.perf_counter() + 0.05
        threads = [threading.Thread(target=self._produce, daemon=True) for _ in range(self._producers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def settle(self, started: dict[int, float], lock: threading.Lock, timeout: float) -> bool:
        """Wait until every enqueued job is in ``started`` (guarded by ``lock``) or
        ``timeout`` seconds passed; returns whether all started."""
        until = time.perf_counter() + timeout
        while time.perf_counter() < until:
            with lock:
                if all(i in started for i in self.commit_at):
                    return True
            time.sleep(0.05)
        return False

    def measured(self, started: dict[int, float]) -> ScheduleFigures:
        """Pickup figures of the jobs that committed after the warm-up (a late producer's
        backlog included); the achieved rate is their number over ``producer_seconds``."""
        window = self.t0 + self.warmup
        jobs = [i for i, at in self.commit_at.items() if at >= window]
        last_return = max((self.commit_at[i] for i in jobs), default=window)
        return ScheduleFigures(
            jobs=jobs,
            latencies=[started[i] - self.commit_at[i] for i in jobs if i in started],
            lag_seconds=[self.timing[i][1] - self.timing[i][0] for i in jobs],
            enqueue_seconds=[self.commit_at[i] - self.timing[i][1] for i in jobs],
            producer_seconds=max(last_return - window, self.seconds),
            missing=sum(1 for i in self.commit_at if i not in started),
        )


def paced_pickup(
    *,
    rate: float,
    seconds: float,
    warmup: float,
    workers: int,
    batch: int,
    enqueue_one: Callable[[int], object],
    claim: Callable[[], Sequence[Any]],
    complete: Callable[[Sequence[Any]], int],
    seq_of: Callable[[Any], int],
    waker: Waker,
    poll_interval: float,
    producers: int = 1,
    settle_timeout: float = 30.0,
) -> PickupResult:
    """``producers`` threads share one schedule: job ``i`` is enqueued (``enqueue_one(i)``,
    one job, its own transaction) by the next free producer at ``t0 + i / rate``, for
    ``warmup + seconds``; they never run ahead of the schedule, catch up when late, and stop
    at the schedule's end whatever they managed (several producers only keep enqueues whose
    commits take longer than ``1 / rate`` on schedule). The commit time of job ``i`` is the
    clock read right after ``enqueue_one`` returned.

    ``workers`` threads each loop: ``claim()``; on jobs, record the handler start
    (``time.perf_counter``, the producer's clock) of each job (``seq_of(job)``), complete the
    batch with one ``complete`` call and claim again at once if the batch was full; on a
    short or empty batch wait on ``waker`` (a notification, or ``poll_interval`` seconds).
    Once the producers are done the workers run until every enqueued job was handled (or
    ``settle_timeout``). Pickup latency = handler start - commit, for the jobs that
    committed after the warm-up; the achieved rate is their number over the time from the
    warm-up's end to the last commit (at least ``seconds``). Errors of any call are counted (call, type, message) and the loop goes on."""
    lock = threading.Lock()
    started: dict[int, float] = {}
    errors: dict[str, int] = {}
    claim_secs: list[float] = []
    st = {"calls": 0, "empty": 0, "wn": 0, "wp": 0, "poll_hits": 0, "completed": 0, "dups": 0}
    stop = threading.Event()

    def note(call: str, exc: Exception) -> None:
        key = f"{call}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        with lock:
            errors[key] = errors.get(key, 0) + 1

    schedule = PacedSchedule(rate=rate, seconds=seconds, warmup=warmup, enqueue_one=enqueue_one,
                             producers=producers, on_error=lambda exc: note("enqueue", exc))

    def worker() -> None:
        polled = False
        while not stop.is_set():
            began = time.perf_counter()
            try:
                got = claim()
            except Exception as exc:
                note("claim", exc)
                got = []
            took = time.perf_counter() - began
            with lock:
                st["calls"] += 1
                if not got:
                    st["empty"] += 1
                elif polled:
                    st["poll_hits"] += 1
            if got:
                claim_secs.append(took)
                for job in got:  # the handler: a no-op that notes when it started
                    at = time.perf_counter()
                    seq = seq_of(job)
                    with lock:
                        if seq in started:
                            st["dups"] += 1
                        else:
                            started[seq] = at
                try:
                    done = complete(got)
                except Exception as exc:
                    note("complete", exc)
                    done = 0
                with lock:
                    st["completed"] += done
                if len(got) >= batch:
                    polled = False
                    continue
            if stop.is_set():
                break
            woke = waker.wait(poll_interval)
            polled = not woke
            with lock:
                st["wn" if woke else "wp"] += 1

    pool = [threading.Thread(target=worker, daemon=True) for _ in range(workers)]
    for t in pool:
        t.start()
    schedule.run()
    schedule.settle(started, lock, settle_timeout)
    stop.set()
    waker.wake_all(workers)
    for t in pool:
        t.join(timeout=30)

    m = schedule.measured(started)
    return PickupResult(
        offered_rate=rate,
        window_seconds=seconds,
        enqueued=len(m.jobs),
        enqueued_total=len(schedule.commit_at),
        producer_seconds=m.producer_seconds,
        lag_seconds=m.lag_seconds,
        latencies=m.latencies,
        enqueue_seconds=m.enqueue_seconds,
        claim_seconds=claim_secs,
        handled=len(started),
        duplicates=st["dups"],
        missing=m.missing,
        completed=st["completed"],
        claim_calls=st["calls"],
        empty_claims=st["empty"],
        wakes_notify=st["wn"],
        wakes_poll=st["wp"],
        poll_claims_with_jobs=st["poll_hits"],
        notifications=waker.received,
        negative_latencies=sum(1 for x in m.latencies if x < 0),
        errors=errors,
    )


# -- output -----------------------------------------------------------------------------
def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for n, r in enumerate(cells):
        lines.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in
                               enumerate(zip(r, widths, strict=True))))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
