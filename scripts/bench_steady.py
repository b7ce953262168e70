"""Steady-state soak: qstore and the in-repo classic queue side by side, in one run.

Both systems run *at the same time* against one PostgreSQL database, each with its own
producer (a fixed offered rate) and its own draining workers (claim + complete; no
heartbeats, no callbacks). qstore's upkeep (``--upkeep``) is either the product's
:class:`qstore.runtime.maintainer.Maintainer` (default; its default schedule, or fields given with
``--schedule NAME=VALUE``: ring rotation and prune, promotion, rescue, count roll-up) or the
bare ring ticker (``--upkeep rings``: rotate and prune all three rings every ``--rotate``
seconds). The run has three phases (``--clean-seconds`` / ``--pinned-seconds`` /
``--recovery-seconds``, each a third of ``--duration`` unless given):

* ``clean``    — nothing holds the MVCC horizon;
* ``pinned``   — one extra connection sits idle in a transaction that holds an xid, so no
  dead tuple deleted after it began can be removed by (auto)vacuum for either system;
* ``recovery`` — the pin is released.

Every ``--sample`` seconds it records, per system and table family, dead tuples
(``n_dead_tup``), total bytes (heap + indexes + toast) and the completed-jobs throughput.
When the server runs with ``autovacuum = off`` (as the development machines do) the script
runs ``VACUUM`` on both systems' tables every ``--vacuum-interval`` seconds, standing in for
autovacuum, so the classic queue is given the same chance to recover as in production.

Dead tuples left by upkeep: at the end of the pinned phase, while the horizon is still
pinned, every table of both schemas is counted (``pgstattuple`` when the server has it:
exact; else ``n_dead_tup`` after a wait long enough for every session to flush its
statistics), qstore's broken down by table, and the same census is taken just after the pin
began. With the autovacuum stand-in, qstore's schema is vacuumed right before the pin, so
the end-of-pinned count is what the pinned phase left; the stand-in keeps running while
pinned, but VACUUM cannot remove a tuple deleted after the pin began, so it hides nothing.

Output: a JSON time series (``--json``), a PNG plot (``--plot``, matplotlib; neither is
written unless asked) and a verdict against these targets: qstore dead tuples <= 1 % of the classic queue's at the end of the pinned phase;
qstore total bytes back within 10 % of the clean-phase level by the end of recovery; no
throughput collapse while pinned (completed rate >= 90 % of the offered rate); and the
upkeep target: <= 50 dead tuples in the whole qstore schema at the end of a 10-minute
pinned phase.

    python scripts/bench_steady.py --rate 1000 --duration 600 --json docs/steady.json --plot docs/steady.png
    python scripts/bench_steady.py --clean-seconds 60 --pinned-seconds 600 --recovery-seconds 60
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, text

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _benchlib import (
    XminPin,
    dead_tuples,
    ensure_database,
    ensure_pgstattuple,
    family_of,
    make_engine,
    server_info,
    verdict,
)
from classic_queue import ClassicQueue

from qstore import InsertOpts, InsertParams, QueueStorage, QueueStorageConfig
from qstore.runtime.maintainer import Maintainer, MaintenanceSchedule

QUEUE = "steady"
DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/bench_steady"
UPKEEP_DEAD_TARGET = 50  # dead tuples in the whole qstore schema at the end of the pinned phase
UPKEEP_PINNED_SECONDS = 600.0  # ... of a pinned phase this long
# n_dead_tup fallback: a session flushes its statistics at most once a second at the end of a
# transaction, and an idle one within a second of its last (PGSTAT_MIN_INTERVAL)
STATS_FLUSH_WAIT = 1.5


@dataclass
class Counters:
    enqueued: int = 0
    completed: int = 0
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, name: str, n: int) -> None:
        with self.lock:
            setattr(self, name, getattr(self, name) + n)


class System:
    """What the soak needs from a queue: enqueue, claim + complete, and a schema to sample."""

    name: str
    schema: str

    def install(self, engine: Engine) -> None:
        raise NotImplementedError

    def drop(self, engine: Engine) -> None:
        raise NotImplementedError

    def enqueue(self, engine: Engine, n: int, seq: int) -> int:
        raise NotImplementedError

    def work(self, engine: Engine, batch: int) -> int:
        raise NotImplementedError

    def maintain(self, engine: Engine) -> None:
        raise NotImplementedError

    #: the system drains its queue itself (no draining threads of the soak for it)
    drives_itself = False

    def completed(self, counters: Counters) -> int:
        """Jobs completed so far."""
        return counters.completed

    def start_upkeep(self, engine: Engine) -> None:
        """Start background upkeep that runs on its own schedule (none by default)."""

    def stop_upkeep(self) -> None:
        """Stop what :meth:`start_upkeep` started."""


class QstoreSystem(System):
    name = "qstore"

    def __init__(self, schema: str, shards: int | None, upkeep: str = "maintainer",
                 schedule: MaintenanceSchedule | None = None) -> None:
        """``upkeep``: ``maintainer`` (the product's Maintainer, ``schedule`` or its
        default) or ``rings`` (:meth:`maintain`: rotate and prune the three rings)."""
        self.schema = schema
        self.shards = shards
        self.upkeep = upkeep
        self.schedule = schedule or MaintenanceSchedule()
        self.storage = QueueStorage(QueueStorageConfig(schema=schema))
        self.opts = InsertOpts(queue=QUEUE)
        self.maintenance: dict[str, int] = {}
        self.maintainer: Maintainer | None = None

    def install(self, engine: Engine) -> None:
        self.storage.reset(engine)
        self.storage.prepare_schema(engine)
        if self.shards is not None:  # None: the install's default (eight lanes per priority)
            self.storage.set_queue_options(engine, QUEUE, enqueue_shards=self.shards)

    def drop(self, engine: Engine) -> None:
        self.storage.reset(engine)

    def enqueue(self, engine: Engine, n: int, seq: int) -> int:
        jobs = [InsertParams("steady_job", {"seq": seq + i}, self.opts) for i in range(n)]
        return self.storage.enqueue_params_batch(engine, jobs)

    def work(self, engine: Engine, batch: int) -> int:
        claimed = self.storage.claim_runtime_batch(engine, QUEUE, batch)
        if not claimed:
            return 0
        return len(self.storage.complete_runtime_batch(engine, claimed))

    def maintain(self, engine: Engine) -> None:
        s = self.storage
        for name, op in (("rotate", s.rotate), ("prune", s.prune_oldest),
                         ("rotate_leases", s.rotate_leases), ("prune_leases", s.prune_oldest_leases),
                         ("rotate_claims", s.rotate_claims), ("prune_claims", s.prune_oldest_claims)):
            outcome = op(engine)
            key = f"{name}:{outcome.kind}"
            self.maintenance[key] = self.maintenance.get(key, 0) + 1

    def start_upkeep(self, engine: Engine) -> None:
        if self.upkeep != "maintainer":
            return
        # keep every report: the summary counts task runs and outcomes over the whole soak
        self.maintainer = Maintainer(self.storage, engine, self.schedule, keep_reports=10**7)
        self.maintainer.start()

    def stop_upkeep(self) -> None:
        if self.maintainer is not None:
            self.maintainer.stop()
            self.maintenance = maintainer_summary(self.maintainer)


class QstoreWorkerSystem(QstoreSystem):
    """qstore drained by its worker runtime: an :class:`~qstore.tasks.App` with one no-op task
    and a :class:`~qstore.worker.Worker` with its default settings (its own maintainer
    inside, with ``schedule`` when given); the soak starts no draining threads for it."""

    drives_itself = True

    def __init__(self, schema: str, shards: int | None,
                 schedule: MaintenanceSchedule | None = None) -> None:
        super().__init__(schema, shards, "maintainer", schedule)
        from qstore.tasks import App, JobContext

        self.app = App(self.storage)

        @self.app.task(kind="steady_job", queue=QUEUE)
        def steady_job(ctx: JobContext, seq: int) -> None:
            return None

        self.worker: Any = None
        self.worker_stats: dict[str, int] | None = None

    def completed(self, counters: Counters) -> int:
        return 0 if self.worker is None else int(self.worker.stats.completed)

    def start_upkeep(self, engine: Engine) -> None:
        from qstore.worker import Worker, WorkerSettings

        self.worker = Worker(self.app, engine, WorkerSettings(queues=[QUEUE], schedule=self.schedule))
        self.worker.start()
        self.maintainer = self.worker.maintainer

    def stop_upkeep(self) -> None:
        if self.worker is not None:
            stats = self.worker.stop(timeout=30.0)
            self.worker_stats = {f.name: getattr(stats, f.name) for f in fields(stats)}
            if self.maintainer is not None:
                self.maintenance = maintainer_summary(self.maintainer)


def maintainer_summary(m: Maintainer) -> dict[str, int]:
    """``{"<task>:runs": n, "<task>:errors": n, "<ring task>:rotate:<kind>": n,
    "<ring task>:prune:<kind>": n, "<ring task>:prune:caught_up": slots}`` over every
    report the maintainer kept."""
    out: dict[str, int] = {}

    def bump(key: str, n: int = 1) -> None:
        out[key] = out.get(key, 0) + n

    for r in m.reports():
        bump(f"{r.task}:runs")
        if r.error is not None:
            bump(f"{r.task}:errors")
            continue
        rotated = getattr(r.result, "rotate", None)
        if rotated is None and getattr(r.result, "slot_bytes", None) is not None:
            bump(f"{r.task}:not_due")  # a claim-ring run that found its slot not full yet
        if rotated is not None:
            bump(f"{r.task}:rotate:{rotated.kind}")
            pruned = r.result.prune
            bump(f"{r.task}:prune:{pruned.kind if pruned is not None else 'backing_off'}")
            if r.result.caught_up:
                bump(f"{r.task}:prune:caught_up", r.result.caught_up)
    return out


def count_errors(errors: list[str]) -> dict[str, int]:
    """How often each error occurred, keyed by the first line of its message."""
    out: dict[str, int] = {}
    for e in errors:
        key = e.splitlines()[0] if e else e
        out[key] = out.get(key, 0) + 1
    return out


def maintainer_errors(m: Maintainer | None) -> list[str]:
    if m is None:
        return []
    return [f"maintainer {r.task}: {r.error}"[:300] for r in m.reports() if r.error is not None]


class ClassicSystem(System):
    name = "classic"

    def __init__(self, schema: str) -> None:
        self.schema = schema
        self.q = ClassicQueue(schema)

    def install(self, engine: Engine) -> None:
        with engine.begin() as conn:
            self.q.drop(conn)
            self.q.create(conn)

    def drop(self, engine: Engine) -> None:
        with engine.begin() as conn:
            self.q.drop(conn)

    def enqueue(self, engine: Engine, n: int, seq: int) -> int:
        with engine.begin() as conn:
            return self.q.enqueue_insert(conn, [(QUEUE, "steady_job", 2, {"seq": seq + i})
                                                for i in range(n)])

    def work(self, engine: Engine, batch: int) -> int:
        with engine.begin() as conn:
            jobs = self.q.claim(conn, QUEUE, batch)
        if not jobs:
            return 0
        with engine.begin() as conn:
            return self.q.complete(conn, [j.id for j in jobs])

    def maintain(self, engine: Engine) -> None:
        return None


def sample_tables(engine: Engine, schemas: list[str]) -> dict[str, dict[str, dict[str, int]]]:
    """``{schema: {family: {"dead": n_dead_tup, "bytes": total bytes}}}``."""
    sql = text(
        "SELECT n.nspname, c.relname, coalesce(s.n_dead_tup, 0), pg_total_relation_size(c.oid) "
        "FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid "
        "WHERE n.nspname = ANY(:schemas) AND c.relkind = 'r'"
    )
    out: dict[str, dict[str, dict[str, int]]] = {s: {} for s in schemas}
    with engine.connect() as conn:
        conn.execute(text("SELECT pg_stat_clear_snapshot()"))
        for schema, rel, dead, size in conn.execute(sql, {"schemas": schemas}).all():
            fam = out[schema].setdefault(family_of(rel), {"dead": 0, "bytes": 0})
            fam["dead"] += int(dead)
            fam["bytes"] += int(size)
        conn.rollback()
    return out


def vacuum_schemas(engine: Engine, schemas: list[str]) -> None:
    """Stand-in for autovacuum: plain VACUUM of every table of the given schemas."""
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        rels = conn.execute(text(
            "SELECT quote_ident(n.nspname) || '.' || quote_ident(c.relname) "
            "FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = ANY(:s) AND c.relkind = 'r'"), {"s": schemas}).scalars().all()
        for rel in rels:
            with contextlib.suppress(Exception):  # a ring child locked meanwhile: next round
                conn.execute(text(f"VACUUM {rel}"))


def loop(stop: threading.Event, every: float, fn: Callable[[], None], errors: list[str]) -> None:
    next_at = time.monotonic()
    while not stop.is_set():
        try:
            fn()
        except Exception as err:  # keep the soak running; report at the end
            errors.append(f"{type(err).__name__}: {err}"[:300])
        next_at += every
        stop.wait(max(0.0, next_at - time.monotonic()))


def census(engine: Engine, schemas: list[str], exact: bool, pin: XminPin) -> dict[str, Any]:
    """Dead tuples of every table of ``schemas``, now: ``{schema: {"total": n, "tables":
    {table: {"dead", "n_dead_tup", "live", "bytes"}}}}``. ``dead`` is ``pgstattuple``'s
    exact count when ``exact``, else ``n_dead_tup`` read after ``STATS_FLUSH_WAIT``.
    ``pin_held``: whether ``pin``'s transaction was still open once the count was done."""
    if not exact:
        time.sleep(STATS_FLUSH_WAIT)
    began = time.monotonic()
    out: dict[str, Any] = {}
    for schema in schemas:
        tables = dead_tuples(engine, schema, exact, fold=False)
        out[schema] = {"total": sum(t["dead"] for t in tables.values()), "tables": tables}
    out["seconds"] = round(time.monotonic() - began, 2)
    out["pin_held"] = pin_open(engine, pin)
    return out


def pin_open(engine: Engine, pin: XminPin) -> bool:
    """Whether a session still holds ``pin``'s transaction (its xid is still running)."""
    if pin.xid is None:
        return False
    with engine.connect() as conn:
        status = conn.execute(text("SELECT txid_status(:x)"), {"x": pin.xid}).scalar_one()
        conn.rollback()
    return bool(status == "in progress")


def census_source(exact: bool) -> str:
    return ("pgstattuple (exact)" if exact else
            f"n_dead_tup (statistics) read {STATS_FLUSH_WAIT} s after the census point: every "
            "session flushes its counters within about a second of a transaction's end")


def phase_lengths(args: argparse.Namespace) -> tuple[float, float, float]:
    third = args.duration / 3
    clean, pinned, recovery = (third if v is None else float(v) for v in
                               (args.clean_seconds, args.pinned_seconds, args.recovery_seconds))
    return clean, pinned, recovery


def run(args: argparse.Namespace) -> dict[str, Any]:
    ensure_database(args.url)
    schedule = MaintenanceSchedule(**args.schedule) if args.schedule else None
    qstore: QstoreSystem
    if args.qstore_driver == "worker":
        qstore = QstoreWorkerSystem(args.qstore_schema, args.qstore_shards, schedule)
    else:
        qstore = QstoreSystem(args.qstore_schema, args.qstore_shards, args.upkeep, schedule)
    systems: list[System] = [qstore, ClassicSystem(args.classic_schema)]
    engine = make_engine(args.url, args.workers * len(systems) + 8)
    info = server_info(engine)
    exact = ensure_pgstattuple(engine)
    emulate_autovacuum = args.vacuum_interval > 0 and info["postgres"]["autovacuum"] == "off"
    for s in systems:
        s.install(engine)
    counters = {s.name: Counters() for s in systems}
    stop = threading.Event()
    threads: list[threading.Thread] = []
    tick = 0.1

    for s in systems:
        c = counters[s.name]
        per_tick = args.rate * tick
        carry = {"x": 0.0, "seq": 0}

        def produce(s: System = s, c: Counters = c, carry: dict[str, float] = carry,
                    per_tick: float = per_tick) -> None:
            carry["x"] += per_tick
            n = int(carry["x"])
            if n:
                carry["x"] -= n
                c.add("enqueued", s.enqueue(engine, n, int(carry["seq"])))
                carry["seq"] += n

        threads.append(threading.Thread(target=loop, args=(stop, tick, produce, c.errors), daemon=True))

        def worker(s: System = s, c: Counters = c) -> None:
            while not stop.is_set():
                try:
                    done = s.work(engine, args.batch)
                except Exception as err:
                    c.errors.append(f"{type(err).__name__}: {err}"[:300])
                    done = 0
                if done:
                    c.add("completed", done)
                else:
                    stop.wait(0.02)

        if not s.drives_itself:
            threads += [threading.Thread(target=worker, daemon=True) for _ in range(args.workers)]
    if args.upkeep == "rings":
        threads.append(threading.Thread(
            target=loop, args=(stop, args.rotate, lambda: qstore.maintain(engine),
                               counters[qstore.name].errors), daemon=True))
    vac_errors: list[str] = []
    if emulate_autovacuum:
        threads.append(threading.Thread(
            target=loop, args=(stop, args.vacuum_interval,
                               lambda: vacuum_schemas(engine, [s.schema for s in systems]), vac_errors),
            daemon=True))

    clean_s, pinned_s, recovery_s = phase_lengths(args)
    pin_at, unpin_at, total = clean_s, clean_s + pinned_s, clean_s + pinned_s + recovery_s
    samples: list[dict[str, Any]] = []
    censuses: dict[str, Any] = {}
    pin: XminPin | None = None
    pinned_since = 0.0
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for s in systems:
        s.start_upkeep(engine)
    last = {s.name: (0, 0.0) for s in systems}
    phase = "clean"
    next_sample = 0.0
    try:
        while (elapsed := time.monotonic() - t0) < total:
            if phase == "clean" and elapsed >= pin_at:
                if emulate_autovacuum:  # the pinned phase starts from a vacuumed qstore schema
                    vacuum_schemas(engine, [qstore.schema])
                pin = XminPin(engine).__enter__()
                pinned_since = time.monotonic()
                # the pinned phase lasts its length from the pin itself (the vacuum before
                # it can take a while on a loaded host), and the recovery phase follows it
                unpin_at = pinned_since - t0 + pinned_s
                total = unpin_at + recovery_s
                phase = "pinned"
                censuses["at_pin_start"] = census(engine, [s.schema for s in systems], exact, pin)
                print(f"t={elapsed:6.1f}s pinned   census at pin start: qstore dead="
                      f"{censuses['at_pin_start'][qstore.schema]['total']:,}", flush=True)
            elif phase == "pinned" and elapsed >= unpin_at:
                assert pin is not None
                end = census(engine, [s.schema for s in systems], exact, pin)
                end["pinned_seconds"] = round(time.monotonic() - pinned_since, 1)
                censuses["end_of_pinned"] = end
                pin.__exit__(None, None, None)
                pin = None
                phase = "recovery"
                # the recovery phase lasts its length from the unpin (the census before it
                # can take seconds on a loaded host), so it always gets its samples
                total = time.monotonic() - t0 + recovery_s
                print(f"t={elapsed:6.1f}s pinned   census at the end of the pinned phase: qstore "
                      f"dead={end[qstore.schema]['total']:,}", flush=True)
            if elapsed >= next_sample:  # on the --sample grid; a slot a census overran is skipped
                next_sample = (math.floor(elapsed / args.sample) + 1) * args.sample
                samples.append(take_sample(engine, systems, counters, last, t0, phase))
            boundary = pin_at if phase == "clean" else unpin_at if phase == "pinned" else total
            time.sleep(max(0.0, min(next_sample, boundary, total) - (time.monotonic() - t0)))
    finally:
        stop.set()
        if pin is not None:
            pin.__exit__(None, None, None)
        for s in systems:
            s.stop_upkeep()
        for t in threads:
            t.join(timeout=10)
    upkeep_errors = maintainer_errors(qstore.maintainer)
    errors = {s.name: counters[s.name].errors[:20] for s in systems}
    errors[qstore.name] += upkeep_errors[:20]
    error_counts = {s.name: count_errors(counters[s.name].errors) for s in systems}
    error_counts[qstore.name].update(count_errors(upkeep_errors))
    result = {
        "config": {k: v for k, v in vars(args).items() if k not in ("url", "plot", "json")},
        "machine": info,
        "emulated_autovacuum": emulate_autovacuum,
        "upkeep": {"kind": args.upkeep,
                   "schedule": vars(qstore.schedule) if args.upkeep == "maintainer" else None,
                   "rotate_every": args.rotate if args.upkeep == "rings" else None},
        "phases": {"clean": clean_s, "pinned": pinned_s, "recovery": recovery_s},
        "dead_tuple_census": {"source": census_source(exact), **censuses},
        "samples": samples,
        "errors": errors,  # the first 20 of each system's (and its upkeep's)
        "error_counts": error_counts,  # all of them, by the message's first line
        "vacuum_errors": vac_errors[:20],
        "qstore_maintenance": qstore.maintenance,
        "qstore_worker_stats": getattr(qstore, "worker_stats", None),
    }
    result["verdict"] = soak_verdict(samples, args.rate, censuses.get("end_of_pinned"), qstore.schema)
    if not args.keep:
        for s in systems:
            s.drop(engine)
    engine.dispose()
    return result


def take_sample(engine: Engine, systems: list[System], counters: dict[str, Counters],
                last: dict[str, tuple[int, float]], t0: float, phase: str) -> dict[str, Any]:
    """One row of the time series (and its progress line); ``last`` holds each system's
    completed count and clock at the previous sample (updated here)."""
    now = time.monotonic()
    tables = sample_tables(engine, [s.schema for s in systems])
    row: dict[str, Any] = {"t": round(now - t0, 1), "phase": phase}
    for s in systems:
        c = counters[s.name]
        done = s.completed(c)
        prev_done, prev_at = last[s.name]
        row[s.name] = {
            "dead": sum(f["dead"] for f in tables[s.schema].values()),
            "bytes": sum(f["bytes"] for f in tables[s.schema].values()),
            "families": tables[s.schema],
            "completed_per_s": (done - prev_done) / (now - prev_at) if prev_at else None,
            "backlog": c.enqueued - done,
        }
        last[s.name] = (done, now)
    print(f"t={row['t']:6.1f}s {phase:8s} " + "  ".join(
        f"{s.name}: dead={row[s.name]['dead']:>8,} bytes={row[s.name]['bytes'] / 2**20:7.1f}MiB "
        f"rate={row[s.name]['completed_per_s'] or 0:7.0f}/s backlog={row[s.name]['backlog']:>6,}"
        for s in systems), flush=True)
    return row


def soak_verdict(samples: list[dict[str, Any]], rate: float,
                 end_of_pinned: dict[str, Any] | None, qstore_schema: str) -> dict[str, Any]:
    """The issue-5 targets from the samples, and the upkeep target from the census taken at
    the end of the pinned phase (SKIP when the run stopped before it)."""
    def phase(p: str) -> list[dict[str, Any]]:
        return [s for s in samples if s["phase"] == p]

    pinned, clean, recovery = phase("pinned"), phase("clean"), phase("recovery")
    end_pinned = pinned[-1]
    dead_q, dead_c = end_pinned["qstore"]["dead"], end_pinned["classic"]["dead"]
    dead_pct = 100.0 * dead_q / dead_c if dead_c else None
    clean_bytes = statistics.median(s["qstore"]["bytes"] for s in clean[len(clean) // 2:])
    end_bytes = recovery[-1]["qstore"]["bytes"]
    bytes_ratio = end_bytes / clean_bytes
    rates = {p: {n: statistics.median(x for s in phase(p) if (x := s[n]["completed_per_s"]) is not None)
                 for n in ("qstore", "classic")} for p in ("clean", "pinned", "recovery")}
    return {
        "dead_end_of_pinned": {"qstore": dead_q, "classic": dead_c, "qstore_pct_of_classic": dead_pct,
                               "target": "<= 1 %", "result": "PASS" if dead_pct is not None and dead_pct <= 1 else "FAIL"},
        "qstore_bytes": {"clean_median": clean_bytes, "end_of_recovery": end_bytes, "ratio": bytes_ratio,
                         "target": "<= 1.10", "result": "PASS" if bytes_ratio <= 1.10 else "FAIL"},
        "median_completed_per_s": rates,
        "qstore_pinned_rate": {"value": rates["pinned"]["qstore"], "target": f">= {0.9 * rate:.0f}/s",
                               "result": "PASS" if rates["pinned"]["qstore"] >= 0.9 * rate else "FAIL"},
        "upkeep_dead_end_of_pinned": upkeep_verdict(end_of_pinned, qstore_schema),
    }


def upkeep_verdict(end_of_pinned: dict[str, Any] | None, schema: str) -> dict[str, Any]:
    """Dead tuples in the whole qstore schema at the end of the pinned phase against
    ``UPKEEP_DEAD_TARGET``; a pinned phase shorter than ``UPKEEP_PINNED_SECONDS`` is noted
    (the target is for that long)."""
    if end_of_pinned is None:
        return verdict(None, "<=", UPKEEP_DEAD_TARGET, "no census: the pinned phase did not end")
    pinned_s = end_of_pinned["pinned_seconds"]
    note = (None if pinned_s >= UPKEEP_PINNED_SECONDS else
            f"pinned for {pinned_s:g} s; the target is for {UPKEEP_PINNED_SECONDS:g} s")
    out = verdict(end_of_pinned[schema]["total"], "<=", UPKEEP_DEAD_TARGET, note)
    out["pinned_seconds"] = pinned_s
    return out


def print_census(result: dict[str, Any], qstore_schema: str, classic_schema: str) -> None:
    """qstore's dead tuples per table at the start and the end of the pinned phase."""
    c = result["dead_tuple_census"]
    start, end = c.get("at_pin_start"), c.get("end_of_pinned")
    if end is None:
        print("no dead-tuple census: the run ended before the pinned phase did")
        return
    print(f"\nDead tuples under the pinned horizon ({c['source']}), pinned for "
          f"{end['pinned_seconds']:g} s (pin still held when counted: "
          f"{'yes' if end['pin_held'] else 'NO'}); qstore upkeep: {result['upkeep']['kind']}")
    if result["emulated_autovacuum"]:
        print(f"  autovacuum is off: the script ran VACUUM every {result['config']['vacuum_interval']:g} s "
              "(also while pinned: VACUUM cannot remove a tuple deleted after the pin began, so "
              "it hides nothing the pinned phase left); the qstore schema was vacuumed just "
              "before the pin")
    before = start[qstore_schema]["tables"] if start else {}
    rows = sorted(end[qstore_schema]["tables"].items(), key=lambda kv: (-kv[1]["dead"], kv[0]))
    print(f"  {'qstore table':<36} {'at pin start':>12} {'end of pinned':>14} {'live':>8}")
    for name, t in rows:
        if t["dead"] or before.get(name, {}).get("dead"):
            print(f"  {name:<36} {before.get(name, {}).get('dead', 0):>12,} {t['dead']:>14,} "
                  f"{t['live']:>8,}")
    print(f"  {'total qstore schema':<36} {start[qstore_schema]['total'] if start else 0:>12,} "
          f"{end[qstore_schema]['total']:>14,}")
    print(f"  {'total classic schema':<36} {start[classic_schema]['total'] if start else 0:>12,} "
          f"{end[classic_schema]['total']:>14,}")


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result["samples"]
    t = [s["t"] for s in samples]
    fig, axes = plt.subplots(3, 1, figsize=(10, 10), sharex=True)
    for name, style in (("qstore", "-"), ("classic", "--")):
        axes[0].plot(t, [max(1, s[name]["dead"]) for s in samples], style, label=name)
        axes[1].plot(t, [s[name]["bytes"] / 2**20 for s in samples], style, label=name)
        axes[2].plot(t, [s[name]["completed_per_s"] or 0 for s in samples], style, label=name)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("dead tuples (n_dead_tup)")
    axes[1].set_ylabel("total bytes (MiB)")
    axes[2].set_ylabel("completed jobs/s")
    axes[2].set_xlabel("seconds")
    pinned = [s["t"] for s in samples if s["phase"] == "pinned"]
    for ax in axes:
        if pinned:
            ax.axvspan(min(pinned), max(pinned), color="orange", alpha=0.15,
                       label="horizon pinned" if ax is axes[0] else None)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper left")
    cfg = result["config"]
    classic = f"classic: {cfg['workers']} threads, claim {cfg['batch']}"
    if cfg.get("qstore_driver") == "worker":
        qstore = "qstore: Worker, default settings, maintainer inside"
    else:
        upkeep = ("Maintainer" if cfg.get("upkeep") == "maintainer"
                  else f"rings every {cfg['rotate']:g} s")
        qstore = f"qstore: {cfg['workers']} threads, claim {cfg['batch']}, {upkeep}"
    fig.suptitle(f"steady soak, {cfg['rate']:,.0f} jobs/s offered to each; {qstore}; {classic}",
                 fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=DEFAULT_URL)
    p.add_argument("--rate", type=float, default=1000.0, help="offered jobs/s per system")
    p.add_argument("--duration", type=float, default=600.0, help="seconds, split in three phases")
    p.add_argument("--workers", type=int, default=4, help="draining threads per system")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--qstore-driver", choices=("loop", "worker"), default="loop",
                   help="what drains qstore: --workers threads looping claim + complete "
                        "(default) or qstore's Worker with its default settings (its "
                        "maintainer inside; --workers, --batch and --upkeep then apply to the "
                        "classic queue only)")
    p.add_argument("--upkeep", choices=("maintainer", "rings"), default="maintainer",
                   help="qstore upkeep: the product's Maintainer (default) or the bare ring "
                        "ticker (rotate + prune of the three rings every --rotate seconds)")
    p.add_argument("--schedule", action="append", default=[], metavar="NAME=VALUE",
                   help="a MaintenanceSchedule field for --upkeep maintainer, e.g. "
                        "queue_ring_every=0.5 (repeatable; default: the default schedule)")
    p.add_argument("--rotate", type=float, default=1.0,
                   help="ring ticker interval (s), --upkeep rings only")
    p.add_argument("--clean-seconds", type=float, help="default: a third of --duration")
    p.add_argument("--pinned-seconds", type=float, help="default: a third of --duration")
    p.add_argument("--recovery-seconds", type=float, help="default: a third of --duration")
    p.add_argument("--sample", type=float, default=5.0)
    p.add_argument("--vacuum-interval", type=float, default=10.0,
                   help="VACUUM both systems this often when server autovacuum is off (0: never)")
    p.add_argument("--qstore-shards", type=int, default=None,
                   help="enqueue shards of the benchmark queue (default: qstore's default, 8)")
    p.add_argument("--qstore-schema", default="steady_qstore")
    p.add_argument("--classic-schema", default="steady_classic")
    p.add_argument("--json", type=Path, default=None, help="write the run's series and verdicts here")
    p.add_argument("--plot", type=Path, default=None, help="draw the run into this PNG file")
    p.add_argument("--keep", action="store_true")
    a = p.parse_args(argv)
    a.schedule = parse_schedule(p, a.schedule)
    if a.duration <= 0 or any(v is not None and v <= 0 for v in
                              (a.clean_seconds, a.pinned_seconds, a.recovery_seconds)):
        p.error("--duration and the phase lengths must be > 0")
    return a


def parse_schedule(p: argparse.ArgumentParser, items: list[str]) -> dict[str, Any]:
    """``NAME=VALUE`` items as MaintenanceSchedule keyword arguments (validated by it)."""
    known = {f.name: f.type for f in fields(MaintenanceSchedule)}
    out: dict[str, Any] = {}
    for item in items:
        name, sep, value = (x.strip() for x in item.partition("="))
        if not sep or name not in known:
            p.error(f"--schedule expects NAME=VALUE with NAME one of {', '.join(known)}; got {item!r}")
        try:
            out[name] = int(value) if known[name] in (int, "int") else float(value)
        except ValueError:
            p.error(f"--schedule {name}: {value!r} is not a number")
    try:
        MaintenanceSchedule(**out)
    except ValueError as err:
        p.error(f"--schedule: {err}")
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    result["command"] = " ".join(["python", "scripts/bench_steady.py", *(argv or sys.argv[1:])])
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        slim = dict(result, samples=[{k: v for k, v in s.items()} for s in result["samples"]])
        args.json.write_text(json.dumps(slim, indent=1, default=str) + "\n")
    if args.plot is not None:
        try:
            plot(result, args.plot)
            print(f"wrote {args.plot}")
        except ImportError:
            print("matplotlib is not installed (pip install -e '.[dev]'): no plot", file=sys.stderr)
    print_census(result, args.qstore_schema, args.classic_schema)
    print(json.dumps(result["verdict"], indent=2))
    up = result["verdict"]["upkeep_dead_end_of_pinned"]
    print(f"{up['result']}  dead tuples in the whole qstore schema at the end of the pinned phase: "
          f"{up['value'] if up['value'] is not None else 'n/a'} (target {up['target']})"
          + (f"  [{up['note']}]" if up.get("note") else ""))
    print("errors (by first line, all of them):", json.dumps(result["error_counts"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
