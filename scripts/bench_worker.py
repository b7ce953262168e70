"""The worker benchmark: qstore's :class:`qstore.worker.Worker` with its default settings,
side by side in one run with the same storage driven by a plain loop and with the in-repo
classic SKIP LOCKED queue driven by the equivalent loop.

Two modes (``--mode``, default both):

``drain`` — per phase (``clean``, then ``pinned``: another session holds an xid from before
the drain until the dead tuples are counted) and per system, N no-op jobs (``--jobs``,
default 20,000) are loaded with COPY into a fresh schema, then drained with
``--concurrency`` (16) concurrent handlers:

* ``classic`` — 16 threads loop claim 10 / no-op handler per job / ``DELETE`` the batch
  (each call one autocommitted statement): the natural loop of ``bench_storage.py``;
* ``storage`` — the same loop over qstore's storage API with an Engine target
  (``claim_runtime_batch(engine, queue, 10)`` / handler / ``complete_runtime_batch``): the
  storage-level rate the worker is held to;
* ``worker`` — a :class:`~qstore.tasks.App` with one no-op task and a
  :class:`~qstore.worker.Worker` (``concurrency=16``, every other setting its default, the
  maintainer running inside as by default); the drain runs from ``worker.start()`` until the
  queue shows no available and no running job. The worker process's CPU time and the server
  transactions it committed are divided by the jobs drained.

``pickup`` — a producer calls ``task.defer(engine, ...)`` once per job at ``--rate`` jobs/s
for ``--duration`` seconds (after ``--warmup`` seconds that are not measured) while a
default worker runs; pickup latency = handler start - the clock read right after ``defer``
returned (one process, one clock), clean and pinned. It also lines the worker maintainer's
runs up with the pickups: per task, the share of all pickups and of the slowest 5% whose
wait overlapped one of its runs (``tail_overlap``). The classic queue's figure for the same
schedule comes from ``bench_storage.py --mode steady`` (its LISTEN/NOTIFY-woken loop).

Targets: worker >= 0.6x classic clean and >= 1.2x pinned, >= 8,000 jobs/s in both, >= 0.8x the
storage-level rate of the same run; pickup p95 ≤ 5 ms clean, ≤ 10 ms pinned with the producer
holding the offered rate.

    python scripts/bench_worker.py --json worker.json
    python scripts/bench_worker.py --mode pickup --rate 500 --duration 60
"""

from __future__ import annotations

import argparse
import bisect
import sys
import threading
import time
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, text

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_storage as bs
from _benchlib import (
    PacedSchedule,
    checkpoint,
    dead_tuples,
    ensure_database,
    ensure_pgstattuple,
    finish,
    format_table,
    latency_summary,
    make_engine,
    median,
    pinned,
    server_info,
    verdict,
)

from qstore.runtime.maintainer import MaintenanceSchedule
from qstore.tasks import App, JobContext
from qstore.worker import Worker, WorkerSettings

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/bench_worker"
PHASES = ("clean", "pinned")
MODES = ("drain", "pickup")
TARGETS = {
    "clean_vs_classic": 0.6,  # worker / classic, >=
    "pinned_vs_classic": 1.2,  # worker / classic, >=
    "jobs_per_s": 8_000.0,  # worker, >=, both phases
    "vs_storage": 0.8,  # worker / storage-level loop, >=
    "clean_pickup_p95_ms": 5.0,
    "pinned_pickup_p95_ms": 10.0,
}
HOLDS_RATE = 0.99


class Recorder:
    """What the no-op task notes: when each job's handler started (by its ``n``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.started: dict[int, float] = {}
        self.duplicates = 0
        self.all_started = threading.Event()
        self.expected: int | None = None

    def reset(self, expected: int | None) -> None:
        with self.lock:
            self.started = {}
            self.duplicates = 0
            self.expected = expected
            self.all_started.clear()

    def note(self, n: int) -> None:
        at = time.perf_counter()
        with self.lock:
            if n in self.started:
                self.duplicates += 1
                return
            self.started[n] = at
            if self.expected is not None and len(self.started) >= self.expected:
                self.all_started.set()


def make_app(system: bs.QstoreSystem, recorder: Recorder) -> tuple[App, Any]:
    """The app under test: one no-op task of the workload's kind and queue."""
    app = App(system.storage)

    @app.task(kind=bs.KIND, queue=bs.QUEUE, priority=bs.PRIORITY)
    def bench_job(ctx: JobContext, n: int, payload: str = "") -> None:
        recorder.note(n)

    return app, bench_job


def server_xacts(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database "
            "WHERE datname = current_database()")).scalar_one())


def wait_completed(worker: Worker, n: int, timeout: float) -> float:
    """Poll the worker's counters until ``n`` completions were committed; returns when."""
    until = time.perf_counter() + timeout
    while time.perf_counter() < until:
        if worker.stats.completed >= n:
            return time.perf_counter()
        time.sleep(0.002)
    raise RuntimeError(f"the worker committed {worker.stats.completed} of {n} completions "
                       f"within {timeout:.0f} s")


def worker_drain(engine: Engine, system: bs.QstoreSystem, phase: str, n: int,
                 args: argparse.Namespace, exact: bool) -> dict[str, Any]:
    """Load ``n`` jobs, then drain them with a default worker (see the module docstring)."""
    recorder = Recorder()
    app, _ = make_app(system, recorder)
    system.fresh(engine)
    checkpoint(engine)
    prepared = system.convert(bs.workload(n))
    with engine.begin() as conn:
        system.enqueue_copy(conn, prepared)
    recorder.reset(n)
    res: dict[str, Any] = {"system": "worker", "phase": phase, "jobs": n}
    with pinned(engine, phase == "pinned"):
        worker = Worker(app, engine, WorkerSettings(queues=[bs.QUEUE], concurrency=args.concurrency,
                                                        schedule=args.schedule))
        xacts0 = server_xacts(engine)
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        worker.start()
        try:
            if not recorder.all_started.wait(args.timeout):
                raise RuntimeError(f"worker started {len(recorder.started)} of {n} jobs")
            t1 = wait_completed(worker, n, args.timeout)
            cpu = time.process_time() - cpu0
            xacts = server_xacts(engine) - xacts0
        finally:
            worker.stop(timeout=30.0)
        counts = system.storage.queue_counts(engine, bs.QUEUE)
        dead = dead_tuples(engine, system.schema, exact)
    seconds = t1 - t0
    problems = []
    if len(recorder.started) != n:
        problems.append(f"handled {len(recorder.started)} of {n} jobs")
    if recorder.duplicates:
        problems.append(f"{recorder.duplicates} jobs handled twice")
    if counts.available or counts.running:
        problems.append(f"left available={counts.available} running={counts.running}")
    res["drain"] = {"jobs": n, "seconds": seconds, "jobs_per_s": n / seconds,
                    "cpu_us_per_job": cpu / n * 1e6,
                    "server_xacts_per_job": xacts / n}
    res["stats"] = stats_of(worker)
    res["dead_tuples"] = dead
    res["dead_total"] = sum(f["dead"] for f in dead.values())
    res["problems"] = problems
    return res


def stats_of(worker: Worker) -> dict[str, Any]:
    stats = getattr(worker, "stats", None)
    if stats is None:
        return {}
    if hasattr(stats, "as_dict"):
        return dict(stats.as_dict())
    if hasattr(stats, "__dataclass_fields__"):
        return {k: getattr(stats, k) for k in stats.__dataclass_fields__}
    return {"repr": repr(stats)}


def loop_drain(engine: Engine, system: Any, phase: str, n: int, args: argparse.Namespace,
               exact: bool) -> dict[str, Any]:
    """The natural loop of ``bench_storage.py`` (16 threads, claim 10, handler, complete)."""
    nat = bs.parse_args(["--mode", "natural", "--jobs", str(n), "--threads", str(args.concurrency)])
    nat.batch = 10
    name = "storage" if isinstance(system, bs.QstoreSystem) else "classic"
    res: dict[str, Any] = {"system": name, "phase": phase, "jobs": n}
    system.fresh(engine)
    checkpoint(engine)
    bs.load_for_drain(engine, system, system.convert(bs.workload(n)), nat, fresh=False)
    res.update(bs.measured_drain(engine, system, phase, n, nat, exact, own_transactions=True,
                                 handle=bs.handler, tolerate_errors=True))
    return res


def run_drain(engine: Engine, args: argparse.Namespace, exact: bool) -> list[dict[str, Any]]:
    qsys = bs.QstoreSystem(args.qstore_schema, None, deadline=None)
    csys = bs.ClassicSystem(args.classic_schema)
    results = []
    try:
        for rnd in range(1, args.rounds + 1):
            for phase in args.phases:
                for label, fn in (("classic", lambda p: loop_drain(engine, csys, p, args.jobs, args, exact)),
                                  ("storage", lambda p: loop_drain(engine, qsys, p, args.jobs, args, exact)),
                                  ("worker", lambda p: worker_drain(engine, qsys, p, args.jobs, args, exact))):
                    print(f"... drain round {rnd}/{args.rounds}: {label} / {phase}", flush=True)
                    r = fn(phase)
                    r["round"] = rnd
                    results.append(r)
    finally:
        qsys.drop(engine)
        csys.drop(engine)
    return results


def summarise_drain(results: list[dict[str, Any]]) -> dict[str, Any]:
    med: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        med.setdefault(f"{r['system']}/{r['phase']}", []).append(r)
    out: dict[str, Any] = {}
    for key, rs in med.items():
        out[key] = {
            "rounds": len(rs),
            "jobs_per_s": median([x["drain"]["jobs_per_s"] for x in rs]),
            "jobs_per_s_all": [round(x["drain"]["jobs_per_s"]) for x in rs],
            "dead_total": median([x["dead_total"] for x in rs]),
        }
        if rs[0]["system"] == "worker":
            out[key]["cpu_us_per_job"] = median([x["drain"]["cpu_us_per_job"] for x in rs])
            out[key]["server_xacts_per_job"] = median([x["drain"]["server_xacts_per_job"] for x in rs])

    def rate(system: str, phase: str) -> float | None:
        m = out.get(f"{system}/{phase}")
        return None if m is None else m["jobs_per_s"]

    ratios = {phase: {"vs_classic": bs.ratio(rate("worker", phase), rate("classic", phase)),
                      "vs_storage": bs.ratio(rate("worker", phase), rate("storage", phase))}
              for phase in PHASES}
    t = TARGETS
    targets = {
        "clean_vs_classic": verdict(ratios["clean"]["vs_classic"], ">=", t["clean_vs_classic"]),
        "pinned_vs_classic": verdict(ratios["pinned"]["vs_classic"], ">=", t["pinned_vs_classic"]),
        "clean_jobs_per_s": verdict(rate("worker", "clean"), ">=", t["jobs_per_s"]),
        "pinned_jobs_per_s": verdict(rate("worker", "pinned"), ">=", t["jobs_per_s"]),
        "clean_vs_storage": verdict(ratios["clean"]["vs_storage"], ">=", t["vs_storage"]),
        "pinned_vs_storage": verdict(ratios["pinned"]["vs_storage"], ">=", t["vs_storage"]),
    }
    return {"medians": out, "ratios": ratios, "targets": targets}


def print_drain(results: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    rows = [[r["system"], r["phase"], r["round"], bs.fmt(r["drain"]["jobs_per_s"]),
             f"{r['drain']['seconds']:.2f}",
             bs.fmt(r["drain"].get("cpu_us_per_job"), ".0f"),
             bs.fmt(r["drain"].get("server_xacts_per_job"), ".2f"),
             bs.fmt(r["dead_total"]), "; ".join(r["problems"]) or "ok"] for r in results]
    print()
    print(format_table(["system", "phase", "round", "drain j/s", "seconds", "client CPU µs/job",
                        "server xacts/job", "dead tuples", "check"], rows))
    print("\nRatios (worker / classic loop, worker / storage loop):")
    for phase, rr in summary["ratios"].items():
        print(f"  {phase:<6}  vs classic {bs.times(rr['vs_classic'])}   "
              f"vs storage {bs.times(rr['vs_storage'])}")
    bs.print_targets(summary["targets"], "worker drain")


class TaskRuns:
    """Every run of the worker's maintenance tasks during a pickup phase, collected from
    :meth:`Maintainer.reports` (which keeps only the latest runs per task) every 0.2 s."""

    def __init__(self, worker: Worker) -> None:
        self.maintainer = worker.maintainer
        self.runs: dict[tuple[str, float], float] = {}  # (task, started) -> duration
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="bench-task-runs", daemon=True)

    def _collect(self) -> None:
        if self.maintainer is not None:
            for r in self.maintainer.reports():
                self.runs[(r.task, r.started)] = r.duration

    def _poll(self) -> None:
        while not self._stop.wait(0.2):
            self._collect()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._collect()


def tail_overlap(runs: TaskRuns, pickups: list[tuple[float, float]], tail: float = 0.05) -> dict[str, Any]:
    """Per maintenance task: how many runs, their median length, and the share of all
    pickups and of the slowest ``tail`` of them whose wait (enqueue commit → handler start,
    on ``time.perf_counter``) overlapped at least one run. A task the tail overlaps far more
    often than the rest is part of the tail."""
    shift = time.perf_counter() - time.monotonic()  # the same clock on Linux; kept exact anyway
    by_task: dict[str, list[tuple[float, float]]] = {}
    for (task, started), duration in runs.runs.items():
        by_task.setdefault(task, []).append((started + shift, started + shift + duration))
    ordered = sorted(pickups, key=lambda p: p[1] - p[0])
    slowest = ordered[int(len(ordered) * (1 - tail)):]

    def share(group: list[tuple[float, float]], spans: list[tuple[float, float]]) -> float:
        # the runs of one task follow each other, so the last run that began before a
        # pickup ended is the only one that can still have been going when it started
        starts = [s for s, _ in spans]
        hit = 0
        for a, b in group:
            i = bisect.bisect_right(starts, b) - 1
            hit += i >= 0 and spans[i][1] >= a
        return hit / len(group) if group else 0.0

    out = {}
    for task, spans in sorted(by_task.items()):
        spans.sort()
        lengths = sorted(e - s for s, e in spans)
        out[task] = {"runs": len(spans), "run_p50_ms": lengths[len(lengths) // 2] * 1000,
                     "all_share": share(ordered, spans), "tail_share": share(slowest, spans)}
    return out


def schedule_setting(text: str) -> tuple[str, float | int]:
    """``FIELD=VALUE`` of ``--schedule``: an int for a field whose default is an int."""
    name, _, value = text.partition("=")
    default = getattr(MaintenanceSchedule(), name, None)
    if default is None or not value:
        raise argparse.ArgumentTypeError(f"expected FIELD=VALUE with a MaintenanceSchedule field, got {text!r}")
    return name, int(value) if isinstance(default, int) else float(value)


def run_pickup(engine: Engine, args: argparse.Namespace, exact: bool) -> list[dict[str, Any]]:
    qsys = bs.QstoreSystem(args.qstore_schema, None, deadline=None)
    results = []
    try:
        for phase in args.phases:
            print(f"... pickup: worker / {phase}", flush=True)
            recorder = Recorder()
            app, task = make_app(qsys, recorder)
            qsys.fresh(engine)
            checkpoint(engine)
            worker = Worker(app, engine, WorkerSettings(queues=[bs.QUEUE], concurrency=args.concurrency,
                                                        schedule=args.schedule))
            errors: dict[str, int] = {}

            def note(exc: Exception, errors: dict[str, int] = errors) -> None:
                key = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
                errors[key] = errors.get(key, 0) + 1

            def defer_one(i: int, task: Any = task) -> int:
                return int(task.defer(engine, n=i, payload="x" * 16))

            schedule = PacedSchedule(
                rate=args.rate, seconds=args.duration, warmup=args.warmup,
                enqueue_one=defer_one, producers=args.producers, on_error=note)
            runs = TaskRuns(worker)
            with pinned(engine, phase == "pinned"):
                worker.start()
                runs.start()
                try:
                    schedule.run()
                    schedule.settle(recorder.started, recorder.lock, 30.0)
                finally:
                    worker.stop(timeout=30.0)
                    runs.stop()
                dead = dead_tuples(engine, qsys.schema, exact)
            m = schedule.measured(recorder.started)
            pickups = [(schedule.commit_at[i], recorder.started[i]) for i in m.jobs if i in recorder.started]
            achieved = len(m.jobs) / m.producer_seconds if m.producer_seconds else 0.0
            problems = []
            if m.missing:
                problems.append(f"{m.missing} enqueued jobs never picked up")
            if recorder.duplicates:
                problems.append(f"{recorder.duplicates} jobs picked up twice")
            results.append({
                "system": "worker", "phase": phase, "offered_rate": args.rate,
                "achieved_rate": achieved, "holds_rate": achieved >= HOLDS_RATE * args.rate,
                "enqueued": len(m.jobs), "pickup_ms": latency_summary(m.latencies),
                "defer_call_ms": latency_summary(m.enqueue_seconds),
                "producer_lag_ms": latency_summary(m.lag_seconds),
                "errors": errors, "stats": stats_of(worker),
                "dead_total": sum(f["dead"] for f in dead.values()), "problems": problems,
                "tail_overlap": tail_overlap(runs, pickups),
            })
    finally:
        qsys.drop(engine)
    return results


def summarise_pickup(results: list[dict[str, Any]]) -> dict[str, Any]:
    targets = {}
    for r in results:
        key = f"{r['phase']}_pickup_p95_ms"
        v = verdict(r["pickup_ms"]["p95_ms"], "<=", TARGETS[key],
                    None if r["holds_rate"] else f"producer reached {r['achieved_rate']:,.0f}/s")
        if not r["holds_rate"]:
            v["result"] = "FAIL"
        targets[key] = v
    return {"targets": targets}


def print_pickup(results: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    rows = [[r["phase"], f"{r['achieved_rate']:,.0f}/{r['offered_rate']:,.0f}",
             "yes" if r["holds_rate"] else "NO", r["enqueued"],
             bs.fmt(r["pickup_ms"]["p50_ms"], ".2f"), bs.fmt(r["pickup_ms"]["p95_ms"], ".2f"),
             bs.fmt(r["pickup_ms"]["p99_ms"], ".2f"), bs.fmt(r["defer_call_ms"]["p50_ms"], ".2f"),
             sum(r["errors"].values()), bs.fmt(r["dead_total"]), "; ".join(r["problems"]) or "ok"]
            for r in results]
    print()
    print(format_table(["phase", "rate j/s", "holds", "jobs", "pickup p50 ms", "p95", "p99",
                        "defer p50 ms", "errors", "dead", "check"], rows))
    bs.print_targets(summary["targets"], "worker pickup")
    print("\nMaintenance runs the pickups overlapped (all pickups vs the slowest 5%):")
    rows = [[r["phase"], task, o["runs"], f"{o['run_p50_ms']:.1f}", f"{o['all_share']:.1%}",
             f"{o['tail_share']:.1%}"]
            for r in results for task, o in r["tail_overlap"].items()]
    print(format_table(["phase", "task", "runs", "run p50 ms", "of all pickups", "of slowest 5%"], rows))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=(*MODES, "all"), default="all")
    p.add_argument("--url", default=DEFAULT_URL)
    p.add_argument("--jobs", type=int, default=20_000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--phases", default=",".join(PHASES), type=lambda s: s.split(","))
    p.add_argument("--rate", type=float, default=500.0)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--producers", type=int, default=2)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a drain may take")
    p.add_argument("--qstore-schema", default="bench_worker_qstore")
    p.add_argument("--classic-schema", default="bench_worker_classic")
    p.add_argument("--json", type=Path)
    p.add_argument("--schedule", type=schedule_setting, action="append", default=[], metavar="FIELD=VALUE",
                   help="a MaintenanceSchedule field of the worker's maintainer (repeatable), e.g. "
                        "claim_ring_turn_bytes=0")
    args = p.parse_args(argv)
    args.schedule = MaintenanceSchedule(**dict(args.schedule)) if args.schedule else None
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ensure_database(args.url)
    engine = make_engine(args.url, args.concurrency + args.producers + 4)
    exact = ensure_pgstattuple(engine)
    info = server_info(engine)
    pg = info["postgres"]
    print(f"bench_worker: {args.jobs:,} jobs, concurrency {args.concurrency}, PostgreSQL "
          f"{pg['server_version']}, autovacuum {pg['autovacuum']}, {info['cpus']} CPUs")
    payload: dict[str, Any] = {
        "command": " ".join(["python", "scripts/bench_worker.py", *(argv or sys.argv[1:])]),
        "machine": info, "config": {k: str(v) for k, v in vars(args).items() if k != "url"},
    }
    problems: list[str] = []
    try:
        if args.mode in ("drain", "all"):
            drained = run_drain(engine, args, exact)
            summary = summarise_drain(drained)
            print_drain(drained, summary)
            payload["drain"] = {"results": drained, "summary": summary}
            problems += [f"drain {r['system']}/{r['phase']}: {p}" for r in drained for p in r["problems"]]
        if args.mode in ("pickup", "all"):
            picked = run_pickup(engine, args, exact)
            summary = summarise_pickup(picked)
            print_pickup(picked, summary)
            payload["pickup"] = {"results": picked, "summary": summary}
            problems += [f"pickup {r['phase']}: {p}" for r in picked for p in r["problems"]]
    finally:
        engine.dispose()
    payload["problems"] = problems
    return finish(args.json, payload, problems)


if __name__ == "__main__":
    raise SystemExit(main())
