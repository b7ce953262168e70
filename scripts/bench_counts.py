"""How long the exact counts and a job's lookup take on a backlog that was claimed one job
at a time.

A queue's available count is its ready rows that no claim range of their lane covers. A
trickle claims one job per call, so each claimed job leaves a claim range of its own, and
the ready rows (claimed or not) stay in the queue ring until its slot is pruned. This script
loads ``--jobs`` jobs with COPY (``--lanes`` COPY calls, one lane each), claims and completes
``--claimed`` of them ``--claim-batch`` jobs per call (default 1) on one connection, then
times, ``--rounds`` times each and alternating:

* ``queue_counts`` of the qstore this interpreter imports (run it with
  ``PYTHONPATH=<checkout>`` to measure another release);
* the available count written as its definition, one covering-range lookup per ready row
  (``NOT EXISTS`` a range of the row's lane with ``first_seq <= lane_seq <= last_seq``), the
  form the exact counts used before they read the ranges in one ordered pass;
* ``age_waiting_priorities`` with nothing old enough to lift (its candidates' scan only),
  then with every row old enough, lifting ``10`` jobs a call (each round moves ten more
  unclaimed jobs: a tombstone and a new ready row each; the counts do not change);
* ``load_job`` of the first job completed and of the last job enqueued (still available),
  ``--lookups`` calls each per round (the median call). No statistics are gathered on the
  schema (this server runs with autovacuum off), so the planner sees only the tables' sizes.

Reported: the medians in milliseconds. The script installs a schema of its own and drops it
at the end.

    python scripts/bench_counts.py --jobs 40000 --claimed 20000 --rounds 5
    python scripts/bench_counts.py --jobs 40000 --claimed 20000 --claim-batch 32 --lanes 1 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _benchlib import finish

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
QUEUE = "counted"

PER_ROW_LOOKUP = """SELECT count(*) FROM {s}.ready_entries r WHERE r.queue = :queue
  AND NOT EXISTS (SELECT 1 FROM {s}.ready_tombstones t
                  WHERE (t.ready_slot, t.queue, t.priority, t.enqueue_shard, t.lane_seq)
                      = (r.ready_slot, r.queue, r.priority, r.enqueue_shard, r.lane_seq))
  AND NOT EXISTS (SELECT 1 FROM {s}.ready_claim_ranges c
                  WHERE (c.queue, c.priority, c.enqueue_shard) = (r.queue, r.priority, r.enqueue_shard)
                    AND c.first_seq <= r.lane_seq AND c.last_seq >= r.lane_seq)"""


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return (time.perf_counter() - t0) * 1000.0, out


def measure(url: str, schema: str, jobs: int, claimed: int, batch: int, lanes: int, rounds: int,
            lookups: int = 20) -> dict[str, Any]:
    """Install ``schema``, build the backlog, time the reads; the medians (ms) and the counts."""
    from sqlalchemy import create_engine, text

    from qstore import InsertOpts, InsertParams, QueueStorage, QueueStorageConfig
    from qstore.migrate import upgrade

    config = QueueStorageConfig(schema=schema)
    engine = create_engine(url, pool_size=3)
    with engine.begin() as conn:
        upgrade(conn, config)
    storage = QueueStorage(config)
    try:
        params = [InsertParams("counted", {"n": i}, InsertOpts(queue=QUEUE)) for i in range(jobs)]
        step = -(-jobs // max(1, lanes))
        for i in range(0, jobs, step):
            storage.enqueue_params_copy(engine, params[i:i + step])
        first_done: int | None = None
        with engine.connect() as conn:
            for i in range(0, claimed, batch):
                got = storage.claim_runtime_batch(conn, QUEUE, min(batch, claimed - i))
                storage.complete_runtime_batch(conn, got)
                conn.commit()
                if first_done is None and got:
                    first_done = got[0].job.id
            last_job = conn.execute(text(f'SELECT max(job_id) FROM "{schema}".ready_entries')).scalar_one()
        lookup = text(PER_ROW_LOOKUP.format(s=f'"{schema}"'))
        with engine.connect() as conn:
            ranges = conn.execute(text(f'SELECT count(*) FROM "{schema}".ready_claim_ranges')).scalar_one()
        times: dict[str, list[float]] = {"queue_counts": [], "per_row_lookup": [], "age_waiting_priorities": [],
                                         "age_waiting_priorities_all_old": [], "load_job_completed": [],
                                         "load_job_available": []}
        counts: Any = None
        looked_up = None
        for _ in range(rounds):
            ms, counts = timed(lambda: storage.queue_counts(engine, QUEUE))
            times["queue_counts"].append(ms)
            with engine.connect() as conn:
                ms, looked_up = timed(lambda: conn.execute(lookup, {"queue": QUEUE}).scalar_one())
            times["per_row_lookup"].append(ms)
            ms, _ = timed(lambda: storage.age_waiting_priorities(engine, 3600, 10))
            times["age_waiting_priorities"].append(ms)
            ms, _ = timed(lambda: storage.age_waiting_priorities(engine, 0.001, 10))
            times["age_waiting_priorities_all_old"].append(ms)
            for key, job_id in (("load_job_completed", first_done), ("load_job_available", last_job)):
                if job_id is not None:
                    calls = []
                    for _ in range(lookups):
                        t0 = time.perf_counter()
                        storage.load_job(engine, job_id)
                        calls.append((time.perf_counter() - t0) * 1000.0)
                    times[key].append(statistics.median(calls))
    finally:
        with engine.begin() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        engine.dispose()
    if counts.available != looked_up:
        raise SystemExit(f"queue_counts says {counts.available} available, the per-row lookup {looked_up}")
    return {"jobs": jobs, "claimed": claimed, "claim_batch": batch, "claim_ranges": int(ranges),
            "available": counts.available,
            **{f"{k}_ms": statistics.median(v) if v else None for k, v in times.items()}, "rounds_ms": times}


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f} ms"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--url", default=DEFAULT_URL)
    parser.add_argument("--jobs", type=int, default=40_000)
    parser.add_argument("--claimed", type=int, default=20_000, help="jobs claimed (and completed)")
    parser.add_argument("--claim-batch", type=int, default=1, help="jobs per claim call")
    parser.add_argument("--lanes", type=int, default=8, help="COPY calls that load the jobs, one lane each")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--lookups", type=int, default=20, help="load_job calls per job and round")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    schema = f"qstore_counts_{uuid.uuid4().hex[:8]}"
    f = measure(args.url, schema, args.jobs, args.claimed, args.claim_batch, args.lanes, args.rounds, args.lookups)
    print(f"{f['jobs']:,} jobs in {args.lanes} lanes, {f['claimed']:,} claimed {args.claim_batch} per call "
          f"({f['claim_ranges']:,} claim ranges), {f['available']:,} available; medians of {args.rounds}: "
          f"queue_counts {f['queue_counts_ms']:.1f} ms, available by a lookup per row "
          f"{f['per_row_lookup_ms']:.1f} ms, age_waiting_priorities {f['age_waiting_priorities_ms']:.1f} ms "
          f"(nothing old) / {f['age_waiting_priorities_all_old_ms']:.1f} ms (all old), load_job "
          f"{_ms(f['load_job_completed_ms'])} (a completed job) / {_ms(f['load_job_available_ms'])} (an available one)")
    return finish(Path(args.json) if args.json else None, f, [])


if __name__ == "__main__":
    raise SystemExit(main())
