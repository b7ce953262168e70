"""A classic PostgreSQL job queue written directly on psycopg 3: the strongest hand-written
baseline the benchmarks hold qstore to.

One ``jobs`` table (``id bigserial``, queue, kind, priority, payload ``jsonb``, run_at,
attempts, max_attempts, locked_at, created_at) with one partial index that serves the claim,
``(queue, priority, run_at, id) WHERE locked_at IS NULL``, and three statements. Each is
prepared on its connection (psycopg ``prepare=True``: parsed and planned once per session)
and sent on an autocommit connection, so each is one transaction in one round trip:

* enqueue: ``WITH j AS (INSERT … RETURNING id) SELECT j.id, pg_notify(channel, '') FROM j``,
  the row and its wake-up in one statement (``COPY`` for bulk loads, without wake-ups);
* claim (``UPDATE … RETURNING``): ``UPDATE jobs SET locked_at = now(), attempts = attempts
  + 1`` over the ids of ``SELECT id … WHERE locked_at IS NULL AND queue = $1 AND run_at <=
  now() ORDER BY priority, run_at, id LIMIT $2 FOR UPDATE SKIP LOCKED``, returning the rows;
* complete: ``DELETE FROM jobs WHERE id = ANY($1)``.

Workers are threads (``--driver threads``, the default), each with its own connection,
looping claim / handler per job / complete. For pickup they wait on one ``LISTEN``
connection: each notification wakes one waiting worker (at most one token per worker is
kept, so a burst causes no train of empty claims), and a worker whose claim came back full
claims again at once. Every claim and every completion leaves one dead heap tuple per job,
as in any one-row-per-job queue.

Why these choices: measured on the benchmark machine (2 vCPUs, PostgreSQL 15 on
127.0.0.1, 20,000 jobs, 16 workers, claim 10, no-op handler, clean horizon) with
``python scripts/classic_psycopg.py --compare --rounds N``, which drains with every variant
in each round (the first variant rotating) and reports the median of the per-round ratios
to asyncio with ``UPDATE … RETURNING``, since the host's speed moves between rounds:

=============================  ====================  ====================  ================
variant                        7 rounds (busy host)  5 rounds (quiet host)  client CPU / job
=============================  ====================  ====================  ================
asyncio, ``UPDATE … RETURNING``  1.00x (15,589 /s)     1.00x (24,941 /s)     24-25 us
threads, ``UPDATE … RETURNING``  1.19x (18,604 /s)     1.02x (27,037 /s)     21-22 us
asyncio, SELECT then UPDATE    0.62x                 0.62x                 49-54 us
threads, SELECT then UPDATE    0.82x                 0.55x                 46-53 us
=============================  ====================  ====================  ================

* threads against asyncio (same statements, one connection per worker): threads were as
  fast or faster in every run and cost less client CPU; psycopg's blocking calls release
  the GIL while they wait on the socket, and an asyncio connection adds its own locking and
  the event loop's wake-ups to every statement. ``--driver asyncio`` keeps the other one.
* one ``UPDATE … RETURNING`` against ``SELECT … FOR UPDATE SKIP LOCKED`` then ``UPDATE …
  WHERE id = ANY`` in one transaction (``BEGIN`` and the ``SELECT`` pipelined into one
  round trip, the ``UPDATE`` and ``COMMIT`` into a second): the second round trip and
  statement cost more than they save. ``--claim select`` keeps the other one.

Use :class:`ClassicPsycopg` from the benchmarks (``bench_worker.py`` runs it beside the
SQLAlchemy classic queue and qstore); run this file to compare its variants.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

__all__ = ["DRIVERS", "ClaimMode", "ClassicPsycopg", "Drained", "PickupWorkers", "Producer"]

DEFAULT_SCHEMA = "bench_classic_pg"
DRIVERS = ("threads", "asyncio")
ClaimMode = str  # "update" (one UPDATE … RETURNING) or "select" (SELECT … FOR UPDATE, then UPDATE)
CLAIM_MODES = ("update", "select")
_CHANNEL = re.compile(r"[A-Za-z0-9_:.]{1,63}")
Job = tuple[str, str, int, Any]  # (queue, kind, priority, payload)
Row = tuple[int, str, int, Any, int]  # (id, kind, priority, payload, attempts)
ClaimHook = Callable[[float, float, list[Row]], object]  # (sent, returned, rows) of a claim


@dataclass
class Drained:
    """What one drain did. ``seconds``: from the start barrier to the last completion."""

    jobs: int
    seconds: float
    wall_seconds: float
    ids: list[int] = field(repr=False)
    claim_calls: int = 0
    empty_claims: int = 0
    complete_calls: int = 0
    handled: int = 0
    early_exits: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    per_worker: list[int] = field(default_factory=list)

    @property
    def jobs_per_s(self) -> float:
        return self.jobs / self.seconds if self.seconds > 0 else 0.0

    @property
    def duplicates(self) -> int:
        return len(self.ids) - len(set(self.ids))

    @property
    def round_trips(self) -> int:
        """Round trips of the drain's claims and completions (each statement is one, the
        two-step claim two)."""
        return self.claim_calls + self.complete_calls


def _ids_literal(ids: Iterable[int]) -> str:
    # one text parameter cast to bigint[] by the statement: cheaper to send than a list
    # psycopg adapts element by element, and one prepared statement whatever the values
    return "{" + ",".join(map(str, ids)) + "}"


class ClassicPsycopg:
    """The classic queue in schema ``schema`` of the database ``conninfo`` names (a libpq
    connection string or URL; a SQLAlchemy ``postgresql+psycopg://`` URL is accepted too).

    ``driver``: ``threads`` (default) or ``asyncio``; ``claim``: ``update`` (default) or
    ``select`` (see the module docstring for why the defaults)."""

    def __init__(self, conninfo: str, schema: str = DEFAULT_SCHEMA, *, driver: str = "threads",
                 claim: ClaimMode = "update") -> None:
        if driver not in DRIVERS:
            raise ValueError(f"driver {driver!r}: expected one of {', '.join(DRIVERS)}")
        if claim not in CLAIM_MODES:
            raise ValueError(f"claim {claim!r}: expected one of {', '.join(CLAIM_MODES)}")
        self.conninfo = libpq_url(conninfo)
        self.schema = schema
        self.driver = driver
        self.claim_mode = claim
        self.channel = f"classic_pg:{schema}"
        if not _CHANNEL.fullmatch(self.channel):
            raise ValueError(f"schema {schema!r} makes an invalid channel name {self.channel!r}")
        t = sql.SQL("{}.jobs").format(sql.Identifier(schema))
        self._table = t
        self.sql_insert = sql.SQL(
            "WITH j AS (INSERT INTO {t} (queue, kind, priority, payload) VALUES (%s, %s, %s, %s) "
            "RETURNING id) SELECT j.id, pg_notify({c}, '') FROM j"
        ).format(t=t, c=sql.Literal(self.channel)).as_string(None)
        picked = (
            "SELECT id FROM {t} WHERE locked_at IS NULL AND queue = %s AND run_at <= now() "
            "ORDER BY priority, run_at, id LIMIT %s FOR UPDATE SKIP LOCKED"
        )
        self.sql_claim = sql.SQL(
            "UPDATE {t} j SET locked_at = now(), attempts = j.attempts + 1 "
            "FROM (" + picked + ") c WHERE j.id = c.id "
            "RETURNING j.id, j.kind, j.priority, j.payload, j.attempts"
        ).format(t=t).as_string(None)
        self.sql_pick = sql.SQL(picked).format(t=t).as_string(None)
        self.sql_mark = sql.SQL(
            "UPDATE {t} j SET locked_at = now(), attempts = j.attempts + 1 "
            "WHERE j.id = ANY(%s::bigint[]) RETURNING j.id, j.kind, j.priority, j.payload, j.attempts"
        ).format(t=t).as_string(None)
        self.sql_complete = sql.SQL("DELETE FROM {t} WHERE id = ANY(%s::bigint[])").format(
            t=t).as_string(None)

    # -- install ------------------------------------------------------------------------------
    def connect(self, autocommit: bool = True) -> psycopg.Connection[Any]:
        return psycopg.connect(self.conninfo, autocommit=autocommit)

    def create(self) -> None:
        """Drop and create the schema and its table (a fresh queue)."""
        s = sql.Identifier(self.schema)
        with self.connect() as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(s))
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(s))
            conn.execute(sql.SQL(
                "CREATE TABLE {t} ("
                " id bigserial PRIMARY KEY,"
                " queue text NOT NULL,"
                " kind text NOT NULL,"
                " priority smallint NOT NULL DEFAULT 2,"
                " payload jsonb NOT NULL DEFAULT '{{}}'::jsonb,"
                " run_at timestamptz NOT NULL DEFAULT now(),"
                " attempts integer NOT NULL DEFAULT 0,"
                " max_attempts integer NOT NULL DEFAULT 25,"
                " locked_at timestamptz,"
                " created_at timestamptz NOT NULL DEFAULT now())").format(t=self._table))
            conn.execute(sql.SQL(
                "CREATE INDEX jobs_claim_idx ON {t} (queue, priority, run_at, id) "
                "WHERE locked_at IS NULL").format(t=self._table))

    def drop(self) -> None:
        with self.connect() as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(self.schema)))

    def vacuum(self) -> None:
        with self.connect() as conn:
            conn.execute(sql.SQL("VACUUM {}").format(self._table))

    # -- enqueue ------------------------------------------------------------------------------
    def enqueue_copy(self, jobs: Iterable[Job]) -> int:
        """``COPY`` the jobs in (one transaction, no wake-ups); returns how many."""
        n = 0
        with self.connect(autocommit=False) as conn, conn.cursor() as cur:
            copy_sql = sql.SQL("COPY {} (queue, kind, priority, payload) FROM STDIN").format(self._table)
            with cur.copy(copy_sql) as cp:
                for q, k, p, payload in jobs:
                    cp.write_row((q, k, p, json.dumps(payload, separators=(",", ":"))))
                    n += 1
        return n

    def producer(self) -> Producer:
        """A connection that enqueues single jobs (see :class:`Producer`)."""
        return Producer(self)

    def count(self, queue: str | None = None) -> int:
        with self.connect() as conn:
            if queue is None:
                row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(self._table)).fetchone()
            else:
                row = conn.execute(sql.SQL("SELECT count(*) FROM {} WHERE queue = %s").format(self._table),
                                   (queue,)).fetchone()
        assert row is not None
        return int(row[0])

    def claimable(self, queue: str) -> int:
        """Jobs of ``queue`` a claim could still take."""
        with self.connect() as conn:
            row = conn.execute(sql.SQL("SELECT count(*) FROM {} WHERE queue = %s AND locked_at IS NULL")
                               .format(self._table), (queue,)).fetchone()
        assert row is not None
        return int(row[0])

    # -- claim / complete on one connection -----------------------------------------------------
    def claim(self, conn: psycopg.Connection[Any], queue: str, n: int) -> list[Row]:
        """Claim up to ``n`` jobs of ``queue`` on ``conn`` (autocommit)."""
        if self.claim_mode == "update":
            return conn.execute(self.sql_claim, (queue, n), prepare=True).fetchall()
        with conn.pipeline() as p:
            conn.execute("BEGIN")
            cur = conn.execute(self.sql_pick, (queue, n), prepare=True)
            p.sync()
            ids = [r[0] for r in cur.fetchall()]
            if not ids:
                conn.execute("COMMIT")
                return []
            cur = conn.execute(self.sql_mark, (_ids_literal(ids),), prepare=True)
            conn.execute("COMMIT")
            p.sync()
            return cur.fetchall()

    def complete(self, conn: psycopg.Connection[Any], ids: Sequence[int]) -> int:
        cur = conn.execute(self.sql_complete, (_ids_literal(ids),), prepare=True)
        return cur.rowcount

    async def aclaim(self, conn: psycopg.AsyncConnection[Any], queue: str, n: int) -> list[Row]:
        if self.claim_mode == "update":
            cur = await conn.execute(self.sql_claim, (queue, n), prepare=True)
            return await cur.fetchall()
        async with conn.pipeline() as p:
            await conn.execute("BEGIN")
            cur = await conn.execute(self.sql_pick, (queue, n), prepare=True)
            await p.sync()
            ids = [r[0] for r in await cur.fetchall()]
            if not ids:
                await conn.execute("COMMIT")
                return []
            cur = await conn.execute(self.sql_mark, (_ids_literal(ids),), prepare=True)
            await conn.execute("COMMIT")
            await p.sync()
            return await cur.fetchall()

    async def acomplete(self, conn: psycopg.AsyncConnection[Any], ids: Sequence[int]) -> int:
        cur = await conn.execute(self.sql_complete, (_ids_literal(ids),), prepare=True)
        return cur.rowcount

    def _calls_per_claim(self) -> int:
        return 1 if self.claim_mode == "update" else 2

    # -- drain --------------------------------------------------------------------------------
    def drain(self, queue: str, expected: int, *, workers: int = 16, batch: int = 10,
              handle: Callable[[Row], object] | None = None, idle_exit: float = 1.0,
              recheck_pause: float = 0.01, on_connect: Callable[[Any], None] | None = None,
              on_close: Callable[[Any], None] | None = None,
              on_start: Callable[[], None] | None = None,
              on_end: Callable[[], None] | None = None) -> Drained:
        """``workers`` workers, each on its own connection, loop claim ``batch`` / ``handle``
        each job / complete the batch, until ``expected`` jobs were completed or their claims
        have come back empty for ``idle_exit`` seconds. Claim and completion errors are
        counted and the worker goes on. ``on_connect`` is called with each worker connection
        before the start and ``on_close`` before it closes (e.g. to trace its protocol
        messages); ``on_start`` right before the clock starts and ``on_end`` once every
        worker has stopped, before any connection closes. Each connection reports its
        statistics before it closes. The connections are opened and their statements
        prepared before the clock starts (on a queue nothing is in)."""
        hooks = _Hooks(on_connect, on_close, on_start, on_end)
        if self.driver == "asyncio":
            return asyncio.run(self._drain_async(queue, expected, workers, batch, handle, idle_exit,
                                                 recheck_pause, hooks))
        return self._drain_threads(queue, expected, workers, batch, handle, idle_exit, recheck_pause,
                                   hooks)

    def _warm(self, conn: psycopg.Connection[Any]) -> None:
        self.claim(conn, "\x01warm-up", 1)
        self.complete(conn, [])

    async def _awarm(self, conn: psycopg.AsyncConnection[Any]) -> None:
        await self.aclaim(conn, "\x01warm-up", 1)
        await self.acomplete(conn, [])

    async def _drain_async(self, queue: str, expected: int, workers: int, batch: int,
                           handle: Callable[[Row], object] | None, idle_exit: float,
                           recheck_pause: float, hooks: _Hooks) -> Drained:
        conns = [await psycopg.AsyncConnection.connect(self.conninfo, autocommit=True)
                 for _ in range(workers)]
        st = _DrainState(workers)
        try:
            for c in conns:
                await self._awarm(c)
                if hooks.on_connect is not None:
                    hooks.on_connect(c)

            async def work(idx: int, conn: psycopg.AsyncConnection[Any]) -> None:
                empties, idle_since = 0, 0.0
                while st.completed < expected:
                    try:
                        got = await self.aclaim(conn, queue, batch)
                    except Exception as exc:
                        st.note("claim", exc)
                        await asyncio.sleep(recheck_pause)
                        continue
                    finally:
                        st.claim_calls += self._calls_per_claim()
                    if not got:
                        st.empty += 1
                        empties += 1
                        now = time.perf_counter()
                        if empties == 1:
                            idle_since = now
                        elif now - idle_since >= idle_exit:
                            st.early_exits += st.completed < expected
                            return
                        await asyncio.sleep(recheck_pause)
                        continue
                    empties = 0
                    if handle is not None:
                        for row in got:
                            handle(row)
                        st.handled += len(got)
                    ids = [r[0] for r in got]
                    try:
                        done = await self.acomplete(conn, ids)
                    except Exception as exc:
                        st.note("complete", exc)
                        continue
                    finally:
                        st.complete_calls += 1
                    st.finish(idx, ids, done)

            if hooks.on_start is not None:
                hooks.on_start()
            st.t0 = time.perf_counter()
            await asyncio.gather(*(work(i, c) for i, c in enumerate(conns)))
        finally:
            result = st.result()
            if hooks.on_end is not None:
                hooks.on_end()
            for c in conns:
                with contextlib.suppress(Exception):
                    await c.execute("SELECT pg_stat_force_next_flush()")
                if hooks.on_close is not None:
                    hooks.on_close(c)
                await c.close()
        return result

    def _drain_threads(self, queue: str, expected: int, workers: int, batch: int,
                       handle: Callable[[Row], object] | None, idle_exit: float, recheck_pause: float,
                       hooks: _Hooks) -> Drained:
        conns = [self.connect() for _ in range(workers)]
        st = _DrainState(workers)
        lock = threading.Lock()
        start = threading.Barrier(workers + 1)
        try:
            for c in conns:
                self._warm(c)
                if hooks.on_connect is not None:
                    hooks.on_connect(c)

            def work(idx: int, conn: psycopg.Connection[Any]) -> None:
                start.wait()
                empties, idle_since = 0, 0.0
                calls = empty = handled = completes = 0
                try:
                    while st.completed < expected:
                        calls += self._calls_per_claim()
                        try:
                            got = self.claim(conn, queue, batch)
                        except Exception as exc:
                            with lock:
                                st.note("claim", exc)
                            time.sleep(recheck_pause)
                            continue
                        if not got:
                            empty += 1
                            empties += 1
                            now = time.perf_counter()
                            if empties == 1:
                                idle_since = now
                            elif now - idle_since >= idle_exit:
                                with lock:
                                    st.early_exits += st.completed < expected
                                return
                            time.sleep(recheck_pause)
                            continue
                        empties = 0
                        if handle is not None:
                            for row in got:
                                handle(row)
                            handled += len(got)
                        ids = [r[0] for r in got]
                        completes += 1
                        try:
                            done = self.complete(conn, ids)
                        except Exception as exc:
                            with lock:
                                st.note("complete", exc)
                            continue
                        with lock:
                            st.finish(idx, ids, done)
                finally:
                    with lock:
                        st.claim_calls += calls
                        st.empty += empty
                        st.handled += handled
                        st.complete_calls += completes

            threads = [threading.Thread(target=work, args=(i, c), daemon=True) for i, c in enumerate(conns)]
            for t in threads:
                t.start()
            if hooks.on_start is not None:
                hooks.on_start()
            start.wait()
            st.t0 = time.perf_counter()
            for t in threads:
                t.join()
        finally:
            result = st.result()
            if hooks.on_end is not None:
                hooks.on_end()
            for c in conns:
                with contextlib.suppress(Exception):
                    c.execute("SELECT pg_stat_force_next_flush()")
                if hooks.on_close is not None:
                    hooks.on_close(c)
                c.close()
        return result

    # -- pickup -------------------------------------------------------------------------------
    def pickup_workers(self, queue: str, on_job: Callable[[Row], object], *, workers: int = 16,
                       batch: int = 10, poll_interval: float = 1.0,
                       on_claim: ClaimHook | None = None) -> PickupWorkers:
        """Workers woken by ``LISTEN`` that claim ``batch`` jobs of ``queue``, call ``on_job``
        for each and complete them, until :meth:`PickupWorkers.stop`. Started before return
        (connections open, statements prepared, ``LISTEN`` active). ``on_claim(sent,
        returned, rows)`` is told of each claim that returned jobs (``time.perf_counter``
        before it was sent and after it came back), before the jobs' ``on_job``."""
        return PickupWorkers(self, queue, on_job, workers, batch, poll_interval, on_claim)


@dataclass(frozen=True)
class _Hooks:
    on_connect: Callable[[Any], None] | None
    on_close: Callable[[Any], None] | None
    on_start: Callable[[], None] | None
    on_end: Callable[[], None] | None


class _DrainState:
    """Counters of one drain (asyncio: one thread; threads: under the drain's lock)."""

    def __init__(self, workers: int) -> None:
        self.ids: list[int] = []
        self.completed = 0
        self.claim_calls = self.empty = self.handled = self.complete_calls = self.early_exits = 0
        self.errors: dict[str, int] = {}
        self.per_worker = [0] * workers
        self.t0 = 0.0
        self.last = 0.0

    def note(self, call: str, exc: Exception) -> None:
        key = f"{call}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        self.errors[key] = self.errors.get(key, 0) + 1

    def finish(self, idx: int, ids: list[int], done: int) -> None:
        if done != len(ids):
            self.note("complete", RuntimeError(f"deleted {done} of {len(ids)} claimed jobs"))
        self.ids.extend(ids)
        self.completed += len(ids)
        self.per_worker[idx] += len(ids)
        self.last = time.perf_counter()

    def result(self) -> Drained:
        end = time.perf_counter()
        return Drained(jobs=len(self.ids), seconds=(self.last or end) - self.t0, wall_seconds=end - self.t0,
                       ids=self.ids, claim_calls=self.claim_calls, empty_claims=self.empty,
                       complete_calls=self.complete_calls, handled=self.handled,
                       early_exits=self.early_exits, errors=self.errors, per_worker=self.per_worker)


class _Tokens:
    """Wake-up tokens of the asyncio workers: each notification gives one (at most ``cap``
    are kept), each waiting worker takes one."""

    def __init__(self, cap: int) -> None:
        self._cap = cap
        self._n = 0
        self._waiters: list[asyncio.Future[None]] = []

    def give(self) -> None:
        while self._waiters:
            w = self._waiters.pop(0)
            if not w.done():
                w.set_result(None)
                return
        self._n = min(self._n + 1, self._cap)

    def give_all(self) -> None:
        self._n = self._cap
        for w in self._waiters:
            if not w.done():
                w.set_result(None)
        self._waiters.clear()

    async def take(self, timeout: float) -> bool:
        """True when a token was taken, False after ``timeout`` seconds without one."""
        if self._n > 0:
            self._n -= 1
            return True
        w: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(w)
        try:
            await asyncio.wait_for(w, timeout)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            if w in self._waiters:
                self._waiters.remove(w)


class Producer:
    """One autocommit connection enqueueing single jobs: each call is one prepared
    statement that inserts the row and queues its wake-up, committed in one round trip."""

    def __init__(self, queue: ClassicPsycopg) -> None:
        self._q = queue
        self._conn = queue.connect()

    def enqueue(self, queue: str, kind: str, priority: int, payload: Any) -> int:
        row = self._conn.execute(self._q.sql_insert,
                                 (queue, kind, priority, json.dumps(payload, separators=(",", ":"))),
                                 prepare=True).fetchone()
        assert row is not None
        return int(row[0])

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PickupWorkers:
    """Workers of :meth:`ClassicPsycopg.pickup_workers`, running until :meth:`stop`.

    asyncio: one event loop on a thread of its own runs the workers and the listener;
    threads: one thread per worker and one for the listener. Each notification is a token
    that wakes one waiting worker (at most ``workers`` tokens are kept); a worker whose
    claim came back full claims again at once, otherwise it waits for a token or
    ``poll_interval`` seconds."""

    def __init__(self, q: ClassicPsycopg, queue: str, on_job: Callable[[Row], object], workers: int,
                 batch: int, poll_interval: float, on_claim: ClaimHook | None = None) -> None:
        self._q, self._queue, self._on_job, self._on_claim = q, queue, on_job, on_claim
        self._workers, self._batch, self._poll = workers, batch, poll_interval
        self.claim_calls = self.empty_claims = self.completed = self.notifications = 0
        self.wakes_notify = self.wakes_poll = 0
        self.errors: dict[str, int] = {}
        self._ready = threading.Event()
        self._failed: BaseException | None = None
        self._lock = threading.Lock()
        if q.driver == "asyncio":
            self._loop = asyncio.new_event_loop()
            self._astop: asyncio.Event | None = None
            self._thread = threading.Thread(target=self._run_loop, name="classic-pg-loop", daemon=True)
            self._thread.start()
        else:
            self._tstop = threading.Event()
            self._tokens = 0
            self._cond = threading.Condition()
            self._threads: list[threading.Thread] = []
            self._start_threads()
        self._ready.wait(60)
        if self._failed is not None:
            raise RuntimeError("classic workers failed to start") from self._failed

    def _note(self, call: str, exc: Exception) -> None:
        key = f"{call}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        with self._lock:
            self.errors[key] = self.errors.get(key, 0) + 1

    def _handle(self, got: list[Row], sent: float) -> list[int]:
        if self._on_claim is not None:
            self._on_claim(sent, time.perf_counter(), got)
        for row in got:
            self._on_job(row)
        return [r[0] for r in got]

    # asyncio ------------------------------------------------------------------------------
    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._amain())
        except BaseException as exc:
            self._failed = exc
            self._ready.set()
        finally:
            self._loop.close()

    async def _amain(self) -> None:
        q = self._q
        stop = self._astop = asyncio.Event()
        tokens = _Tokens(self._workers)
        listener = await psycopg.AsyncConnection.connect(q.conninfo, autocommit=True)
        await listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(q.channel)))
        conns = [await psycopg.AsyncConnection.connect(q.conninfo, autocommit=True)
                 for _ in range(self._workers)]
        for c in conns:
            await q._awarm(c)

        async def listen() -> None:
            while not stop.is_set():
                async for _ in listener.notifies(timeout=0.2):
                    self.notifications += 1
                    tokens.give()

        async def wait_token() -> bool:
            return await tokens.take(self._poll)

        async def work(conn: psycopg.AsyncConnection[Any]) -> None:
            while not stop.is_set():
                sent = time.perf_counter()
                try:
                    got = await q.aclaim(conn, self._queue, self._batch)
                except Exception as exc:
                    self._note("claim", exc)
                    got = []
                self.claim_calls += 1
                if got:
                    ids = self._handle(got, sent)
                    try:
                        self.completed += await q.acomplete(conn, ids)
                    except Exception as exc:
                        self._note("complete", exc)
                    if len(got) >= self._batch:
                        continue
                else:
                    self.empty_claims += 1
                if stop.is_set():
                    break
                woke = await wait_token()
                if woke:
                    self.wakes_notify += 1
                else:
                    self.wakes_poll += 1

        tasks = [asyncio.ensure_future(listen())] + [asyncio.ensure_future(work(c)) for c in conns]
        self._ready.set()
        await stop.wait()
        tokens.give_all()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in [listener, *conns]:
            await c.close()

    # threads ------------------------------------------------------------------------------
    def _start_threads(self) -> None:
        q = self._q
        listener = q.connect()
        listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(q.channel)))
        conns = [q.connect() for _ in range(self._workers)]
        for c in conns:
            q._warm(c)

        def listen() -> None:
            try:
                while not self._tstop.is_set():
                    for _ in listener.notifies(timeout=0.2):
                        with self._cond:
                            self.notifications += 1
                            self._tokens = min(self._tokens + 1, self._workers)
                            self._cond.notify()
            finally:
                listener.close()

        def wait_token() -> bool:
            with self._cond:
                if self._cond.wait_for(lambda: self._tokens > 0 or self._tstop.is_set(), self._poll):
                    if self._tokens > 0:
                        self._tokens -= 1
                    return True
                return False

        def work(conn: psycopg.Connection[Any]) -> None:
            try:
                while not self._tstop.is_set():
                    sent = time.perf_counter()
                    try:
                        got = q.claim(conn, self._queue, self._batch)
                    except Exception as exc:
                        self._note("claim", exc)
                        got = []
                    done = 0
                    if got:
                        ids = self._handle(got, sent)
                        try:
                            done = q.complete(conn, ids)
                        except Exception as exc:
                            self._note("complete", exc)
                    with self._lock:
                        self.claim_calls += 1
                        self.completed += done
                        self.empty_claims += not got
                    if len(got) >= self._batch:
                        continue
                    woke = wait_token()
                    with self._lock:
                        if woke:
                            self.wakes_notify += 1
                        else:
                            self.wakes_poll += 1
            finally:
                conn.close()

        self._threads = [threading.Thread(target=listen, daemon=True)]
        self._threads += [threading.Thread(target=work, args=(c,), daemon=True) for c in conns]
        for t in self._threads:
            t.start()
        self._ready.set()

    def stop(self) -> None:
        """Stop the workers (a claim in flight finishes) and close their connections."""
        if self._q.driver == "asyncio":
            if self._astop is not None:
                self._loop.call_soon_threadsafe(self._astop.set)
            self._thread.join(30)
        else:
            self._tstop.set()
            with self._cond:
                self._cond.notify_all()
            for t in self._threads:
                t.join(30)

    def __enter__(self) -> PickupWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def libpq_url(url: str) -> str:
    """A libpq connection string for ``url`` (a SQLAlchemy ``postgresql+psycopg://`` URL
    loses its driver suffix)."""
    return re.sub(r"^postgresql\+\w+://", "postgresql://", url)


# -- the comparison of variants ---------------------------------------------------------------
def _workload(n: int, queue: str) -> list[Job]:
    return [(queue, "bench_job", 2, {"n": i, "payload": "x" * 16}) for i in range(n)]


def _one_drain(url: str, driver: str, claim: str, args: argparse.Namespace) -> dict[str, Any]:
    q = ClassicPsycopg(url, args.schema, driver=driver, claim=claim)
    q.create()
    try:
        q.enqueue_copy(_workload(args.jobs, "bench"))
        cpu0 = time.process_time()
        d = q.drain("bench", args.jobs, workers=args.workers, batch=args.batch,
                    handle=lambda row: None)
        cpu = time.process_time() - cpu0
        left = q.count("bench")
    finally:
        q.drop()
    problems = []
    if d.jobs != args.jobs or d.duplicates or left:
        problems.append(f"drained {d.jobs} of {args.jobs}, {d.duplicates} duplicates, {left} left")
    if d.errors:
        problems.append(f"errors: {d.errors}")
    return {"driver": driver, "claim": claim, "jobs_per_s": d.jobs_per_s, "seconds": d.seconds,
            "cpu_us_per_job": cpu / max(d.jobs, 1) * 1e6, "claims": d.claim_calls,
            "empty": d.empty_claims, "problems": problems}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="postgresql://postgres@127.0.0.1:5432/bench_worker")
    p.add_argument("--schema", default=DEFAULT_SCHEMA)
    p.add_argument("--jobs", type=int, default=20_000)
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--batch", type=int, default=10)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--driver", choices=DRIVERS, default="threads")
    p.add_argument("--claim", choices=CLAIM_MODES, default="update")
    p.add_argument("--compare", action="store_true",
                   help="drain with every driver and claim variant, side by side, each round")
    p.add_argument("--json", help="write the results to this file")
    args = p.parse_args(argv)
    variants = ([(d, c) for c in CLAIM_MODES for d in ("asyncio", "threads")] if args.compare
                else [(args.driver, args.claim)])
    results: list[dict[str, Any]] = []
    for rnd in range(1, args.rounds + 1):
        # each round starts with the next variant, so none always runs first
        shift = (rnd - 1) % len(variants)
        for driver, claim in variants[shift:] + variants[:shift]:
            r = _one_drain(args.url, driver, claim, args)
            r["round"] = rnd
            results.append(r)
            print(f"round {rnd} {driver:>7}/{claim:<6} {r['jobs_per_s']:>9,.0f} jobs/s  "
                  f"{r['cpu_us_per_job']:5.1f} us CPU/job  claims {r['claims']} "
                  f"(empty {r['empty']})  {'; '.join(r['problems']) or 'ok'}", flush=True)
    # the host's speed moves between rounds: compare variants by their ratio within a round
    ref = variants[0]
    base = {r["round"]: r["jobs_per_s"] for r in results if (r["driver"], r["claim"]) == ref}
    print(f"\nmedians (and the median of the per-round ratio to {ref[0]}/{ref[1]}):")
    for driver, claim in variants:
        rs = [r for r in results if (r["driver"], r["claim"]) == (driver, claim)]
        rel = statistics.median(r["jobs_per_s"] / base[r["round"]] for r in rs)
        print(f"  {driver:>7}/{claim:<6} {statistics.median(r['jobs_per_s'] for r in rs):>9,.0f} jobs/s  "
              f"{rel:5.2f}x  {statistics.median(r['cpu_us_per_job'] for r in rs):5.1f} us CPU/job")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results}, f, indent=2)
    return 1 if any(r["problems"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
