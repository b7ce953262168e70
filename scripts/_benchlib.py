"""Helpers shared by the storage benchmarks: database setup, the xmin pin, the threaded
drain loop and dead-tuple accounting. Nothing here knows about a particular queue."""

from __future__ import annotations

import contextlib
import os
import platform
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, make_url, text

__all__ = [
    "DrainResult",
    "XminPin",
    "dead_tuples",
    "drain",
    "ensure_database",
    "ensure_pgstattuple",
    "format_table",
    "make_engine",
    "server_info",
    "timed_enqueue",
    "wal_position",
    "wal_since",
]

_SLOT_SUFFIX = re.compile(r"_\d+$")


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

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
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
) -> DrainResult:
    """``threads`` workers, each on its own pooled connection, loop claim + complete (one
    transaction each). A worker stops once its claims have come back empty (at least twice,
    ``recheck_pause`` apart) for ``idle_exit`` seconds, or as soon as all ``expected`` jobs
    have been completed by the pool. A worker that gave up on empties while jobs were still
    outstanding is counted in ``early_exits``.

    ``own_transactions``: instead of wrapping each call in ``BEGIN ... COMMIT`` on the
    worker's connection, pass the ``Engine`` to ``claim``/``complete`` and let each system
    run the call as its own transaction (each adapter's Engine mode)."""
    start = threading.Barrier(threads + 1)
    lock = threading.Lock()
    errors: list[BaseException] = []
    all_ids: list[int] = []
    last_done: list[float] = []
    stats = {"calls": 0, "empty": 0, "early_exits": 0, "completed": 0}
    per_thread: list[int] = [0] * threads

    def worker(idx: int) -> None:
        ids: list[int] = []
        calls = empty = 0
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
                    if own_transactions:
                        got = claim(engine)  # type: ignore[arg-type]
                    else:
                        assert conn is not None
                        with conn.begin():
                            got = claim(conn)
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
                    if own_transactions:
                        done = complete(engine, got)  # type: ignore[arg-type]
                    else:
                        assert conn is not None
                        with conn.begin():
                            done = complete(conn, got)
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
    )


# -- dead tuples ------------------------------------------------------------------------
def family_of(relname: str) -> str:
    """``ready_entries_3`` -> ``ready_entries``; ring children fold into their parent."""
    return _SLOT_SUFFIX.sub("", relname)


def dead_tuples(engine: Engine, schema: str, exact: bool) -> dict[str, dict[str, int]]:
    """Dead tuples per table family of ``schema``: ``dead`` (``pgstattuple`` when ``exact``,
    else the statistics counter), ``n_dead_tup`` (statistics), ``live`` and ``bytes``
    (heap + indexes + toast)."""
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
                family_of(relname), {"dead": 0, "n_dead_tup": 0, "live": 0, "bytes": 0,
                                     "relations": 0},
            )
            fam["dead"] += int(dead if dead is not None else n_dead)
            fam["n_dead_tup"] += int(n_dead)
            fam["live"] += int(live or 0)
            fam["bytes"] += int(size)
            fam["relations"] += 1
        conn.rollback()
    return out


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
