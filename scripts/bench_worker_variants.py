"""Worker runtime benchmark: how fast a :class:`qstore.worker.Worker` drains no-op jobs with
each claim strategy and a few settings, and how soon it picks up a job enqueued while idle.

Each variant gets a fresh schema: ``--jobs`` jobs are enqueued (COPY) into one queue, then a
worker (no maintainer) is started and timed until every job is completed. Variants:

* ``loop``: no worker, the hand-written loop an application writes without one (``concurrency``
  threads, each claiming 10, calling the handler per job, completing the batch): the
  reference;
* ``plain``: ``claim_runtime_batch`` (the default), ``claim_batch`` (default 64), ``concurrency`` 16;
* ``claimers``: the same through bounded claimers (``max_claimers`` 4:
  ``claim_runtime_batch_with_aging_for_instance``);
* ``batch10``: claim batches of 10; ``prefetch``: 16 claimed jobs may wait for a handler;
* ``async``: the handler is ``async def`` (one event loop thread).

Pickup: with an idle worker (poll interval 30 s, so only ``LISTEN`` wakes it), single jobs
are enqueued one at a time; pickup = handler start - the moment ``defer`` returned.

Usage::

    python scripts/bench_worker.py --jobs 20000 --rounds 3 --json worker.json
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, text

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _benchlib import ensure_database, latency_summary, make_engine, server_info

from qstore import InsertOpts, InsertParams, QueueStorage, QueueStorageConfig
from qstore.tasks import App, JobContext
from qstore.worker import Worker, WorkerSettings

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/bench_worker"
SCHEMA = "bench_worker"
QUEUE = "bench"

VARIANTS: dict[str, dict[str, Any]] = {
    "loop": {},  # no Worker: the hand-written loop (threads claiming 10 and completing each batch)
    "plain": {},
    "claimers": {"max_claimers": 4},
    "batch10": {"claim_batch": 10},
    "prefetch": {"prefetch": 16},
    "async": {},
}


def fresh_storage(engine: Engine) -> QueueStorage:
    with engine.begin() as conn:
        conn.execute(text(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE"))
    storage = QueueStorage(QueueStorageConfig(schema=SCHEMA))
    storage.install(engine)
    return storage


def make_app(storage: QueueStorage, use_async: bool) -> App:
    app = App(storage)
    if use_async:
        @app.task(kind="noop", queue=QUEUE)
        async def anoop(ctx: JobContext, seq: int) -> None:
            return None
    else:
        @app.task(kind="noop", queue=QUEUE)
        def noop(ctx: JobContext, seq: int) -> None:
            return None
    return app


def hand_loop(engine: Engine, storage: QueueStorage, jobs: int, threads: int) -> dict[str, Any]:
    done = [0]
    calls = [0, 0]
    lock = threading.Lock()

    def handler(ctx: JobContext, seq: int) -> None:
        return None

    def run() -> None:
        while True:
            with lock:
                if done[0] >= jobs:
                    return
            batch = storage.claim_runtime_batch(engine, QUEUE, 10)
            if not batch:
                time.sleep(0.005)
                continue
            for c in batch:
                handler(JobContext(c, storage, engine), **c.job.args)
            n = len(storage.complete_runtime_batch(engine, batch))
            with lock:
                done[0] += n
                calls[0] += 1
                calls[1] += 1

    started = time.monotonic()
    pool = [threading.Thread(target=run) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return {"seconds": time.monotonic() - started, "claim_calls": calls[0], "empty_claims": 0,
            "completion_calls": calls[1], "completed": done[0]}


def drain(engine: Engine, variant: str, jobs: int, concurrency: int) -> dict[str, Any]:
    storage = fresh_storage(engine)
    app = make_app(storage, variant == "async")
    chunk = 5000
    for start in range(0, jobs, chunk):
        storage.enqueue_params_copy(engine, [InsertParams("noop", {"seq": i}, InsertOpts(queue=QUEUE))
                                             for i in range(start, min(jobs, start + chunk))])
    if variant == "loop":
        out = hand_loop(engine, storage, jobs, concurrency)
        counts = storage.queue_counts(engine, QUEUE)
        return {"variant": variant, "jobs": jobs, "jobs_per_s": jobs / out["seconds"], **out,
                "terminal": counts.terminal, "running_left": counts.running}
    settings = WorkerSettings(concurrency=concurrency, maintain=False, **VARIANTS[variant])
    worker = Worker(app, engine, settings)
    started = time.monotonic()
    worker.start()
    while worker.stats.completed + worker.stats.stale_completions < jobs:
        time.sleep(0.01)
        if time.monotonic() - started > 600:
            break
    elapsed = time.monotonic() - started
    stats = worker.stop(5)
    counts = storage.queue_counts(engine, QUEUE)
    return {"variant": variant, "jobs": jobs, "seconds": elapsed, "jobs_per_s": jobs / elapsed,
            "claim_calls": stats.claim_calls, "empty_claims": stats.empty_claims,
            "completion_calls": stats.completion_calls, "completed": stats.completed,
            "terminal": counts.terminal, "running_left": counts.running}


def pickup(engine: Engine, samples: int, gap: float) -> dict[str, Any]:
    storage = fresh_storage(engine)
    app = App(storage)
    starts: dict[int, float] = {}
    seen = threading.Event()

    @app.task(kind="ping", queue=QUEUE)
    def ping(ctx: JobContext, n: int) -> None:
        starts[n] = time.monotonic()
        seen.set()

    worker = Worker(app, engine, WorkerSettings(concurrency=4, poll_interval=30, maintain=False))
    worker.start()
    lat: list[float] = []
    try:
        time.sleep(0.5)
        for n in range(samples):
            seen.clear()
            ping.defer(engine, n=n)
            returned = time.monotonic()
            if seen.wait(5):
                lat.append(starts[n] - returned)
            time.sleep(gap)
    finally:
        worker.stop(5)
    return latency_summary(lat)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=DEFAULT_URL, help=f"database (created if missing; default {DEFAULT_URL})")
    p.add_argument("--jobs", type=int, default=20_000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS))
    p.add_argument("--pickup-samples", type=int, default=200)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    ensure_database(args.url)
    engine = make_engine(args.url, args.concurrency + 8)
    try:
        results: list[dict[str, Any]] = []
        for r in range(args.rounds):
            for variant in args.variants.split(","):
                res = drain(engine, variant, args.jobs, args.concurrency)
                res["round"] = r
                results.append(res)
                print(f"round {r} {variant:>9}: {res['jobs_per_s']:8.0f} jobs/s  claims {res['claim_calls']:6d} "
                      f"(empty {res['empty_claims']})  completion calls {res['completion_calls']:6d}", flush=True)
        medians = {v: statistics.median(x["jobs_per_s"] for x in results if x["variant"] == v)
                   for v in args.variants.split(",")}
        lat = pickup(engine, args.pickup_samples, 0.02) if args.pickup_samples else None
        if lat:
            print(f"pickup (ms): p50 {lat['p50_ms']:.1f}  p95 {lat['p95_ms']:.1f}  p99 {lat['p99_ms']:.1f}")
        report = {"server": server_info(engine), "results": results, "median_jobs_per_s": medians, "pickup": lat}
        for v, m in medians.items():
            print(f"median {v:>9}: {m:8.0f} jobs/s")
        if args.json:
            args.json.write_text(json.dumps(report, indent=2, default=str))
        problems = [x for x in results if x["terminal"] != args.jobs or x["running_left"]]
        return 1 if problems else 0
    finally:
        with engine.begin() as conn:
            conn.execute(text(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE"))
        engine.dispose()


if __name__ == "__main__":
    raise SystemExit(main())
