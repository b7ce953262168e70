"""A realistic job mix, qstore and a classic queue side by side, with the horizon pinned in
the middle of the run.

Both systems run at the same time against one PostgreSQL database, each with its own
producer: ``--producers`` threads sharing a schedule of single-job enqueues at ``--rate``
jobs/s for ``--minutes`` minutes (each enqueue its own transaction). The same plan (one
seeded draw per job) gives both systems the same mix:

=========  =====  ======================================================================
kind       share  life of the job
=========  =====  ======================================================================
delayed    30 %   enqueued with a ``run_at`` 1..``--max-delay`` s ahead (uniform), then runs
retry      10 %   its first attempt raises; retried with the backoff (2^attempt s, up to
                  25 % jitter), the second attempt completes
snooze     5 %    its first run snoozes 1..``--max-snooze`` s (uniform), the next completes
unique     5 %    enqueued with a unique key (one per job), completes at once
progress   10 %   the handler sleeps ``--progress-steps`` times ``--progress-sleep`` s and sends
                  a heartbeat with progress after each step, then completes
plain      40 %   completes at once
=========  =====  ======================================================================

* **qstore**: a :class:`~qstore.worker.Worker` with its default settings (its maintainer
  inside, which promotes due jobs every 250 ms), one task for the whole mix. Delayed jobs
  are enqueued with ``InsertOpts(run_at=...)``, unique ones with ``UniqueOpts()``, the
  failure is an exception (``fail_retryable``), the snooze a returned ``Snooze`` and the
  heartbeats ``ctx.heartbeat(progress=...)``.
* **classic**: the psycopg classic queue (the faster of the repository's two classic
  baselines) extended with the same features on its one mutable row per job
  (``classic_mix.py``): ``--classic-workers`` threads (16, as the worker's concurrency),
  each claiming ``--classic-batch`` jobs (10) and running their handlers in turn, woken by
  ``LISTEN``/``NOTIFY`` or every ``--classic-poll`` s (1 s, the worker's poll interval).

A session pins the MVCC horizon (an idle transaction holding an xid) for the middle half of
the run: from 30 % to 80 % of ``--minutes`` (minutes 3 to 8 of 10). The server's autovacuum
is off on the development machines; the script then runs ``VACUUM`` on both systems' tables
every ``--vacuum-interval`` s as a stand-in (also while pinned: it cannot remove what the
pin protects), and right before the pin. After the run the script waits until every job
reached its end and checks that every job completed exactly once, with exactly its planned
handler runs, in both systems.

Reported per minute (``--bucket`` s; shorter runs use a tenth of the run) for both systems:
jobs enqueued, completed and completed per second; pickup p95 (enqueue commit to handler
start, first runs of jobs enqueued without a delay); promotion lag p95 (due time to handler start, for delayed,
retried and snoozed runs; the due time is the ``run_at`` the enqueue, the retry or the
snooze wrote); dead tuples (``n_dead_tup``) per table family (qstore: the families of
``qstore.status``; classic: its ``jobs`` table) and total bytes, at the minute's end.

Targets, for both systems: dead tuples at the end of the pin (``pgstattuple``, exact, the
pin still held) per job completed during it <= 0.01; total bytes at the end of the run ÷
just before the pin <= 1.1; jobs/s in the last pinned minute ÷ the clean rate (the clean
minutes after the first) >= 0.95; promotion lag p95 over the run <= 1.5 s.

    python scripts/bench_mix.py --minutes 10 --rate 100 --producers 6 --json docs/mix_100.json --plot docs/mix_100.png
    python scripts/bench_mix.py --minutes 0.3 --rate 100 --max-delay 3 --max-snooze 2
"""

from __future__ import annotations

import argparse
import array
import random
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, text

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _benchlib import (
    PacedSchedule,
    XminPin,
    dead_tuples,
    ensure_database,
    ensure_pgstattuple,
    finish,
    format_table,
    make_engine,
    percentile,
    server_info,
    verdict,
)
from bench_steady import loop, maintainer_summary, pin_open, vacuum_schemas
from classic_mix import COMPLETE, ClassicMix, MixJob, MixWorkers, Outcome

from qstore import InsertOpts, InsertParams, QueueStorage, QueueStorageConfig, UniqueOpts
from qstore.errors import PartialCommitError
from qstore.status import FAMILIES, family_of_tables, queue_status
from qstore.tasks import App, JobContext, Snooze
from qstore.worker import Worker, WorkerSettings

QUEUE = "mix"
DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/bench_mix"
SHARES = (("delayed", 0.30), ("retry", 0.10), ("snooze", 0.05), ("unique", 0.05), ("progress", 0.10))
KINDS = ("plain", *(k for k, _ in SHARES))
PLANNED_RUNS = {"retry": 2, "snooze": 2}  # handler runs per job; every other kind runs once
PIN_FROM, PIN_TO = 0.30, 0.80  # the pinned window, as shares of the run
CLASSIC_FAMILIES = ("jobs",)
SYSTEMS = ("qstore", "classic")
#: per-minute columns of the report (before the system's dead-tuple families and bytes)
COLUMNS = ("minute", "phase", "enqueued", "completed", "jobs/s", "pickup p95 ms", "promotion lag p95 ms")
TARGETS = {"dead_per_job": 0.01, "bytes_ratio": 1.1, "pinned_rate_ratio": 0.95,
           "promotion_lag_p95_s": 1.5}


class PlannedFailure(Exception):
    """The first attempt of a ``retry`` job raises this."""


# -- the plan -------------------------------------------------------------------------------------
class Plan:
    """The kind of job ``i`` and its seconds (the delay of a ``delayed`` job, the snooze of a
    ``snooze`` job; 0 otherwise), drawn once from ``seed``; the same for both systems."""

    def __init__(self, n: int, seed: int, max_delay: float, max_snooze: float) -> None:
        rng = random.Random(seed)
        self.kinds = bytearray(n)
        self.seconds = array.array("d", bytes(8 * n))
        for i in range(n):
            u = rng.random()
            k = 0
            for idx, (_, share) in enumerate(SHARES, start=1):
                if u < share:
                    k = idx
                    break
                u -= share
            self.kinds[i] = k
            if KINDS[k] == "delayed":
                self.seconds[i] = rng.uniform(1.0, max_delay)
            elif KINDS[k] == "snooze":
                self.seconds[i] = rng.uniform(1.0, max_snooze)

    @classmethod
    def single(cls, kind: str, n: int, seconds: float) -> Plan:
        """``n`` jobs, all of ``kind`` (one of :data:`KINDS`), each with ``seconds``."""
        plan = cls(0, 0, 1.0, 1.0)
        plan.kinds = bytearray([KINDS.index(kind)]) * n
        plan.seconds = array.array("d", [seconds]) * n
        return plan

    def kind(self, i: int) -> str:
        return KINDS[self.kinds[i]]


# -- what each system's handlers and completions record -------------------------------------------------
@dataclass
class Ledger:
    """One system's record of the run: handler runs, due times and completions (all
    guarded by ``lock``). Times: ``perf`` is ``time.perf_counter`` (the producers' clock),
    ``wall`` is ``time.time`` (the clock ``run_at`` is compared with)."""

    plan: Plan
    lock: threading.Lock = field(default_factory=threading.Lock)
    runs: dict[int, int] = field(default_factory=dict)  # seq -> handler runs so far
    starts: list[tuple[float, float, int, int]] = field(default_factory=list)  # (perf, wall, seq, run)
    due: dict[tuple[int, int], float] = field(default_factory=dict)  # (seq, run) -> due, wall
    seq_of: dict[int, int] = field(default_factory=dict)  # job id -> seq
    completed: Counter[int] = field(default_factory=Counter)  # job id -> completions
    completed_at: list[float] = field(default_factory=list)  # perf of each completion
    enqueue_errors: Counter[str] = field(default_factory=Counter)

    def start(self, seq: int, job_id: int) -> int:
        """A handler run of job ``seq`` begins now; returns its run number (1, 2, ...)."""
        perf, wall = time.perf_counter(), time.time()
        with self.lock:
            run = self.runs.get(seq, 0) + 1
            self.runs[seq] = run
            self.seq_of[job_id] = seq
            self.starts.append((perf, wall, seq, run))
        return run

    def enqueued(self, seq: int, job_id: int, due: datetime | None) -> None:
        with self.lock:
            self.seq_of[job_id] = seq
            if due is not None:
                self.due[seq, 1] = due.timestamp()

    def due_again(self, job_id: int, run_at: datetime) -> None:
        """Job ``job_id``'s next run is due at ``run_at`` (a retry or a snooze wrote it)."""
        with self.lock:
            seq = self.seq_of[job_id]
            self.due[seq, self.runs.get(seq, 0) + 1] = run_at.timestamp()

    def completions(self, job_ids: Sequence[int]) -> None:
        now = time.perf_counter()
        with self.lock:
            for j in job_ids:
                self.completed[j] += 1
                self.completed_at.append(now)

    def enqueue_error(self, exc: Exception) -> None:
        with self.lock:
            self.enqueue_errors[f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]] += 1

    def latencies(self, commit_at: dict[int, float]) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
        """``(pickups, promotions)``: ``(handler start perf, seconds)`` of each first run of a
        job enqueued without delay (from its enqueue's commit), and of each run that had a
        due time (from that time)."""
        pickups: list[tuple[float, float]] = []
        promotions: list[tuple[float, float]] = []
        with self.lock:
            for perf, wall, seq, run in self.starts:
                due = self.due.get((seq, run))
                if due is not None:
                    promotions.append((perf, wall - due))
                elif run == 1 and seq in commit_at:
                    pickups.append((perf, perf - commit_at[seq]))
        return pickups, promotions

    def tally(self, commit_at: dict[int, float]) -> dict[str, Any]:
        """Counts over the jobs of ``commit_at``: enqueued by kind, handler runs (done and
        planned), completions and distinct jobs completed."""
        with self.lock:
            return {
                "enqueued_by_kind": dict(Counter(self.plan.kind(s) for s in commit_at)),
                "handler_runs": sum(self.runs.get(s, 0) for s in commit_at),
                "planned_runs": sum(PLANNED_RUNS.get(self.plan.kind(s), 1) for s in commit_at),
                "completions": sum(self.completed.values()),
                "completed_jobs": len(self.completed),
            }

    def check(self, commit_at: dict[int, float]) -> list[str]:
        """Every enqueued job completed exactly once, after exactly its planned handler runs."""
        problems: list[str] = []
        with self.lock:
            ids = {j for j, s in self.seq_of.items() if s in commit_at}
            missing = [j for j in ids if self.completed[j] == 0]
            twice = [j for j, n in self.completed.items() if n > 1]
            unknown = [j for j in self.completed if j not in ids]
            wrong_runs = [s for s in commit_at
                          if self.runs.get(s, 0) != PLANNED_RUNS.get(self.plan.kind(s), 1)]
            if len(ids) != len(commit_at):
                problems.append(f"{len(commit_at) - len(ids)} enqueued jobs never had an id")
        if missing:
            problems.append(f"{len(missing)} jobs never completed (e.g. ids {sorted(missing)[:5]})")
        if twice:
            problems.append(f"{len(twice)} jobs completed more than once (e.g. ids {sorted(twice)[:5]})")
        if unknown:
            problems.append(f"{len(unknown)} completions of jobs not enqueued by this run")
        if wrong_runs:
            problems.append(f"{len(wrong_runs)} jobs ran a number of times other than planned "
                            f"(e.g. seq {sorted(wrong_runs)[:5]})")
        if self.enqueue_errors:
            problems.append(f"enqueue errors: {dict(self.enqueue_errors)}")
        return problems


def handle(plan: Plan, run: int, seq: int, heartbeat: Callable[[Any], bool], steps: int,
           step_sleep: float) -> Outcome:
    """The mix's handler: what run ``run`` of job ``seq`` does (``heartbeat(progress)``
    sends a heartbeat with progress)."""
    kind = plan.kind(seq)
    if kind == "retry" and run == 1:
        return Outcome("retry", error="planned failure")
    if kind == "snooze" and run == 1:
        return Outcome("snooze", seconds=plan.seconds[seq])
    if kind == "progress":
        for step in range(1, steps + 1):
            time.sleep(step_sleep)
            heartbeat({"step": step, "of": steps})
    return COMPLETE


# -- the two systems ---------------------------------------------------------------------------------
class System:
    name: str
    schema: str
    families: tuple[str, ...]
    ledger: Ledger

    def install(self) -> None:
        raise NotImplementedError

    def enqueue(self, seq: int) -> None:
        raise NotImplementedError

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> dict[str, Any]:
        """Stop the workers; what they report."""
        raise NotImplementedError

    def family(self, relname: str) -> str:
        raise NotImplementedError

    def leftovers(self) -> dict[str, Any]:
        """What the system still holds after the run (everything should be done)."""
        raise NotImplementedError

    def drop(self) -> None:
        raise NotImplementedError


class QstoreMix(System):
    name = "qstore"
    families = FAMILIES

    def __init__(self, engine: Engine, schema: str, plan: Plan, args: argparse.Namespace) -> None:
        self.engine, self.schema, self.plan, self.args = engine, schema, plan, args
        self.ledger = Ledger(plan)
        self.storage = QueueStorage(QueueStorageConfig(schema=schema))
        self._record_outcomes()
        self.opts = InsertOpts(queue=QUEUE)
        self.unique_opts = replace(self.opts, unique=UniqueOpts())
        self.app = App(self.storage)
        self._families = family_of_tables(self.storage.tables)
        ledger, steps, step_sleep = self.ledger, args.progress_steps, args.progress_sleep

        @self.app.task(kind="mix", queue=QUEUE)
        def mix(ctx: JobContext, seq: int, k: str) -> Any:
            run = ledger.start(seq, ctx.job_id)
            outcome = handle(plan, run, seq, lambda p: ctx.heartbeat(progress=p), steps, step_sleep)
            if outcome.action == "retry":
                raise PlannedFailure(outcome.error)
            if outcome.action == "snooze":
                return Snooze(outcome.seconds)
            return None

        self.worker: Worker | None = None

    def _record_outcomes(self) -> None:
        """Wrap the storage calls the worker ends attempts with, to record what they return
        (the due time of a retry or a snooze; the attempts a completion closed). The calls
        themselves are unchanged (a completion goes out through ``complete_runtime_batch``, or
        with a claim through ``complete_and_claim``)."""
        st, ledger = self.storage, self.ledger
        fail_retryable, snooze, complete = st.fail_retryable, st.snooze, st.complete_runtime_batch
        complete_and_claim = st.complete_and_claim

        def noting_due(call: Callable[..., Any]) -> Callable[..., Any]:
            def wrapped(*a: Any, **kw: Any) -> Any:
                row = call(*a, **kw)
                if row is not None:
                    ledger.due_again(row.id, row.run_at)
                return row
            return wrapped

        def completing(*a: Any, **kw: Any) -> Any:
            try:
                done = complete(*a, **kw)
            except PartialCommitError as err:
                ledger.completions([j for j, _ in err.committed])
                raise
            ledger.completions([j for j, _ in done])
            return done

        def cycling(*a: Any, **kw: Any) -> Any:  # a worker's claim carrying its completions
            try:
                got = complete_and_claim(*a, **kw)
            except PartialCommitError as err:
                ledger.completions([x[0] for x in err.committed if isinstance(x, tuple)])
                raise
            ledger.completions([j for j, _ in got.completed])
            return got

        setattr(st, "fail_retryable", noting_due(fail_retryable))  # noqa: B010 - instance wrapper
        setattr(st, "complete_and_claim", cycling)  # noqa: B010
        setattr(st, "snooze", noting_due(snooze))  # noqa: B010
        setattr(st, "complete_runtime_batch", completing)  # noqa: B010

    def install(self) -> None:
        self.storage.reset(self.engine)
        self.storage.prepare_schema(self.engine)

    def enqueue(self, seq: int) -> None:
        kind = self.plan.kind(seq)
        due = None
        opts = self.opts
        if kind == "delayed":
            due = datetime.now(timezone.utc) + timedelta(seconds=self.plan.seconds[seq])
            opts = replace(opts, run_at=due)
        elif kind == "unique":
            opts = self.unique_opts
        job_id = self.storage.enqueue(self.engine, InsertParams("mix", {"seq": seq, "k": kind}, opts))
        self.ledger.enqueued(seq, job_id, due)

    def start(self) -> None:
        self.worker = Worker(self.app, self.engine, WorkerSettings(queues=[QUEUE]))
        self.worker.start()

    def stop(self) -> dict[str, Any]:
        if self.worker is None:
            return {}
        stats = self.worker.stop(timeout=30.0)
        out: dict[str, Any] = {"worker_stats": {f.name: getattr(stats, f.name) for f in fields(stats)}}
        if self.worker.maintainer is not None:
            out["maintenance"] = maintainer_summary(self.worker.maintainer)
            out["maintenance_errors"] = [f"{r.task}: {r.error}"[:300] for r in self.worker.maintainer.reports()
                                         if r.error is not None][:20]
        return out

    def family(self, relname: str) -> str:
        return self._families.get(relname, "other")

    def leftovers(self) -> dict[str, Any]:
        st = queue_status(self.engine, self.storage, [QUEUE])[0]
        return {"available": st.available, "running": st.running, "scheduled": st.scheduled,
                "retryable": st.retryable, "waiting_external": st.waiting_external, "dlq": st.dlq,
                "failed": st.failed, "terminal": st.terminal}

    def drop(self) -> None:
        self.storage.reset(self.engine)


class ClassicMixSystem(System):
    name = "classic"
    families = CLASSIC_FAMILIES

    def __init__(self, url: str, schema: str, plan: Plan, args: argparse.Namespace) -> None:
        self.schema, self.plan, self.args = schema, plan, args
        self.ledger = Ledger(plan)
        self.q = ClassicMix(url, schema)
        self._local = threading.local()
        self._conns: list[Any] = []
        self._conns_lock = threading.Lock()
        self.workers: MixWorkers | None = None

    def install(self) -> None:
        self.q.create()

    def _conn(self) -> Any:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = self.q.connect()
            with self._conns_lock:
                self._conns.append(conn)
        return conn

    def enqueue(self, seq: int) -> None:
        kind = self.plan.kind(seq)
        due = None
        if kind == "delayed":
            due = datetime.now(timezone.utc) + timedelta(seconds=self.plan.seconds[seq])
        key = f"mix:{seq}" if kind == "unique" else None
        job_id = self.q.enqueue(self._conn(), QUEUE, "mix", {"seq": seq, "k": kind}, due, key)
        if job_id is None:
            raise RuntimeError(f"unique key {key} is taken")
        self.ledger.enqueued(seq, job_id, due)

    def start(self) -> None:
        ledger, plan, a = self.ledger, self.plan, self.args

        def handler(job: MixJob, beat: Callable[[Any], bool]) -> Outcome:
            seq = int(job.payload["seq"])
            run = ledger.start(seq, job.id)
            return handle(plan, run, seq, beat, a.progress_steps, a.progress_sleep)

        self.workers = MixWorkers(self.q, QUEUE, handler, workers=a.classic_workers, batch=a.classic_batch,
                                  poll_interval=a.classic_poll,
                                  on_due=lambda job, run_at: ledger.due_again(job.id, run_at),
                                  on_completed=ledger.completions).start()

    def stop(self) -> dict[str, Any]:
        if self.workers is None:
            return {}
        self.workers.stop()
        with self._conns_lock:
            for c in self._conns:
                c.close()
            self._conns.clear()
        w = self.workers
        return {"claim_calls": w.claim_calls, "empty_claims": w.empty_claims, "completed": w.completed,
                "errors": w.errors}

    def family(self, relname: str) -> str:
        return "jobs"

    def leftovers(self) -> dict[str, Any]:
        return {"rows": self.q.count()}

    def drop(self) -> None:
        self.q.drop()


# -- sampling -----------------------------------------------------------------------------------------
def sample_families(engine: Engine, systems: Sequence[System]) -> dict[str, dict[str, dict[str, int]]]:
    """``{system: {family: {"dead": n_dead_tup, "bytes": total bytes}}}`` (every family of
    the system present)."""
    sql = text(
        "SELECT n.nspname, c.relname, coalesce(s.n_dead_tup, 0), pg_total_relation_size(c.oid) "
        "FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid "
        "WHERE n.nspname = ANY(:schemas) AND c.relkind = 'r'")
    by_schema = {s.schema: s for s in systems}
    out = {s.name: {f: {"dead": 0, "bytes": 0} for f in s.families} for s in systems}
    with engine.connect() as conn:
        conn.execute(text("SELECT pg_stat_clear_snapshot()"))
        for schema, rel, dead, size in conn.execute(sql, {"schemas": list(by_schema)}).all():
            s = by_schema[schema]
            fam = out[s.name].setdefault(s.family(rel), {"dead": 0, "bytes": 0})
            fam["dead"] += int(dead)
            fam["bytes"] += int(size)
        conn.rollback()
    return out


def census(engine: Engine, systems: Sequence[System], exact: bool, pin: XminPin) -> dict[str, Any]:
    """Dead tuples of every table of both systems now (``pgstattuple`` when ``exact``),
    by family and by table, and whether ``pin`` still held the horizon once counted."""
    out: dict[str, Any] = {}
    for s in systems:
        tables = dead_tuples(engine, s.schema, exact, fold=False)
        fams: dict[str, int] = {f: 0 for f in s.families}
        for name, t in tables.items():
            fams[s.family(name)] = fams.get(s.family(name), 0) + t["dead"]
        out[s.name] = {"total": sum(fams.values()), "families": fams,
                       "tables": {n: t["dead"] for n, t in tables.items() if t["dead"]},
                       "bytes": sum(t["bytes"] for t in tables.values())}
    out["pin_held"] = pin_open(engine, pin)
    return out


def p95_ms(values: Sequence[float]) -> float | None:
    v = percentile(sorted(values), 95)
    return None if v is None else v * 1000.0


# -- the run ------------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    ensure_database(args.url)
    seconds = args.minutes * 60.0
    n_jobs = int(args.rate * seconds) + 2
    plan = Plan(n_jobs, args.seed, args.max_delay, args.max_snooze)
    engine = make_engine(args.url, 16 + args.producers + 8)  # the worker's handlers, producers, upkeep
    side = make_engine(args.url, 4)  # sampling, VACUUM, the pin, the census
    warm_pool(side, 4)
    info = server_info(side)
    exact = ensure_pgstattuple(side)
    qs = QstoreMix(engine, args.qstore_schema, plan, args)
    cs = ClassicMixSystem(args.url, args.classic_schema, plan, args)
    systems: list[System] = [qs, cs]
    for s in systems:
        s.install()
    emulate_autovacuum = args.vacuum_interval > 0 and info["postgres"]["autovacuum"] == "off"
    bucket = args.bucket if seconds >= 10 * args.bucket else seconds / 10.0
    sample_every = args.sample or bucket / 12.0
    pin_at, unpin_at = PIN_FROM * seconds, PIN_TO * seconds

    schedules = {s.name: PacedSchedule(rate=args.rate, seconds=seconds, warmup=0.0, enqueue_one=s.enqueue,
                                       producers=args.producers, on_error=s.ledger.enqueue_error)
                 for s in systems}
    stop = threading.Event()
    samples: list[dict[str, Any]] = []
    side_errors: list[str] = []
    threads: list[threading.Thread] = []
    if emulate_autovacuum:
        threads.append(threading.Thread(target=loop, args=(
            stop, args.vacuum_interval, lambda: vacuum_schemas(side, [s.schema for s in systems]),
            side_errors), daemon=True))
    t0 = time.perf_counter()

    def sample() -> None:
        now = time.perf_counter() - t0
        fams = sample_families(side, systems)
        samples.append({"t": round(now, 2), **fams})

    threads.append(threading.Thread(target=loop, args=(stop, sample_every, sample, side_errors), daemon=True))
    producers = [threading.Thread(target=schedules[s.name].run, daemon=True) for s in systems]
    for s in systems:
        s.start()
    for t in threads + producers:
        t.start()
    censuses: dict[str, Any] = {}
    pin: XminPin | None = None
    pin_window: list[float] = []
    try:
        time.sleep(max(0.0, pin_at - (time.perf_counter() - t0)))
        if emulate_autovacuum:
            vacuum_schemas(side, [s.schema for s in systems])
        pin = XminPin(side).__enter__()
        pin_window.append(time.perf_counter() - t0)
        print(f"t={pin_window[0]:7.1f}s horizon pinned (xid {pin.xid})", flush=True)
        censuses["at_pin_start"] = census(side, systems, exact, pin)
        time.sleep(max(0.0, unpin_at - (time.perf_counter() - t0)))
        censuses["end_of_pin"] = census(side, systems, exact, pin)
        pin.__exit__(None, None, None)
        pin = None
        pin_window.append(time.perf_counter() - t0)
        print(f"t={pin_window[1]:7.1f}s horizon released; dead tuples at the end of the pin: "
              + ", ".join(f"{s.name} {censuses['end_of_pin'][s.name]['total']:,}" for s in systems), flush=True)
        for p in producers:
            p.join()
        ended = time.perf_counter() - t0
        time.sleep(max(0.0, seconds - ended))
        sample()  # the run's last point, on the grid's end
        end_sample = samples[-1]
        drained = wait_drained(systems, schedules, args.drain_timeout)
    finally:
        stop.set()
        if pin is not None:
            pin.__exit__(None, None, None)
        reports = {s.name: s.stop() for s in systems}
        for t in threads:
            t.join(timeout=30)
    leftovers = {s.name: s.leftovers() for s in systems}
    problems: list[str] = []
    per_system: dict[str, Any] = {}
    for s in systems:
        commit_at = {i: at - t0 for i, at in schedules[s.name].commit_at.items()}
        checks = s.ledger.check(commit_at)
        problems += [f"{s.name}: {p}" for p in checks]
        pickups, promotions = s.ledger.latencies({i: at for i, at in schedules[s.name].commit_at.items()})
        per_system[s.name] = summarize(
            s, t0, bucket, seconds, pin_window, samples, pickups, promotions,
            [at - t0 for at in s.ledger.completed_at], censuses, end_sample, args.rate, list(commit_at.values()))
        per_system[s.name]["enqueued"] = len(commit_at)
        per_system[s.name]["offered"] = int(args.rate * seconds)
        per_system[s.name].update(s.ledger.tally(commit_at))
        per_system[s.name]["planned_runs_ok"] = not checks
        per_system[s.name]["report"] = reports[s.name]
        per_system[s.name]["leftovers"] = leftovers[s.name]
        per_system[s.name]["enqueue_errors"] = dict(s.ledger.enqueue_errors)
    if not drained:
        problems.append(f"not every job ended within --drain-timeout {args.drain_timeout:g} s")
    wr = reports["qstore"].get("worker_stats", {})
    if wr.get("stale_completions") or wr.get("stale_outcomes") or wr.get("outcome_errors"):
        problems.append(f"qstore worker: stale or failed outcomes {wr}")
    if reports["classic"].get("errors"):
        problems.append(f"classic workers: errors {reports['classic']['errors']}")
    lq, lc = leftovers["qstore"], leftovers["classic"]
    if any(lq[k] for k in ("available", "running", "scheduled", "retryable", "waiting_external", "dlq")):
        problems.append(f"qstore still holds unfinished jobs: {lq}")
    if lc["rows"]:
        problems.append(f"classic still holds {lc['rows']} rows")
    result = {
        "config": {k: v for k, v in vars(args).items() if k not in ("url", "plot", "json")},
        "machine": info,
        "emulated_autovacuum": emulate_autovacuum,
        "dead_tuple_source": "pgstattuple (exact)" if exact else "n_dead_tup (statistics)",
        "bucket_seconds": bucket,
        "pin_window_s": pin_window,
        "families": {s.name: list(s.families) for s in systems},
        "report_columns": list(COLUMNS),
        "census": censuses,
        "systems": per_system,
        "samples": samples,
        "side_errors": side_errors[:20],
        "problems": problems,
    }
    result["targets"] = {s.name: per_system[s.name]["targets"] for s in systems}
    if not args.keep:
        for s in systems:
            s.drop()
    engine.dispose()
    side.dispose()
    return result


def warm_pool(engine: Engine, n: int) -> None:
    """Open ``n`` pooled connections now, so the sampler, the stand-in VACUUM, the pin and
    the census never need a new connection later, on a server whose connection slots other
    clients may have taken by then."""
    conns = [engine.connect() for _ in range(n)]
    for c in conns:
        c.close()


def wait_drained(systems: Sequence[System], schedules: dict[str, PacedSchedule], timeout: float) -> bool:
    """Wait until every job each system's producer enqueued has completed (or ``timeout`` s)."""
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        if all(len(s.ledger.completed) >= len(schedules[s.name].commit_at) for s in systems):
            return True
        time.sleep(0.2)
    return False


def summarize(s: System, t0: float, bucket: float, seconds: float, pin_window: list[float],
              samples: list[dict[str, Any]], pickups: list[tuple[float, float]],
              promotions: list[tuple[float, float]], completed_at: list[float],
              censuses: dict[str, Any], end_sample: dict[str, Any], rate: float,
              enqueued_at: list[float]) -> dict[str, Any]:
    """Per-minute rows and the target checks of one system (times relative to ``t0``,
    except the pickups' and promotions' handler starts)."""
    n = max(1, round(seconds / bucket))
    enq = [0] * n
    for at in enqueued_at:
        if 0 <= int(at // bucket) < n:
            enq[int(at // bucket)] += 1
    pin_from, pin_to = pin_window if len(pin_window) == 2 else (PIN_FROM * seconds, PIN_TO * seconds)
    done = [0] * n
    for at in completed_at:
        b = int(at // bucket)
        if 0 <= b < n:
            done[b] += 1
    picks: list[list[float]] = [[] for _ in range(n)]
    promos: list[list[float]] = [[] for _ in range(n)]
    for perf, lat in pickups:
        b = int((perf - t0) // bucket)
        if 0 <= b < n:
            picks[b].append(lat)
    for perf, lag in promotions:
        b = int((perf - t0) // bucket)
        if 0 <= b < n:
            promos[b].append(lag)
    rows: list[dict[str, Any]] = []
    for b in range(n):
        start, end = b * bucket, (b + 1) * bucket
        at_end = min(samples, key=lambda x: abs(x["t"] - end)) if samples else None
        # a minute belongs to a phase when at least 90 % of it does (the pin begins after the
        # VACUUM that precedes it and ends after the census, a few seconds late)
        covered = max(0.0, min(end, pin_to) - max(start, pin_from)) / bucket
        phase = ("pinned" if covered >= 0.9 else "clean" if end <= pin_from + 0.1 * bucket else
                 "after" if start >= pin_to - 0.1 * bucket else "mixed")
        rows.append({
            "minute": b, "from_s": start, "to_s": end, "phase": phase, "enqueued": enq[b], "completed": done[b],
            "jobs_per_s": done[b] / bucket, "pickup_n": len(picks[b]), "pickup_p95_ms": p95_ms(picks[b]),
            "promotion_n": len(promos[b]), "promotion_lag_p95_ms": p95_ms(promos[b]),
            "dead": {f: v["dead"] for f, v in at_end[s.name].items()} if at_end else {},
            "bytes": sum(v["bytes"] for v in at_end[s.name].values()) if at_end else None,
        })
    clean = [r["jobs_per_s"] for r in rows[1:] if r["phase"] == "clean"]
    clean_rate = statistics.mean(clean) if clean else rate
    pinned_rows = [r for r in rows if r["phase"] == "pinned"]
    last_pinned = pinned_rows[-1]["jobs_per_s"] if pinned_rows else None
    start_c, end_c = censuses.get("at_pin_start"), censuses.get("end_of_pin")
    during = sum(1 for at in completed_at if pin_from <= at <= pin_to)
    dead_end = end_c[s.name]["total"] if end_c else None
    before = start_c[s.name]["bytes"] if start_c else None
    after = sum(v["bytes"] for v in end_sample[s.name].values())
    all_promos = [lag for _, lag in promotions]
    all_picks = [lat for _, lat in pickups]
    fams = end_c[s.name]["families"] if end_c else {}
    targets = {
        "dead_per_job_pinned": verdict(None if dead_end is None else dead_end / max(during, 1), "<=",
                                       TARGETS["dead_per_job"],
                                       f"{dead_end} dead at the end of the pin, {during} jobs completed "
                                       f"during it; by family: "
                                       + ", ".join(f"{f} {v:,}" for f, v in fams.items() if v)),
        "bytes_after_over_before": verdict(None if not before else after / before, "<=", TARGETS["bytes_ratio"],
                                           f"{before} B just before the pin, "
                                           f"{end_c[s.name]['bytes'] if end_c else None} B at its end, "
                                           f"{after} B at the end of the run"),
        "last_pinned_minute_over_clean": verdict(None if last_pinned is None else last_pinned / clean_rate,
                                                 ">=", TARGETS["pinned_rate_ratio"],
                                                 f"{last_pinned} jobs/s in the last pinned minute, "
                                                 f"clean rate {clean_rate:.1f} jobs/s"),
        "promotion_lag_p95_s": verdict(None if not all_promos else (p95_ms(all_promos) or 0.0) / 1000.0,
                                       "<=", TARGETS["promotion_lag_p95_s"],
                                       f"{len(all_promos)} runs with a due time, the whole run"),
    }
    return {"minutes": rows, "clean_rate": clean_rate, "completed_during_pin": during,
            "pickup_p95_ms": p95_ms(all_picks), "pickup_p50_ms": None if not all_picks else
            (percentile(sorted(all_picks), 50) or 0.0) * 1000.0, "promotion_lag_p95_ms": p95_ms(all_promos),
            "promotion_lag_p50_ms": None if not all_promos else (percentile(sorted(all_promos), 50) or 0.0) * 1000.0,
            "targets": targets}


# -- output -------------------------------------------------------------------------------------------
def fmt(v: float | None, spec: str = ",.1f") -> str:
    return "-" if v is None else format(v, spec)


def print_report(result: dict[str, Any]) -> None:
    print(f"\nRealistic mix, {result['config']['rate']:,.0f} jobs/s offered to each system for "
          f"{result['config']['minutes']:g} min; horizon pinned from "
          f"{result['pin_window_s'][0]:.0f} s to {result['pin_window_s'][1]:.0f} s; "
          f"minutes of {result['bucket_seconds']:g} s")
    if result["emulated_autovacuum"]:
        print(f"autovacuum is off on this server: the script ran VACUUM on both systems every "
              f"{result['config']['vacuum_interval']:g} s as a stand-in (and right before the pin)")
    for name in SYSTEMS:
        sysr = result["systems"][name]
        fams = result["families"][name]
        print(f"\n{name}: dead tuples (n_dead_tup) per table family at each minute's end")
        headers = [*COLUMNS, *(f"dead {f}" for f in fams), "MiB"]
        rows = [[r["minute"], r["phase"], f"{r['enqueued']:,}", f"{r['completed']:,}", fmt(r["jobs_per_s"]), fmt(r["pickup_p95_ms"]),
                 fmt(r["promotion_lag_p95_ms"]), *(f"{r['dead'].get(f, 0):,}" for f in fams),
                 fmt(None if r["bytes"] is None else r["bytes"] / 2**20)] for r in sysr["minutes"]]
        print(format_table(headers, rows))
        print(f"  producer: {sysr['enqueued']:,} of {sysr['offered']:,} offered jobs enqueued "
              f"({sysr['enqueued'] / max(sysr['offered'], 1):.0%})")
        print(f"  whole run: pickup p50 {fmt(sysr['pickup_p50_ms'])} ms, p95 {fmt(sysr['pickup_p95_ms'])} ms; "
              f"promotion lag p50 {fmt(sysr['promotion_lag_p50_ms'])} ms, p95 {fmt(sysr['promotion_lag_p95_ms'])} ms")
    end = result["census"].get("end_of_pin")
    if end:
        print(f"\ndead tuples at the end of the pin ({result['dead_tuple_source']}; pin still held: "
              f"{'yes' if end['pin_held'] else 'NO'}), by table:")
        for name in SYSTEMS:
            tables = sorted(end[name]["tables"].items(), key=lambda kv: -kv[1])
            print(f"  {name}: " + (", ".join(f"{t} {n:,}" for t, n in tables) or "none"))
    print("\ntargets")
    for name in SYSTEMS:
        for key, v in result["targets"][name].items():
            val = v["value"]
            print(f"  {name:<8} {key:<32} {fmt(val, ',.4g'):>10} (target {v['target']}) {v['result']}"
                  f"  [{v.get('note', '')}]")


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result["samples"]
    t = [s["t"] / 60.0 for s in samples]
    fig, axes = plt.subplots(4, 1, figsize=(10, 12), sharex=True)
    for name, style, color in (("qstore", "-", "C0"), ("classic", "--", "C1")):
        rows = result["systems"][name]["minutes"]
        mids = [(r["from_s"] + r["to_s"]) / 120.0 for r in rows]
        axes[0].plot(mids, [r["jobs_per_s"] for r in rows], style, color=color, marker="o", label=name)
        axes[1].plot(t, [max(1, sum(f["dead"] for f in s[name].values())) for s in samples], style,
                     color=color, label=name)
        axes[2].plot(t, [sum(f["bytes"] for f in s[name].values()) / 2**20 for s in samples], style,
                     color=color, label=name)
        axes[3].plot(mids, [r["promotion_lag_p95_ms"] or 0 for r in rows], style, color=color, marker="o",
                     label=f"{name} promotion lag p95")
        axes[3].plot(mids, [r["pickup_p95_ms"] or 0 for r in rows], style, color=color, marker="x",
                     alpha=0.6, label=f"{name} pickup p95")
    for name in result["families"]["qstore"]:
        series = [s["qstore"].get(name, {}).get("dead", 0) for s in samples]
        if any(series):
            axes[1].plot(t, [max(1, x) for x in series], ":", linewidth=1, label=f"qstore {name}")
    axes[0].set_ylabel("completed jobs/s (per minute)")
    axes[1].set_yscale("log")
    axes[1].set_ylabel("dead tuples (n_dead_tup)")
    axes[2].set_ylabel("total MiB")
    axes[3].set_yscale("log")
    axes[3].set_ylabel("p95 per minute (ms)")
    axes[3].set_xlabel("minutes")
    lo, hi = result["pin_window_s"] if len(result["pin_window_s"]) == 2 else (0.0, 0.0)
    for ax in axes:
        ax.axvspan(lo / 60.0, hi / 60.0, color="orange", alpha=0.15,
                   label="horizon pinned" if ax is axes[0] else None)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper left", fontsize=7)
    cfg = result["config"]
    fig.suptitle(f"realistic mix, {cfg['rate']:,.0f} jobs/s offered to each: qstore Worker (defaults) vs "
                 f"classic ({cfg['classic_workers']} threads, claim {cfg['classic_batch']}); "
                 f"VACUUM every {cfg['vacuum_interval']:g} s, autovacuum off", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=DEFAULT_URL)
    p.add_argument("--rate", type=float, default=1000.0, help="offered jobs/s per system")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--producers", type=int, default=4, help="enqueue threads per system")
    p.add_argument("--max-delay", type=float, default=60.0, help="delayed jobs: 1..this many s")
    p.add_argument("--max-snooze", type=float, default=10.0, help="snoozed jobs: 1..this many s")
    p.add_argument("--progress-steps", type=int, default=3, help="heartbeats of a progress job")
    p.add_argument("--progress-sleep", type=float, default=0.02, help="s of handler sleep before each")
    p.add_argument("--classic-workers", type=int, default=16)
    p.add_argument("--classic-batch", type=int, default=10)
    p.add_argument("--classic-poll", type=float, default=1.0)
    p.add_argument("--bucket", type=float, default=60.0,
                   help="report rows of this many s (runs shorter than ten of them: a tenth of the run)")
    p.add_argument("--sample", type=float, default=None, help="s between samples (default: bucket / 12)")
    p.add_argument("--vacuum-interval", type=float, default=10.0,
                   help="VACUUM both systems this often when autovacuum is off (0: never)")
    p.add_argument("--drain-timeout", type=float, default=None,
                   help="s to wait after the run for every job to end (default: max delay + 60)")
    p.add_argument("--seed", type=int, default=20261205)
    p.add_argument("--qstore-schema", default="mix_qstore")
    p.add_argument("--classic-schema", default="mix_classic")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None)
    p.add_argument("--keep", action="store_true", help="keep both schemas after the run")
    a = p.parse_args(argv)
    if a.minutes <= 0 or a.rate <= 0 or a.max_delay < 1 or a.max_snooze < 1 or a.producers < 1:
        p.error("--minutes and --rate must be > 0, --max-delay and --max-snooze >= 1, --producers >= 1")
    if a.drain_timeout is None:
        a.drain_timeout = a.max_delay + 60.0
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("bench_mix: --plot needs matplotlib (pip install -e '.[dev]')", file=sys.stderr)
            return 1
    result = run(args)
    result["command"] = " ".join(["python", "scripts/bench_mix.py", *(argv if argv is not None else sys.argv[1:])])
    print_report(result)
    if args.plot is not None:
        plot(result, args.plot)
        print(f"wrote {args.plot}")
    return finish(args.json, result, result["problems"])


if __name__ == "__main__":
    raise SystemExit(main())
