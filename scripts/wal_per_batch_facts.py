"""WAL per drained job: qstore's facts per job beside a sketch of facts per batch.

A design measurement, not a benchmark of a release: how much of a drained job's WAL the
append-only facts would save if each were written once per batch instead of once per job.
For each claim batch size of ``--batches`` (on one database, one after the other):

* **qstore**: a fresh install, ``--jobs`` jobs loaded with COPY (before the measured
  stretch), then ``complete_and_claim`` calls of ``batch`` jobs on one kept connection until
  every job was claimed and completed: each call completes the batch the previous one
  claimed and claims the next, as a worker's cycle does. Per job it writes a receipt with
  its key and the receipt's lock at completion; per call a claim range, a batch closure
  per block of job ids and a batch done row per lane and block of positions (a lone
  attempt gets narrow ones), and the terminal-count deltas.
* **per batch**: the same work as a sketch with one row per batch for each fact, in tables
  of its own: a claim row holding the batch's job ids, run leases and attempts (in place of
  a receipt per job), the completion's lock on that row, one closure row holding the
  batch's ids and one done row holding its ids, positions, attempts, kinds and states (in
  place of a closure and a done row per job), each row with its primary key; one
  transaction per batch, as the worker's cycle is;
* **classic**: the psycopg classic queue (``classic_psycopg.py``) loaded with COPY and
  vacuumed, drained on one connection by claims of ``batch`` jobs (``UPDATE … SKIP
  LOCKED``), each followed by the ``DELETE`` of its jobs.

WAL per job is the server's WAL between the stretch's start and end over its jobs (a
``CHECKPOINT`` before each load, as the worker benchmark does), so the server must be
otherwise quiet. What the sketch leaves
out is what makes it a redesign rather than a change: finding one job's attempt, rescue,
exact counts and the prune gates over facts that hold many jobs.

    python scripts/wal_per_batch_facts.py --jobs 6400 --batches 1,8,32
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, text

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_storage as bs
from _benchlib import checkpoint, ensure_database, format_table, wal_position, wal_since
from classic_psycopg import ClassicPsycopg

from qstore.storage.targets import keeping_engine, release_kept

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/bench_worker"

#: The sketch's tables and its cycle (``{s}``: its schema), one statement each.
SKETCH = (
    """CREATE TABLE {s}.claim_batches (
         claim_slot integer NOT NULL, batch_id bigint NOT NULL, ready_slot integer NOT NULL,
         ready_generation bigint NOT NULL, queue text NOT NULL, priority smallint NOT NULL,
         enqueue_shard smallint NOT NULL, first_seq bigint NOT NULL, last_seq bigint NOT NULL,
         claimed_at timestamptz NOT NULL, deadline_at timestamptz,
         job_ids bigint[] NOT NULL, run_leases bigint[] NOT NULL, attempts smallint[] NOT NULL,
         PRIMARY KEY (batch_id, claim_slot))""",
    """CREATE TABLE {s}.closure_batches (
         claim_slot integer NOT NULL, batch_id bigint NOT NULL, closure_id bigint NOT NULL,
         job_ids bigint[] NOT NULL, run_leases bigint[] NOT NULL, outcome text NOT NULL,
         PRIMARY KEY (batch_id, closure_id, claim_slot))""",
    """CREATE TABLE {s}.done_batches (
         ready_slot integer NOT NULL, ready_generation bigint NOT NULL, done_id bigint NOT NULL,
         queue text NOT NULL, priority smallint NOT NULL, enqueue_shard smallint NOT NULL,
         job_ids bigint[] NOT NULL, lane_seqs bigint[] NOT NULL, attempts smallint[] NOT NULL,
         run_leases bigint[] NOT NULL, kinds text[] NOT NULL, states text[] NOT NULL,
         finalized_at timestamptz NOT NULL,
         PRIMARY KEY (done_id, ready_slot))""",
    "CREATE SEQUENCE {s}.ids",
    """CREATE FUNCTION {s}.cycle(p_batch integer, p_first bigint) RETURNS void LANGUAGE plpgsql AS $$
       DECLARE
         v_batch bigint := nextval('{s}.ids');
         v_ids bigint[] := ARRAY(SELECT g FROM generate_series(p_first, p_first + p_batch - 1) g);
         v_ones bigint[] := array_fill(1::bigint, ARRAY[p_batch]);
       BEGIN
         INSERT INTO {s}.claim_batches VALUES (0, v_batch, 0, 1, 'bench', 2, 3, p_first,
           p_first + p_batch - 1, now(), NULL, v_ids, v_ones, array_fill(1::smallint, ARRAY[p_batch]));
         PERFORM 1 FROM {s}.claim_batches WHERE batch_id = v_batch AND claim_slot = 0 FOR UPDATE;
         INSERT INTO {s}.closure_batches VALUES (0, v_batch, nextval('{s}.ids'), v_ids, v_ones, 'completed');
         INSERT INTO {s}.done_batches VALUES (0, 1, nextval('{s}.ids'), 'bench', 2, 3, v_ids, v_ids,
           array_fill(1::smallint, ARRAY[p_batch]), v_ones, array_fill('bench_job'::text, ARRAY[p_batch]),
           array_fill('completed'::text, ARRAY[p_batch]), now());
       END $$""",
)


def figures(system: str, batch: int, jobs: int, calls: int, wal: int) -> dict[str, Any]:
    """One drain's figures: ``jobs`` drained in ``calls`` claims of ``batch``, ``wal`` bytes."""
    return {"system": system, "batch": batch, "jobs": jobs, "calls": calls, "wal_bytes": wal,
            "wal_bytes_per_job": wal / jobs}


def qstore_wal(engine: Engine, system: bs.QstoreSystem, jobs: int, batch: int) -> dict[str, Any]:
    """Drain ``jobs`` COPY-loaded jobs by ``complete_and_claim`` calls of ``batch``; WAL per job."""
    system.fresh(engine)
    checkpoint(engine)
    with engine.begin() as conn:
        system.enqueue_copy(conn, system.convert(bs.workload(jobs)))
    kept = keeping_engine(engine)
    claimed: list[Any] = []
    done = calls = 0
    try:
        start = wal_position(engine)
        while True:
            result = system.storage.complete_and_claim(kept, claimed, bs.QUEUE, batch)
            calls += 1
            done += len(result.completed)
            claimed = result.claimed
            if not claimed:
                break
        wal = wal_since(engine, start)
    finally:
        release_kept(kept)
    if done != jobs:
        raise RuntimeError(f"qstore completed {done} of {jobs} jobs")
    return figures("qstore", batch, done, calls, wal)


def sketch_wal(engine: Engine, jobs: int, batch: int) -> dict[str, Any]:
    """The same drain as one per-batch fact of each kind per ``batch`` jobs; WAL per job."""
    schema = f"wal_sketch_{uuid.uuid4().hex[:8]}"
    with engine.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
        for statement in SKETCH:
            conn.execute(text(statement.format(s=f'"{schema}"')))
    cycle = text(f'SELECT "{schema}".cycle(:batch, :first)')
    try:
        checkpoint(engine)
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            start = wal_position(engine)
            for first in range(1, jobs + 1, batch):
                conn.execute(cycle, {"batch": min(batch, jobs - first + 1), "first": first})
            wal = wal_since(engine, start)
    finally:
        with engine.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
    return figures("per_batch", batch, jobs, -(-jobs // batch), wal)


def classic_wal(engine: Engine, url: str, jobs: int, batch: int) -> dict[str, Any]:
    """The psycopg classic queue's drain of ``jobs`` COPY-loaded jobs on one connection:
    claim ``batch`` (``UPDATE … SKIP LOCKED``), then ``DELETE`` them; WAL per job."""
    cpg = ClassicPsycopg(url, f"classic_walfacts_{uuid.uuid4().hex[:8]}")
    cpg.create()
    done = calls = 0
    try:
        checkpoint(engine)
        cpg.enqueue_copy(bs.workload(jobs))
        cpg.vacuum()
        with cpg.connect() as conn:
            start = wal_position(engine)
            while rows := cpg.claim(conn, bs.QUEUE, batch):
                calls += 1
                done += cpg.complete(conn, [r[0] for r in rows])
            wal = wal_since(engine, start)
    finally:
        cpg.drop()
    if done != jobs:
        raise RuntimeError(f"the classic queue completed {done} of {jobs} jobs")
    return figures("classic_pg", batch, done, calls, wal)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--url", default=DEFAULT_URL)
    parser.add_argument("--jobs", type=int, default=6400)
    parser.add_argument("--batches", default="1,8,32", help="claim batch sizes, comma-separated")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    ensure_database(args.url)
    engine = create_engine(args.url, pool_size=4)
    system = bs.QstoreSystem(f"qstore_walfacts_{uuid.uuid4().hex[:8]}", None, deadline=None)
    results = []
    try:
        for batch in batches:
            results.append(qstore_wal(engine, system, args.jobs, batch))
            results.append(sketch_wal(engine, args.jobs, batch))
            results.append(classic_wal(engine, args.url, args.jobs, batch))
    finally:
        system.drop(engine)
        engine.dispose()
    print(format_table(["system", "batch", "jobs", "calls", "WAL B/job"],
                       [[r["system"], r["batch"], r["jobs"], r["calls"], f"{r['wal_bytes_per_job']:,.0f}"]
                        for r in results]))
    if args.json:
        args.json.write_text(json.dumps({"results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
