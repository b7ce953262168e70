"""Side-by-side storage benchmark: qstore against the in-repo classic queue.

One run, one PostgreSQL, identical workload for both systems. Three modes (``--mode``):

``drain`` (default) — the tuned drain. For each phase (``clean``, then ``pinned``) and each
system:

1. fresh schema; enqueue N jobs with the batch INSERT path (timed), one chunk per transaction;
2. fresh schema again; enqueue the same N jobs with COPY (timed) — these are the jobs drained;
   then warm every pooled connection: each one claims and completes a batch of a separate
   warm-up queue (so the drain measures steady state, not each new session's first
   planning of the statements — qstore's PL/pgSQL functions also compile on first use);
   the classic table is vacuumed afterwards so the warm-up leaves it no dead tuples;
   ``--no-warmup`` skips this;
3. ``pinned`` only: a separate session runs ``BEGIN; SELECT txid_current();`` and stays idle
   in that transaction until step 5 is done;
4. drain with W threads looping claim(batch) + complete (one transaction each: by default
   each call gets the Engine and is the system's own transaction, ``--transactions explicit``
   wraps it in BEGIN/COMMIT on the thread's connection); every job must be claimed
   exactly once (count == N, no duplicate id);
5. dead tuples per table family (``pgstattuple`` when available, else ``n_dead_tup``).

Then ratios and the targets (PASS/FAIL).

``natural`` — what a user's first worker loop does, qstore with its defaults. Per phase and
system, on one fresh schema: (a) one thread enqueues single jobs back to back for
``--enqueue-seconds`` into a queue of their own, each its own transaction from the Engine
(qstore ``enqueue(engine, job)``, the classic queue one autocommitted
``INSERT``, no trigger); (b) N jobs are enqueued into the drained queue (COPY, not a
target), the pool is warmed as in ``drain``, the horizon pinned in ``pinned``, and 16
threads drain them: claim 10 from the Engine (qstore ``claim_runtime_batch(engine, queue,
10)``, classic its claim statement), call a no-op Python handler per job, then complete the
batch in one call (qstore ``complete_runtime_batch(engine, jobs)``, classic its ``DELETE``).
Claim or completion errors are counted and reported, not fatal; every job must still be
drained exactly once.

``steady`` — pickup latency under a paced producer. Per phase and system: ``--producers``
threads sharing one schedule enqueue single jobs (each its own transaction from the Engine)
at ``--rate`` jobs/s for ``--duration`` seconds (after
``--steady-warmup`` seconds whose jobs are not measured); ``--workers`` threads sleep until
woken by LISTEN/NOTIFY (one dedicated LISTEN session per pool; each notification wakes one
waiting worker; ``--poll-interval`` is the polling fallback), claim ``--batch``, record the
handler start per job and complete the batch. qstore notifies
``config.notify_channel(queue)`` on every enqueue commit; the classic queue gets a
statement-level ``AFTER INSERT`` trigger that does ``pg_notify`` (its enqueue stays one
statement). Pickup latency = handler start - the clock read right after the enqueue call
returned (one process, one clock). The producer must hold the offered rate. qstore's
Maintainer runs meanwhile only with ``--maintainer``.

Examples::

    python scripts/bench_storage.py --jobs 20000 --threads 16 --batch 32 --json bench.json
    python scripts/bench_storage.py --mode natural --json natural.json
    python scripts/bench_storage.py --mode natural --jobs 100000 --phases pinned --rounds 1
    python scripts/bench_storage.py --mode steady --rate 500 --duration 60 --json steady.json
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _benchlib import (
    PickupResult,
    ServerMeter,
    Waker,
    checkpoint,
    dead_tuples,
    drain,
    ensure_database,
    ensure_pgstattuple,
    finish,
    format_table,
    latency_summary,
    make_engine,
    median,
    paced_pickup,
    per_job,
    pinned,
    server_info,
    timed_enqueue,
    timed_single_enqueue,
    verdict,
)
from classic_queue import ClassicQueue

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/bench_storage"
QUEUE = "bench"
# sorts before QUEUE and is enqueued before the measured jobs: every key the drain appends
# (job ids, queue names) stays the largest in its index, as without a warm-up
WARMUP_QUEUE = "a_warmup"
SINGLE_QUEUE = "single"  # natural mode's single-job enqueues (never claimed)
KIND = "bench_job"
PRIORITY = 2
PHASES = ("clean", "pinned")
MODES = ("drain", "natural", "steady")
# per-mode defaults of the options that differ between modes
MODE_DEFAULTS: dict[str, dict[str, Any]] = {
    "drain": {"batch": 32, "rounds": 3},
    "natural": {"batch": 10, "rounds": 3},
    "steady": {"batch": 10, "rounds": 1},
}
NATURAL_LONG_DRAIN = 100_000  # jobs: from here on the long-drain target applies

TARGETS = {
    "clean_drain_ratio": 0.8,  # qstore / classic, >=
    "pinned_drain_ratio": 1.2,  # qstore / classic, >=
    "copy_enqueue_jobs_per_s": 30_000,  # qstore, >=
    "pinned_dead_pct": 5.0,  # qstore dead / classic dead, <= (percent)
}
NATURAL_TARGETS = {
    "single_enqueue_ratio": 0.8,  # qstore / classic, >=
    "natural_clean_drain_ratio": 0.6,  # qstore / classic, >=, 20,000 jobs
    "natural_pinned_drain_ratio": 1.2,  # qstore / classic, >=, 20,000 jobs
    "natural_pinned_drain_ratio_100k": 1.5,  # qstore / classic, >=, 100,000 jobs
}
STEADY_TARGETS = {
    "clean_pickup_p95_ms": 5.0,  # qstore, <=, producer holding the offered rate
    "pinned_pickup_p95_ms": 10.0,  # qstore, <=, producer holding the offered rate
}
HOLDS_RATE = 0.99  # the producer holds the offered rate when it enqueued >= 99 % of it

Job = tuple[str, str, int, dict[str, Any]]  # (queue, kind, priority, args)


def one_job(i: int, queue: str = QUEUE) -> Job:
    return (queue, KIND, PRIORITY, {"n": i, "payload": "x" * 16})


def workload(n: int, queue: str = QUEUE) -> list[Job]:
    return [one_job(i, queue) for i in range(n)]


def handler(job: Any) -> None:
    """The natural loop's job handler: a real Python call per job that does nothing."""
    return None


# -- systems under test -----------------------------------------------------------------
@contextlib.contextmanager
def autocommit(engine: Engine) -> Iterator[Connection]:
    """A pooled connection on which every statement is its own transaction."""
    with engine.connect() as conn:
        yield conn.execution_options(isolation_level="AUTOCOMMIT")


class ClassicSystem:
    name = "classic"

    def __init__(self, schema: str) -> None:
        self.q = ClassicQueue(schema)
        self.schema = schema
        self.notify_channel = f"classic:{schema}"

    def fresh(self, engine: Engine, notify: bool = False) -> None:
        """Drop and recreate the schema; ``notify`` adds the NOTIFY-on-insert trigger."""
        with engine.begin() as conn:
            self.q.drop(conn)
            self.q.create(conn, self.notify_channel if notify else None)

    def drop(self, engine: Engine) -> None:
        with engine.begin() as conn:
            self.q.drop(conn)

    def convert(self, jobs: Sequence[Job]) -> Sequence[Any]:
        return jobs

    def enqueue_copy(self, conn: Connection, jobs: Sequence[Any]) -> int:
        return self.q.enqueue_copy(conn, jobs)

    def enqueue_insert(self, conn: Connection, jobs: Sequence[Any]) -> int:
        return self.q.enqueue_insert(conn, jobs)

    def enqueue_one(self, engine: Engine, i: int, queue: str = QUEUE) -> int:
        """Job ``i`` alone: one INSERT, its own (autocommitted) transaction."""
        with autocommit(engine) as conn:
            return self.q.enqueue_insert(conn, [one_job(i, queue)])

    @staticmethod
    def seq_of(job: Any) -> int:
        return int(job.args["n"])

    def claim(self, target: Connection | Engine, batch: int, queue: str = QUEUE) -> Sequence[Any]:
        if isinstance(target, Engine):  # own transaction: one autocommitted statement
            with autocommit(target) as conn:
                return self.q.claim(conn, queue, batch)
        return self.q.claim(target, queue, batch)

    def complete(self, target: Connection | Engine, claimed: Sequence[Any]) -> int:
        if isinstance(target, Engine):
            with autocommit(target) as conn:
                return self.q.complete(conn, [j.id for j in claimed])
        return self.q.complete(target, [j.id for j in claimed])

    @staticmethod
    def ids_of(claimed: Sequence[Any]) -> list[int]:
        return [j.id for j in claimed]

    def settle(self, engine: Engine) -> None:
        """Remove what the warm-up left behind (its claimed-and-deleted rows)."""
        with autocommit(engine) as conn:
            conn.exec_driver_sql(f'VACUUM "{self.schema}".jobs')


class QstoreSystem:
    name = "qstore"

    def __init__(self, schema: str, shards: int | None = None,
                 deadline: timedelta | None = timedelta(minutes=5)) -> None:
        """``deadline``: the attempt deadline every claim sets (None: the claim's default,
        no deadline)."""
        from qstore import InsertOpts, InsertParams
        from qstore.config import QueueStorageConfig
        from qstore.storage import QueueStorage

        self.storage = QueueStorage(QueueStorageConfig(schema=schema))
        self.schema = schema
        self.shards = shards
        self._params = InsertParams
        self._opts_type = InsertOpts
        self._deadline = deadline
        self._opts = InsertOpts(queue=QUEUE, priority=PRIORITY)
        self.notify_channel = self.storage.config.notify_channel(QUEUE)
        for method in ("enqueue_params_copy", "enqueue_params_batch",
                       "claim_runtime_batch", "complete_runtime_batch"):
            if not hasattr(self.storage, method):
                raise RuntimeError(f"QueueStorage has no {method}()")

    def fresh(self, engine: Engine, notify: bool = False) -> None:
        """Drop and reinstall the schema (every enqueue notifies, ``notify`` or not)."""
        self.storage.reset(engine)
        self.storage.prepare_schema(engine)
        # pooled sessions may hold prepared statements that name types of the dropped schema
        engine.dispose()
        if self.shards is not None:  # None: the install's default (eight lanes per priority)
            self.storage.set_queue_options(engine, QUEUE, enqueue_shards=self.shards)

    def drop(self, engine: Engine) -> None:
        self.storage.reset(engine)

    def convert(self, jobs: Sequence[Job]) -> Sequence[Any]:
        opts: dict[tuple[str, int], Any] = {}
        return [self._params(kind, args, opts.get((q, p)) or opts.setdefault(
                    (q, p), self._opts_type(queue=q, priority=p)))
                for q, kind, p, args in jobs]

    def enqueue_copy(self, conn: Connection, jobs: Sequence[Any]) -> int:
        return self.storage.enqueue_params_copy(conn, list(jobs))

    def enqueue_insert(self, conn: Connection, jobs: Sequence[Any]) -> int:
        return self.storage.enqueue_params_batch(conn, list(jobs))

    def enqueue_one(self, engine: Engine, i: int, queue: str = QUEUE) -> int:
        """Job ``i`` alone: ``enqueue(engine, job)``, one autocommitted statement."""
        _, kind, _, args = one_job(i)
        opts = self._opts if queue == QUEUE else self._opts_type(queue=queue, priority=PRIORITY)
        return self.storage.enqueue(engine, self._params(kind, args, opts))

    @staticmethod
    def seq_of(claimed: Any) -> int:
        return int(claimed.job.args["n"])

    def claim(self, target: Connection | Engine, batch: int, queue: str = QUEUE) -> Sequence[Any]:
        # an Engine target is qstore's own-transaction mode
        if self._deadline is None:
            return self.storage.claim_runtime_batch(target, queue, batch)
        return self.storage.claim_runtime_batch(target, queue, batch, self._deadline)

    def complete(self, target: Connection | Engine, claimed: Sequence[Any]) -> int:
        return len(self.storage.complete_runtime_batch(target, list(claimed)))

    @staticmethod
    def ids_of(claimed: Sequence[Any]) -> list[int]:
        return [c.job.id for c in claimed]

    def settle(self, engine: Engine) -> None:
        """Nothing to clean: the warm-up's rows are appended ring entries, none dead."""


# -- one measurement ----------------------------------------------------------------------
def as_count(value: Any) -> int:
    """Enqueue methods return a count; tolerate a list of ids as well."""
    return len(value) if isinstance(value, (list, tuple)) else int(value)


def enqueue_warmup(engine: Engine, system: Any, batch: int) -> None:
    """The warm-up queue's jobs: one batch per pooled connection."""
    with engine.begin() as conn:
        system.enqueue_copy(conn, system.convert(workload(engine.pool.size() * batch,  # type: ignore[attr-defined]
                                                          WARMUP_QUEUE)))


def warm_pool(engine: Engine, system: Any, batch: int) -> None:
    """Claim and complete one batch of the warm-up queue on every pooled connection (all
    checked out at once, so each is a different server session), then let the system clean
    up after it. The measured queue is not touched."""
    size = engine.pool.size()  # type: ignore[attr-defined]
    conns = [engine.connect() for _ in range(size)]
    try:
        for conn in conns:
            with conn.begin():
                got = system.claim(conn, batch, WARMUP_QUEUE)
            with conn.begin():
                system.complete(conn, got)
    finally:
        for conn in conns:
            conn.close()
    system.settle(engine)


def load_for_drain(engine: Engine, system: Any, prepared: Sequence[Any],
                   args: argparse.Namespace, fresh: bool = True) -> dict[str, float]:
    """Fresh schema (unless ``fresh`` is false), the warm-up queue's jobs (``--warmup``),
    then the ``prepared`` jobs with COPY (timed); then warm every pooled session. Returns
    the COPY's figures."""
    n = len(prepared)
    if fresh:
        system.fresh(engine)
    if args.warmup:
        enqueue_warmup(engine, system, args.batch)
    checkpoint(engine)
    secs, wrote = timed_enqueue(
        engine, lambda c, b: as_count(system.enqueue_copy(c, b)), prepared, args.enqueue_chunk
    )
    if wrote != n:
        raise RuntimeError(f"{system.name}: COPY wrote {wrote} of {n} jobs")
    if args.warmup:
        warm_pool(engine, system, args.batch)
    return {"seconds": secs, "jobs_per_s": n / secs}


def measured_drain(engine: Engine, system: Any, phase: str, n: int, args: argparse.Namespace,
                   exact_dead: bool, *, own_transactions: bool,
                   handle: Callable[[Any], object] | None = None,
                   tolerate_errors: bool = False,
                   after_drain: Callable[[], object] | None = None,
                   wal_detail: bool = False) -> dict[str, Any]:
    """Drain the ``n`` loaded jobs (horizon pinned in phase ``pinned``, from before the
    drain until the dead tuples are counted) and check that every job was drained exactly
    once. Returns the ``drain`` (with the server's and the client's cost per job, see
    ``_benchlib.ServerMeter``), ``server``, ``dead_tuples``, ``dead_total`` and ``problems``
    entries. ``after_drain`` is called as soon as the last worker has stopped;
    ``wal_detail`` adds where the WAL went (``server.wal_by_relation``)."""
    res: dict[str, Any] = {}
    meter = ServerMeter(engine, breakdown=wal_detail)
    with pinned(engine, phase == "pinned") as pin:
        if pin is not None:
            res["pinned_xid"] = pin.xid
        meter.start()
        cpu0 = time.process_time()
        d = drain(
            engine,
            threads=args.threads,
            claim=lambda c: system.claim(c, args.batch),
            complete=system.complete,
            ids_of=system.ids_of,
            expected=n,
            idle_exit=args.idle_exit,
            own_transactions=own_transactions,
            handle=handle,
            tolerate_errors=tolerate_errors,
        )
        cpu = time.process_time() - cpu0
        if after_drain is not None:
            after_drain()
        use = meter.stop(engine)
        with engine.connect() as conn, conn.begin():
            leftover = len(system.claim(conn, args.batch))
        dead = dead_tuples(engine, system.schema, exact_dead)

    problems = []
    if d.jobs != n:
        problems.append(f"drained {d.jobs} of {n} jobs")
    if leftover:
        problems.append(f"{leftover} jobs still claimable after the drain")
    if d.duplicates:
        problems.append(f"{d.duplicates} duplicate job ids claimed")
    res["drain"] = {
        "jobs": d.jobs,
        "seconds": d.seconds,
        "wall_seconds": d.wall_seconds,
        "jobs_per_s": d.jobs_per_s,
        "duplicates": d.duplicates,
        "claim_calls": d.claim_calls,
        "empty_claims": d.empty_claims,
        "early_exits": d.early_exits,
        "per_thread_min": min(d.per_thread),
        "per_thread_max": max(d.per_thread),
        # WAL, server time and CPU, server transactions and the client's CPU, per job
        **per_job(use, d.jobs, cpu - use["sampler_cpu_s"]),
    }
    if handle is not None:
        res["drain"]["handled"] = d.handled
    if tolerate_errors:
        res["drain"]["errors"] = d.errors
    res["server"] = use
    res["dead_tuples"] = dead
    res["dead_total"] = sum(f["dead"] for f in dead.values())
    res["problems"] = problems
    return res


def run_one(engine: Engine, system: Any, phase: str, jobs: Sequence[Job], args: argparse.Namespace,
            exact_dead: bool) -> dict[str, Any]:
    """The tuned drain (``--mode drain``) of one system in one phase."""
    n = len(jobs)
    prepared = system.convert(jobs)
    res: dict[str, Any] = {"system": system.name, "phase": phase, "jobs": n}

    system.fresh(engine)
    checkpoint(engine)
    secs, wrote = timed_enqueue(
        engine, lambda c, b: as_count(system.enqueue_insert(c, b)), prepared, args.enqueue_chunk
    )
    if wrote != n:
        raise RuntimeError(f"{system.name}: batch INSERT wrote {wrote} of {n} jobs")
    res["insert_enqueue"] = {"seconds": secs, "jobs_per_s": n / secs}

    res["copy_enqueue"] = load_for_drain(engine, system, prepared, args)
    res.update(measured_drain(engine, system, phase, n, args, exact_dead,
                              own_transactions=args.transactions == "own"))
    return res


def run_natural(engine: Engine, system: Any, phase: str, jobs: Sequence[Job],
                args: argparse.Namespace, exact_dead: bool) -> dict[str, Any]:
    """``--mode natural`` for one system in one phase: single-job enqueue from one thread,
    then the natural drain loop (Engine target, no-op handler per job, one completion call
    per claim); the horizon is pinned during both in phase ``pinned``."""
    n = len(jobs)
    res: dict[str, Any] = {"mode": "natural", "system": system.name, "phase": phase, "jobs": n}

    system.fresh(engine, notify=args.classic_notify)
    checkpoint(engine)
    with pinned(engine, phase == "pinned"):
        res["single_enqueue"] = timed_single_enqueue(
            lambda i: system.enqueue_one(engine, i, SINGLE_QUEUE), args.enqueue_seconds)
    # the drained jobs go to their own queue of the same schema: one install per measurement
    res["copy_enqueue"] = load_for_drain(engine, system, system.convert(jobs), args, fresh=False)
    res.update(measured_drain(engine, system, phase, n, args, exact_dead, own_transactions=True,
                              handle=handler, tolerate_errors=True))
    errors = res["drain"]["errors"]
    if errors:
        res["errors"] = errors
    return res


def run_steady(engine: Engine, system: Any, phase: str, args: argparse.Namespace,
               exact_dead: bool) -> dict[str, Any]:
    """``--mode steady`` for one system in one phase: paced single-job producer, workers
    woken by LISTEN/NOTIFY, pickup latency per job; the horizon is pinned for the whole
    run (and the final checks) in phase ``pinned``."""
    res: dict[str, Any] = {"mode": "steady", "system": system.name, "phase": phase,
                           "channel": system.notify_channel}
    system.fresh(engine, notify=True)
    checkpoint(engine)
    with Waker(engine, system.notify_channel, args.workers) as waker, \
            upkeep(engine, system, args.maintainer), \
            pinned(engine, phase == "pinned") as pin:
        if pin is not None:
            res["pinned_xid"] = pin.xid
        p = paced_pickup(
            rate=args.rate,
            seconds=args.duration,
            warmup=args.steady_warmup,
            workers=args.workers,
            batch=args.batch,
            enqueue_one=lambda i: system.enqueue_one(engine, i),
            claim=lambda: system.claim(engine, args.batch),
            complete=lambda got: system.complete(engine, got),
            seq_of=system.seq_of,
            waker=waker,
            poll_interval=args.poll_interval,
            producers=args.producers,
        )
        with engine.connect() as conn, conn.begin():
            leftover = len(system.claim(conn, args.batch))
        dead = dead_tuples(engine, system.schema, exact_dead)
    res.update(steady_figures(p))
    problems = []
    if p.missing:
        problems.append(f"{p.missing} of {p.enqueued_total} enqueued jobs never picked up")
    if p.duplicates:
        problems.append(f"{p.duplicates} jobs picked up more than once")
    if p.completed != p.enqueued_total:
        problems.append(f"completions reported {p.completed} of {p.enqueued_total} jobs")
    if leftover:
        problems.append(f"{leftover} jobs still claimable after the run")
    res["dead_tuples"] = dead
    res["dead_total"] = sum(f["dead"] for f in dead.values())
    res["problems"] = problems
    return res


@contextlib.contextmanager
def upkeep(engine: Engine, system: Any, run: bool) -> Iterator[None]:
    """qstore's Maintainer (default schedule) running for the block when ``run``; nothing for
    the classic queue (the server's autovacuum is its upkeep)."""
    if not run or not isinstance(system, QstoreSystem):
        yield
        return
    from qstore.runtime.maintainer import Maintainer

    with Maintainer(system.storage, engine):
        yield


def steady_figures(p: PickupResult) -> dict[str, Any]:
    """The JSON-ready figures of one paced run."""
    return {
        "offered_rate": p.offered_rate,
        "achieved_rate": p.achieved_rate,
        "holds_rate": p.achieved_rate >= HOLDS_RATE * p.offered_rate,
        "window_seconds": p.window_seconds,
        "enqueued": p.enqueued,
        "enqueued_total": p.enqueued_total,
        "pickup_ms": latency_summary(p.latencies),
        "producer_lag_ms": latency_summary(p.lag_seconds),
        "enqueue_call_ms": latency_summary(p.enqueue_seconds),
        "claim_call_ms": latency_summary(p.claim_seconds),
        "handled": p.handled,
        "completed": p.completed,
        "duplicates": p.duplicates,
        "missing": p.missing,
        "claim_calls": p.claim_calls,
        "empty_claims": p.empty_claims,
        "notifications": p.notifications,
        "wakes_notify": p.wakes_notify,
        "wakes_poll": p.wakes_poll,
        "poll_claims_with_jobs": p.poll_claims_with_jobs,
        "negative_latencies": p.negative_latencies,
        "errors": p.errors,
    }


# -- report ---------------------------------------------------------------------------------
def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def fmt(x: float | None, spec: str = ",.0f") -> str:
    return "n/a" if x is None else format(x, spec)


def times(x: float | None) -> str:
    """A ratio as ``0.85x`` (``n/a`` when not measured)."""
    return "n/a" if x is None else f"{x:.2f}x"


def medians(results: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """Per (system, phase): the median of every figure over the rounds."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault((r["system"], r["phase"]), []).append(r)
    out = {}
    for key, rs in groups.items():
        out[key] = {
            "rounds": len(rs),
            "insert_jobs_per_s": median([r["insert_enqueue"]["jobs_per_s"] for r in rs]),
            "copy_jobs_per_s": median([r["copy_enqueue"]["jobs_per_s"] for r in rs]),
            "drain_jobs_per_s": median([r["drain"]["jobs_per_s"] for r in rs]),
            "drain_jobs_per_s_all": [round(r["drain"]["jobs_per_s"]) for r in rs],
            "wal_bytes_per_job": median([r["drain"]["wal_bytes_per_job"] for r in rs]),
            "dead_total": median([r["dead_total"] for r in rs]),
            "dead_total_all": [r["dead_total"] for r in rs],
        }
    return out


def summarise(results: list[dict[str, Any]]) -> dict[str, Any]:
    med = medians(results)

    def get(system: str, phase: str, key: str) -> float | None:
        m = med.get((system, phase))
        return None if m is None else m[key]

    def over_phases(system: str, key: str) -> float | None:
        return median([v for p in PHASES if (v := get(system, p, key)) is not None])

    copy_q = over_phases("qstore", "copy_jobs_per_s")
    copy_c = over_phases("classic", "copy_jobs_per_s")
    ins_q = over_phases("qstore", "insert_jobs_per_s")
    ins_c = over_phases("classic", "insert_jobs_per_s")
    clean = ratio(get("qstore", "clean", "drain_jobs_per_s"),
                  get("classic", "clean", "drain_jobs_per_s"))
    pinned = ratio(get("qstore", "pinned", "drain_jobs_per_s"),
                   get("classic", "pinned", "drain_jobs_per_s"))
    dead_q = get("qstore", "pinned", "dead_total")
    dead_c = get("classic", "pinned", "dead_total")
    dead_pct = None if dead_q is None or not dead_c else 100.0 * dead_q / dead_c

    summary = {
        "medians": {f"{s}/{p}": v for (s, p), v in med.items()},
        "copy_enqueue_jobs_per_s": {"qstore": copy_q, "classic": copy_c},
        "insert_enqueue_jobs_per_s": {"qstore": ins_q, "classic": ins_c},
        "clean_drain_ratio": clean,
        "pinned_drain_ratio": pinned,
        "copy_enqueue_ratio": ratio(copy_q, copy_c),
        "pinned_dead_pct": dead_pct,
    }
    checks = {
        "clean_drain_ratio": (clean, ">=", TARGETS["clean_drain_ratio"]),
        "pinned_drain_ratio": (pinned, ">=", TARGETS["pinned_drain_ratio"]),
        "copy_enqueue_jobs_per_s": (copy_q, ">=", TARGETS["copy_enqueue_jobs_per_s"]),
        "pinned_dead_pct": (dead_pct, "<=", TARGETS["pinned_dead_pct"]),
    }
    summary["targets"] = {key: verdict(value, op, target)
                          for key, (value, op, target) in checks.items()}
    return summary


def print_report(results: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    rows = []
    for r in results:
        d = r["drain"]
        rows.append([
            r["system"], r["phase"], r.get("round", 1), fmt(r["insert_enqueue"]["jobs_per_s"]),
            fmt(r["copy_enqueue"]["jobs_per_s"]), fmt(d["jobs_per_s"]), f"{d['seconds']:.2f}",
            d["jobs"], d["duplicates"], f"{d['claim_calls']}/{d['empty_claims']}",
            d["early_exits"], fmt(r["dead_total"]),
            "; ".join(r["problems"]) or "ok",
        ])
    print()
    print(format_table(
        ["system", "phase", "round", "INSERT j/s", "COPY j/s", "drain j/s", "drain s", "drained",
         "dups", "claims/empty", "quit early", "dead tuples", "check"],
        rows,
    ))
    print("\nMedians over the rounds:")
    print(format_table(
        ["system", "phase", "rounds", "INSERT j/s", "COPY j/s", "drain j/s", "dead tuples",
         "drain WAL B/job", "drain j/s per round"],
        [[k.split("/")[0], k.split("/")[1], m["rounds"], fmt(m["insert_jobs_per_s"]),
          fmt(m["copy_jobs_per_s"]), fmt(m["drain_jobs_per_s"]), fmt(m["dead_total"]),
          fmt(m["wal_bytes_per_job"]),
          " ".join(f"{x:,}" for x in m["drain_jobs_per_s_all"])]
         for k, m in summary["medians"].items()],
    ))
    print("\nDead tuples per table family (dead / n_dead_tup / live / kB):")
    for r in results:
        fams = sorted(r["dead_tuples"].items(), key=lambda kv: (-kv[1]["dead"], kv[0]))
        shown = [f"{k}={v['dead']}/{v['n_dead_tup']}/{v['live']}/{v['bytes'] // 1024}"
                 for k, v in fams if v["dead"] or v["n_dead_tup"] or v["live"]]
        print(f"  {r['system']:>7} {r['phase']:<6}: " + (", ".join(shown) or "(none)"))

    s = summary
    print("\nRatios (qstore / classic):")
    print(f"  drain clean          {fmt(s['clean_drain_ratio'], '.2f')}x")
    print(f"  drain pinned         {fmt(s['pinned_drain_ratio'], '.2f')}x")
    print(f"  COPY enqueue         {fmt(s['copy_enqueue_ratio'], '.2f')}x  "
          f"(qstore {fmt(s['copy_enqueue_jobs_per_s']['qstore'])} j/s, "
          f"classic {fmt(s['copy_enqueue_jobs_per_s']['classic'])} j/s)")
    print(f"  dead tuples pinned   {fmt(s['pinned_dead_pct'], '.1f')} %")
    print("\nTargets:")
    for key, v in s["targets"].items():
        value = "n/a" if v["value"] is None else (
            f"{v['value']:,.0f}" if key == "copy_enqueue_jobs_per_s" else f"{v['value']:.2f}")
        print(f"  {v['result']:<4}  {key:<24} {value:>10}  (target {v['target']})")


# -- natural mode: summary and report ------------------------------------------------------
def group(results: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault((r["system"], r["phase"]), []).append(r)
    return groups


def summarise_natural(results: list[dict[str, Any]], jobs: int) -> dict[str, Any]:
    """Medians per (system, phase) over the rounds, qstore/classic ratios per phase and the
    natural-loop targets (the 20,000-job targets below ``NATURAL_LONG_DRAIN`` jobs, the
    long-drain target from there on; the others are SKIP)."""
    med: dict[tuple[str, str], dict[str, Any]] = {}
    for key, rs in group(results).items():
        med[key] = {
            "rounds": len(rs),
            "single_enqueue_jobs_per_s": median([r["single_enqueue"]["jobs_per_s"] for r in rs]),
            "single_enqueue_p50_ms": median([r["single_enqueue"]["call_ms"]["p50_ms"] for r in rs]),
            "drain_jobs_per_s": median([r["drain"]["jobs_per_s"] for r in rs]),
            "drain_jobs_per_s_all": [round(r["drain"]["jobs_per_s"]) for r in rs],
            "wal_bytes_per_job": median([r["drain"]["wal_bytes_per_job"] for r in rs]),
            "dead_total": median([r["dead_total"] for r in rs]),
            "drain_errors": sum(sum(r["drain"]["errors"].values()) for r in rs),
        }

    def get(system: str, phase: str, key: str) -> float | None:
        m = med.get((system, phase))
        return None if m is None else m[key]

    ratios = {
        phase: {
            "single_enqueue": ratio(get("qstore", phase, "single_enqueue_jobs_per_s"),
                                    get("classic", phase, "single_enqueue_jobs_per_s")),
            "drain": ratio(get("qstore", phase, "drain_jobs_per_s"),
                           get("classic", phase, "drain_jobs_per_s")),
        }
        for phase in PHASES
    }
    single = median([v for p in PHASES if (v := ratios[p]["single_enqueue"]) is not None])
    long_drain = jobs >= NATURAL_LONG_DRAIN
    scale = None if jobs == 20_000 or long_drain else f"measured over {jobs:,} jobs; the target is for 20,000"
    t = NATURAL_TARGETS
    targets = {
        "single_enqueue_ratio": verdict(single, ">=", t["single_enqueue_ratio"]),
        "natural_clean_drain_ratio": verdict(
            None if long_drain else ratios["clean"]["drain"], ">=", t["natural_clean_drain_ratio"],
            scale),
        "natural_pinned_drain_ratio": verdict(
            None if long_drain else ratios["pinned"]["drain"], ">=",
            t["natural_pinned_drain_ratio"], scale),
        "natural_pinned_drain_ratio_100k": verdict(
            ratios["pinned"]["drain"] if long_drain else None, ">=",
            t["natural_pinned_drain_ratio_100k"],
            None if not long_drain or jobs == NATURAL_LONG_DRAIN
            else f"measured over {jobs:,} jobs; the target is for 100,000"),
    }
    return {
        "medians": {f"{k[0]}/{k[1]}": v for k, v in med.items()},
        "ratios": ratios,
        "single_enqueue_ratio": single,
        "targets": targets,
    }


def print_targets(targets: dict[str, dict[str, Any]], title: str, spec: str = ".2f") -> None:
    print(f"\nTargets ({title}):")
    for key, v in targets.items():
        value = "n/a" if v["value"] is None else format(v["value"], spec)
        note = f"  [{v['note']}]" if v.get("note") else ""
        print(f"  {v['result']:<4}  {key:<32} {value:>10}  (target {v['target']}){note}")


def print_errors(results: list[dict[str, Any]]) -> None:
    shown = [(r, k, n) for r in results for k, n in r.get("errors", {}).items()]
    if shown:
        print("\nErrors raised by calls (counted, the loop went on):")
        for r, k, n in shown:
            print(f"  {r['system']:>7} {r['phase']:<6} round {r.get('round', 1)}: {n} x {k}")


def print_natural(results: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    rows = []
    for r in results:
        d, one = r["drain"], r["single_enqueue"]
        rows.append([
            r["system"], r["phase"], r.get("round", 1), fmt(one["jobs_per_s"]),
            fmt(one["call_ms"]["p50_ms"], ".2f"), fmt(one["call_ms"]["p99_ms"], ".2f"),
            fmt(d["jobs_per_s"]), f"{d['seconds']:.2f}", d["jobs"], d["duplicates"],
            f"{d['claim_calls']}/{d['empty_claims']}", sum(d["errors"].values()),
            fmt(r["dead_total"]), "; ".join(r["problems"]) or "ok",
        ])
    print()
    print(format_table(
        ["system", "phase", "round", "single j/s", "p50 ms", "p99 ms", "drain j/s", "drain s",
         "drained", "dups", "claims/empty", "errors", "dead tuples", "check"], rows))
    print("\nMedians over the rounds:")
    print(format_table(
        ["system", "phase", "rounds", "single enqueue j/s", "drain j/s", "drain WAL B/job",
         "dead tuples", "drain j/s per round"],
        [[k.split("/")[0], k.split("/")[1], m["rounds"], fmt(m["single_enqueue_jobs_per_s"]),
          fmt(m["drain_jobs_per_s"]), fmt(m["wal_bytes_per_job"]), fmt(m["dead_total"]),
          " ".join(f"{x:,}" for x in m["drain_jobs_per_s_all"])]
         for k, m in summary["medians"].items()]))
    print("\nRatios (qstore / classic):")
    for phase, rr in summary["ratios"].items():
        print(f"  {phase:<6}  single-job enqueue {times(rr['single_enqueue'])}   "
              f"natural drain {times(rr['drain'])}")
    print_errors(results)
    print_targets(summary["targets"], "natural loop")


# -- steady mode: summary and report -------------------------------------------------------
def summarise_steady(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians per (system, phase) over the rounds and the pickup targets: qstore's p95
    within the target while its producer held the offered rate (a producer that fell
    behind fails the target whatever the latency)."""
    med: dict[tuple[str, str], dict[str, Any]] = {}
    for key, rs in group(results).items():
        med[key] = {
            "rounds": len(rs),
            **{f"pickup_{q}_ms": median([r["pickup_ms"][f"{q}_ms"] for r in rs
                                         if r["pickup_ms"][f"{q}_ms"] is not None])
               for q in ("p50", "p95", "p99", "max")},
            "achieved_rate": median([r["achieved_rate"] for r in rs]),
            "holds_rate": all(r["holds_rate"] for r in rs),
        }
    targets: dict[str, dict[str, Any]] = {}
    for phase in PHASES:
        m = med.get(("qstore", phase))
        target = f"{phase}_pickup_p95_ms"
        if m is None:
            targets[target] = verdict(None, "<=", STEADY_TARGETS[target])
            continue
        v = verdict(m["pickup_p95_ms"], "<=", STEADY_TARGETS[target],
                    None if m["holds_rate"] else
                    f"the producer did not hold the offered rate ({m['achieved_rate']:,.0f}/s)")
        if not m["holds_rate"]:
            v["result"] = "FAIL"
        targets[target] = v
    return {"medians": {f"{k[0]}/{k[1]}": v for k, v in med.items()}, "targets": targets}


def print_steady(results: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    rows = []
    for r in results:
        pk = r["pickup_ms"]
        rows.append([
            r["system"], r["phase"], r.get("round", 1),
            f"{r['achieved_rate']:,.0f}/{r['offered_rate']:,.0f}",
            "yes" if r["holds_rate"] else "NO", r["enqueued"], fmt(pk["p50_ms"], ".2f"),
            fmt(pk["p95_ms"], ".2f"), fmt(pk["p99_ms"], ".2f"), fmt(pk["max_ms"], ".1f"),
            fmt(r["enqueue_call_ms"]["p50_ms"], ".2f"), fmt(r["claim_call_ms"]["p50_ms"], ".2f"),
            f"{r['claim_calls']}/{r['empty_claims']}",
            f"{r['wakes_notify']}/{r['wakes_poll']}/{r['poll_claims_with_jobs']}",
            fmt(r["dead_total"]), "; ".join(r["problems"]) or "ok",
        ])
    print()
    print(format_table(
        ["system", "phase", "round", "rate j/s", "holds", "jobs", "pickup p50", "p95", "p99",
         "max ms", "enq p50", "claim p50", "claims/empty", "wake ntfy/poll/poll-hit",
         "dead", "check"], rows))
    print("\nProducer schedule lag (ms, p50 / p99 / max) and claim call (ms, p95 / p99):")
    for r in results:
        lag, cl = r["producer_lag_ms"], r["claim_call_ms"]
        print(f"  {r['system']:>7} {r['phase']:<6}: lag {fmt(lag['p50_ms'], '.2f')} / "
              f"{fmt(lag['p99_ms'], '.2f')} / {fmt(lag['max_ms'], '.1f')}   claim "
              f"{fmt(cl['p95_ms'], '.2f')} / {fmt(cl['p99_ms'], '.2f')}")
    print_errors(results)
    print_targets(summary["targets"], "steady pickup, qstore", ".2f")


# -- main -----------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=MODES, default="drain",
                   help="drain: the tuned drain (default); natural: a user's first worker loop "
                        "and single-job enqueue; steady: pickup latency under a paced producer")
    p.add_argument("--url", default=DEFAULT_URL,
                   help="SQLAlchemy URL (psycopg 3 driver); the database is created if missing")
    p.add_argument("--jobs", type=int, default=20_000, help="jobs drained (drain, natural)")
    p.add_argument("--threads", type=int, default=16, help="draining threads (drain, natural)")
    p.add_argument("--batch", type=int, default=None,
                   help="claim batch size (default: 32 in drain, 10 in natural and steady)")
    p.add_argument("--enqueue-chunk", type=int, default=1000,
                   help="jobs per enqueue call (and transaction)")
    p.add_argument("--rounds", type=int, default=None,
                   help="repeat every (phase, system) measurement; medians are reported "
                        "(default: 3 in drain and natural, 1 in steady)")
    p.add_argument("--idle-exit", type=float, default=1.0,
                   help="a worker stops after this many seconds of empty claims (default 1.0)")
    p.add_argument("--transactions", choices=("own", "explicit"), default="own",
                   help="drain mode: own: claim and complete get the Engine and run as their own "
                        "transaction (one autocommitted statement each where the system can); "
                        "explicit: the worker wraps each call in BEGIN/COMMIT on its connection "
                        "(natural and steady always use the Engine)")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="drain on cold pooled connections (each session plans, and qstore's "
                        "functions compile, during the timed drain)")
    p.add_argument("--enqueue-seconds", type=float, default=10.0,
                   help="natural: how long the single-job enqueue loop runs per measurement")
    p.add_argument("--rate", type=float, default=500.0,
                   help="steady: offered single-job enqueues per second")
    p.add_argument("--duration", type=float, default=60.0,
                   help="steady: measured seconds per (phase, system)")
    p.add_argument("--steady-warmup", type=float, default=2.0,
                   help="steady: seconds of producing before the measured window")
    p.add_argument("--workers", type=int, default=4, help="steady: worker threads per system")
    p.add_argument("--producers", type=int, default=4,
                   help="steady: producer threads sharing the schedule (a single-job enqueue "
                        "commits in one to a few ms here, so one thread alone cannot offer "
                        "500/s)")
    p.add_argument("--poll-interval", type=float, default=1.0,
                   help="steady: a waiting worker claims anyway after this many seconds "
                        "without a notification (polling fallback)")
    p.add_argument("--maintainer", action="store_true",
                   help="steady: run qstore's Maintainer (default schedule) during each qstore "
                        "measurement, as a deployment does")
    p.add_argument("--classic-notify", action="store_true",
                   help="natural: give the classic queue its NOTIFY-on-insert trigger for the "
                        "single-job enqueue too (qstore always notifies)")
    p.add_argument("--set", dest="settings", action="append", default=[], metavar="NAME=VALUE",
                   help="session setting for every benchmark connection, e.g. --set jit=off "
                        "(repeatable; applies to both systems)")
    p.add_argument("--skip-qstore", action="store_true")
    p.add_argument("--skip-classic", action="store_true")
    p.add_argument("--phases", default=",".join(PHASES),
                   help="comma-separated subset of clean,pinned")
    p.add_argument("--qstore-schema", default="bench_qstore")
    p.add_argument("--qstore-shards", type=int, default=None,
                   help="enqueue shards of the benchmark queue (queue_meta.enqueue_shards; "
                        "default: qstore's default, 8)")
    p.add_argument("--classic-schema", default="bench_classic")
    p.add_argument("--keep", action="store_true", help="keep the schemas after the run")
    p.add_argument("--json", type=Path, help="write the results here")
    a = p.parse_args(argv)
    for name, value in MODE_DEFAULTS[a.mode].items():
        if getattr(a, name) is None:
            setattr(a, name, value)
    a.phases = [x.strip() for x in a.phases.split(",") if x.strip()]
    for item in a.settings:
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip():
            p.error(f"--set expects NAME=VALUE, got {item!r}")
    if any(x not in PHASES for x in a.phases):
        p.error(f"--phases must be a subset of {','.join(PHASES)}")
    if min(a.jobs, a.threads, a.batch, a.enqueue_chunk, a.rounds, a.workers, a.producers) < 1:
        p.error("--jobs, --threads, --batch, --enqueue-chunk, --rounds, --workers and "
                "--producers must be >= 1")
    if min(a.enqueue_seconds, a.rate, a.duration, a.poll_interval) <= 0 or a.steady_warmup < 0:
        p.error("--enqueue-seconds, --rate, --duration and --poll-interval must be > 0, "
                "--steady-warmup >= 0")
    return a


def describe(args: argparse.Namespace, info: dict[str, Any], exact: bool,
             settings: dict[str, str]) -> str:
    """The run's header line."""
    if args.mode == "drain":
        what = (f"jobs={args.jobs} threads={args.threads} batch={args.batch} "
                f"enqueue_chunk={args.enqueue_chunk} transactions={args.transactions} "
                f"warmup={args.warmup} qstore_shards={args.qstore_shards}")
    elif args.mode == "natural":
        what = (f"mode=natural jobs={args.jobs} threads={args.threads} batch={args.batch} "
                f"enqueue_seconds={args.enqueue_seconds} warmup={args.warmup} "
                f"classic_notify={args.classic_notify} "
                f"qstore_shards={args.qstore_shards} rounds={args.rounds}")
    else:
        what = (f"mode=steady rate={args.rate:g}/s duration={args.duration:g}s "
                f"warmup={args.steady_warmup:g}s producers={args.producers} "
                f"workers={args.workers} batch={args.batch} maintainer={args.maintainer} "
                f"poll_interval={args.poll_interval:g}s qstore_shards={args.qstore_shards} "
                f"rounds={args.rounds}")
    return (f"{what} cpus={info['cpus']} "
            f"postgres={info['postgres']['server_version']} "
            f"autovacuum={info['postgres']['autovacuum']} jit={info['postgres']['jit']} "
            f"dead-tuple source={'pgstattuple' if exact else 'n_dead_tup'}"
            + (f" settings={settings}" if settings else ""))


def run_mode(engine: Engine, system: Any, phase: str, jobs: Sequence[Job],
             args: argparse.Namespace, exact: bool) -> dict[str, Any]:
    """One (system, phase) measurement of ``args.mode``; prints its one-line result."""
    if args.mode == "natural":
        r = run_natural(engine, system, phase, jobs, args, exact)
        print(f"    single-job enqueue {r['single_enqueue']['jobs_per_s']:,.0f} j/s, "
              f"drain {r['drain']['jobs_per_s']:,.0f} j/s, "
              f"errors {sum(r['drain']['errors'].values())}, dead {r['dead_total']:,}", flush=True)
    elif args.mode == "steady":
        r = run_steady(engine, system, phase, args, exact)
        pk = r["pickup_ms"]
        print(f"    producer {r['achieved_rate']:,.0f}/{r['offered_rate']:,.0f} j/s, pickup "
              f"p50 {fmt(pk['p50_ms'], '.2f')} p95 {fmt(pk['p95_ms'], '.2f')} "
              f"p99 {fmt(pk['p99_ms'], '.2f')} ms, dead {r['dead_total']:,}", flush=True)
    else:
        r = run_one(engine, system, phase, jobs, args, exact)
        print(f"    INSERT {r['insert_enqueue']['jobs_per_s']:,.0f} j/s, "
              f"COPY {r['copy_enqueue']['jobs_per_s']:,.0f} j/s, "
              f"drain {r['drain']['jobs_per_s']:,.0f} j/s, "
              f"dead {r['dead_total']:,}", flush=True)
    return r


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.url.startswith("postgresql+psycopg://"):
        print("warning: COPY needs the psycopg 3 driver (postgresql+psycopg://)", file=sys.stderr)
    ensure_database(args.url)
    settings = dict(item.split("=", 1) for item in args.settings)
    engine = make_engine(args.url, max(args.threads, args.workers + args.producers + 2), settings)
    exact = ensure_pgstattuple(engine)
    info = server_info(engine)
    print(describe(args, info, exact, settings))

    systems: list[Any] = []
    if not args.skip_qstore:
        # natural and steady: qstore's defaults (a claim sets no attempt deadline)
        deadline = timedelta(minutes=5) if args.mode == "drain" else None
        systems.append(QstoreSystem(args.qstore_schema, args.qstore_shards, deadline))
    if not args.skip_classic:
        systems.append(ClassicSystem(args.classic_schema))
    jobs = workload(args.jobs) if args.mode != "steady" else []

    results: list[dict[str, Any]] = []
    started = time.time()
    try:
        for rnd in range(1, args.rounds + 1):
            for phase in args.phases:
                for system in systems:
                    print(f"... round {rnd}/{args.rounds}: {system.name} / {phase}", flush=True)
                    r = run_mode(engine, system, phase, jobs, args, exact)
                    r["round"] = rnd
                    results.append(r)
    finally:
        if not args.keep:
            for system in systems:
                system.drop(engine)
        engine.dispose()

    if args.mode == "natural":
        summary = summarise_natural(results, args.jobs)
        print_natural(results, summary)
    elif args.mode == "steady":
        summary = summarise_steady(results)
        print_steady(results, summary)
    else:
        summary = summarise(results)
        print_report(results, summary)
    problems = [f"{r['system']}/{r['phase']}: {p}" for r in results for p in r["problems"]]
    payload: dict[str, Any] = {}
    if args.json:
        payload = {
            "mode": args.mode,
            "command": " ".join(["python", "scripts/bench_storage.py", *(argv or sys.argv[1:])]),
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                       if k != "url"},
            "dead_tuple_source": "pgstattuple" if exact else "n_dead_tup",
            "machine": info,
            "results": results,
            "summary": summary,
            "problems": problems,
        }
    return finish(args.json, payload, problems)


if __name__ == "__main__":
    raise SystemExit(main())
