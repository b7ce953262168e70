"""Prototype measurement for design-29.md: the drain path of qstore's current SQL against a
lean layout (claim batches as receipts, one closure row per completion batch and claim
batch, a combined complete-and-claim call), each driven by the same raw psycopg loop as
the psycopg classic queue, side by side in one run.

Not part of the product: it installs a qstore schema, adds the prototype's columns, table
and functions next to the installed ones, and drops the schema afterwards. Every variant
drains the same COPY-loaded jobs with 16 threads, each on its own autocommitted
connection, claiming ``--batch`` (10) jobs, or the batch a variant names as
``VARIANT@BATCH``, and completing them (``cycle``: completing the previous batch and
claiming the next in one statement), with prepared statements:

* ``classic_pg``  — ``scripts/classic_psycopg.py`` (UPDATE … RETURNING / DELETE);
* ``current``     — ``claim_ready`` (receipts) and ``complete_receipts``, as installed;
* ``lean``        — ``claim_lean`` (the claim range is the receipt of its batch and holds
  its attempts as arrays: no receipt rows) and ``complete_lean`` (one closure row per claim
  batch completed by the call, holding the completed positions as an ``int8multirange``;
  guarded by ``(job_id, run_lease)`` against the batch's arrays; closers of a batch
  serialised by transaction-scoped advisory locks);
* ``lean_cycle``  — ``cycle_lean``: ``complete_lean`` of the previous batch and
  ``claim_lean`` of the next in one statement (one round trip, one commit per cycle).

Per variant: jobs/s, and per job the WAL of this database (pg_walinspect), the backends'
CPU, the client's CPU and the server transactions; ``--wal-detail`` prints the WAL per
relation and record type.

    python design-29-prototype.py --jobs 20000 --rounds 3 --phases clean,pinned --wal-detail
    python design-29-prototype.py --rounds 2 --phases clean,pinned \
        --variants classic_pg@10,classic_pg@32,current@32,lean@32,lean_cycle@32

The first variant is the reference of the per-round ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psycopg

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

import bench_storage as bs  # noqa: E402
from _benchlib import (  # noqa: E402
    ServerMeter,
    checkpoint,
    ensure_database,
    make_engine,
    per_job,
    pinned,
)
from classic_psycopg import ClassicPsycopg, libpq_url  # noqa: E402
from mako.template import Template  # noqa: E402

from qstore.config import CLAIM_WAIT, CLAIMED_IN_XACT, COUNTER_BUCKETS, DEFAULT_SHARDS  # noqa: E402

SCHEMA = "proto_lean"
BATCH = 10  # claim batch; --batch changes it for every variant

# -- the prototype's SQL ---------------------------------------------------------------------
DDL = """
ALTER TABLE ${s}.ready_claim_ranges ADD COLUMN live smallint, ADD COLUMN deadline_at timestamptz,
  ADD COLUMN offsets smallint[], ADD COLUMN job_ids bigint[], ADD COLUMN run_leases bigint[];
CREATE TABLE ${s}.attempt_closures (
  ready_slot integer NOT NULL, ready_generation bigint NOT NULL, queue text NOT NULL,
  priority smallint NOT NULL, enqueue_shard smallint NOT NULL, first_seq bigint NOT NULL,
  seqs int8multirange NOT NULL, n smallint NOT NULL, outcome text NOT NULL,
  closed_at timestamptz NOT NULL) PARTITION BY LIST (ready_slot);
% for k in range(shape.queue_slot_count):
CREATE TABLE ${s}.attempt_closures_${k} PARTITION OF ${s}.attempt_closures FOR VALUES IN (${k});
% endfor
CREATE INDEX attempt_closures_batch_idx ON ${s}.attempt_closures (queue, priority, enqueue_shard, first_seq);
"""


def lean_claim_text(claim_ready: str) -> str:
    """``claim_ready.sql`` with the receipts and leases left out: the claim range row (with
    the count of attempts it created and their deadline) is the batch's receipt."""
    t = claim_ready.replace("${s}.claim_ready(", "${s}.claim_lean(")
    start = t.index("        ), rings AS (")
    end = t.index("          RETURNING le.job_id\n        )") + len("          RETURNING le.job_id\n        )")
    t = t[:start] + "        )" + t[end:]
    t = t.replace(
        """            (ready_slot, ready_generation, queue, priority, enqueue_shard, first_seq, last_seq,
             claimed_at)
          SELECT v_seg_slot, v_seg_gen, p_queue, v_lane.lane_priority, v_lane.shard, v_pos,
                 max(p.lane_seq), v_now""",
        """            (ready_slot, ready_generation, queue, priority, enqueue_shard, first_seq, last_seq,
             claimed_at, live, deadline_at, offsets, job_ids, run_leases)
          SELECT v_seg_slot, v_seg_gen, p_queue, v_lane.lane_priority, v_lane.shard, v_pos,
                 max(p.lane_seq), v_now, count(*) FILTER (WHERE NOT p.tombstoned),
                 CASE WHEN p_deadline_ms > 0
                      THEN v_now + make_interval(secs => p_deadline_ms / 1000.0) END,
                 array_agg((p.lane_seq - v_pos)::smallint ORDER BY p.lane_seq) FILTER (WHERE NOT p.tombstoned),
                 array_agg(p.job_id ORDER BY p.lane_seq) FILTER (WHERE NOT p.tombstoned),
                 array_agg(p.run_lease + 1 ORDER BY p.lane_seq) FILTER (WHERE NOT p.tombstoned)""")
    t = t.replace(
        """        SELECT CASE WHEN p_receipts THEN g.claim_slot ELSE 0 END, g.lease_slot,
               g.lease_generation, p.ready_slot""",
        """        SELECT v_pos::integer, 0, 0::bigint, p.ready_slot""")
    t = t.replace("        FROM live p CROSS JOIN rings g\n        ORDER BY p.lane_seq;",
                  "        FROM live p\n        ORDER BY p.lane_seq;")
    # the batch key (its first_seq) travels in the claim_slot column in the prototype
    refuse = """BEGIN
  IF current_setting('transaction_isolation') <> 'read committed' THEN
    RAISE EXCEPTION 'claim_lean refuses a % transaction', current_setting('transaction_isolation')
      USING ERRCODE = '25P99';
  END IF;
  IF p_max <= 0 THEN RETURN; END IF;"""
    return t.replace("BEGIN\n  IF p_max <= 0 THEN RETURN; END IF;", refuse, 1)


COMPLETE = """
CREATE OR REPLACE FUNCTION ${s}.complete_lean(p_slots integer[], p_firsts bigint[], p_seqs bigint[],
    p_job_ids bigint[], p_run_leases bigint[], p_queue text, p_priorities smallint[], p_shards smallint[])
RETURNS TABLE(job_id bigint, run_lease bigint) LANGUAGE plpgsql VOLATILE
SET jit = off SET plan_cache_mode = force_generic_plan AS $$
DECLARE
  v_slot integer;
BEGIN
  IF current_setting('transaction_isolation') <> 'read committed' THEN
    RAISE EXCEPTION 'complete_lean refuses a % transaction', current_setting('transaction_isolation')
      USING ERRCODE = '25P99';
  END IF;
  -- closers of one claim batch serialise on a transaction-scoped advisory lock (no WAL, no
  -- page write); taken in key order, so two closers never wait on each other in a cycle
  PERFORM pg_advisory_xact_lock(k.key)
  FROM (SELECT DISTINCT hashtextextended('${s}:' || p_queue || ':' || b.prio || ':' || b.shard
                                         || ':' || b.first, 0) AS key
        FROM unnest(p_priorities, p_shards, p_firsts) AS b(prio, shard, first)) k
  ORDER BY k.key;
  FOREACH v_slot IN ARRAY ARRAY(SELECT DISTINCT x FROM unnest(p_slots) x ORDER BY 1) LOOP
% for k in range(shape.queue_slot_count):
    ${'IF' if loop.first else 'ELSIF'} v_slot = ${k} THEN
      RETURN QUERY
      WITH input AS (
        SELECT DISTINCT i.first, i.seq, i.job_id, i.run_lease, i.prio, i.shard
        FROM unnest(p_slots, p_firsts, p_seqs, p_job_ids, p_run_leases, p_priorities, p_shards)
             AS i(slot, first, seq, job_id, run_lease, prio, shard)
        WHERE i.slot = v_slot
      ), batch AS (
        -- per claim batch: its row (the attempts it holds) and what closures it already has
        SELECT k.prio, k.shard, k.first, b.ready_generation, b.offsets, b.job_ids, b.run_leases, c.closed
        FROM (SELECT DISTINCT x.prio, x.shard, x.first FROM input x) k
        CROSS JOIN LATERAL (
          SELECT b.ready_generation, b.offsets, b.job_ids, b.run_leases
          FROM ${s}.ready_claim_ranges_${k} b
          WHERE b.queue = p_queue AND b.priority = k.prio AND b.enqueue_shard = k.shard
            AND b.first_seq = k.first AND b.live > 0
          LIMIT 1) b
        LEFT JOIN LATERAL (
          SELECT range_agg(c.seqs) AS closed FROM ${s}.attempt_closures_${k} c
          WHERE c.queue = p_queue AND c.priority = k.prio AND c.enqueue_shard = k.shard
            AND c.first_seq = k.first) c ON true
      ), ok AS (
        -- guarded by (job_id, run_lease): the attempt the batch holds at that position, open
        SELECT i.*, b.ready_generation
        FROM input i
        JOIN batch b ON b.prio = i.prio AND b.shard = i.shard AND b.first = i.first
        CROSS JOIN LATERAL (SELECT array_position(b.offsets, (i.seq - i.first)::smallint) AS ix) x
        LEFT JOIN LATERAL (
          SELECT 1 AS hit FROM ${s}.attempt_state a WHERE a.job_id = i.job_id AND a.run_lease = i.run_lease
          LIMIT 1) a ON true
        WHERE b.job_ids[x.ix] = i.job_id AND b.run_leases[x.ix] = i.run_lease
          AND NOT coalesce(b.closed @> i.seq, false) AND a.hit IS NULL
      ), closed AS (
        INSERT INTO ${s}.attempt_closures
          (ready_slot, ready_generation, queue, priority, enqueue_shard, first_seq, seqs, n, outcome, closed_at)
        SELECT v_slot, min(o.ready_generation), p_queue, o.prio, o.shard, o.first,
               range_agg(int8range(o.seq, o.seq, '[]')), count(*), 'completed', clock_timestamp()
        FROM ok o GROUP BY o.prio, o.shard, o.first
        RETURNING 1
      ), deltas AS (
        INSERT INTO ${s}.queue_terminal_count_deltas
          (ready_slot, ready_generation, queue, priority, enqueue_shard, counter_bucket, terminal_delta)
        SELECT v_slot, min(o.ready_generation), p_queue, o.prio, o.shard, 0, count(*)
        FROM ok o GROUP BY o.prio, o.shard
        RETURNING 1
      )
      SELECT o.job_id, o.run_lease FROM ok o;
% endfor
    END IF;
  END LOOP;
END
$$;
"""

CYCLE = """
CREATE OR REPLACE FUNCTION ${s}.cycle_lean(p_slots integer[], p_firsts bigint[], p_seqs bigint[],
    p_job_ids bigint[], p_run_leases bigint[], p_priorities smallint[], p_shards smallint[],
    p_queue text, p_max integer)
RETURNS TABLE(done boolean, claim_slot integer, ready_slot integer, priority smallint,
              enqueue_shard smallint, lane_seq bigint, job_id bigint, run_lease bigint, kind text,
              args jsonb)
LANGUAGE plpgsql VOLATILE SET jit = off AS $$
BEGIN
  RETURN QUERY SELECT true, NULL::integer, NULL::integer, NULL::smallint, NULL::smallint, NULL::bigint,
                      c.job_id, c.run_lease, NULL::text, NULL::jsonb
    FROM ${s}.complete_lean(p_slots, p_firsts, p_seqs, p_job_ids, p_run_leases, p_queue,
                            p_priorities, p_shards) c;
  RETURN QUERY SELECT false, c.claim_slot, c.ready_slot, c.priority, c.enqueue_shard, c.lane_seq,
                      c.job_id, c.run_lease, c.kind, c.args
    FROM ${s}.claim_lean(p_queue, p_max, 0, 0, true) c;
END
$$;
"""


def render(text: str, cfg: Any) -> str:
    return str(Template(text=text, strict_undefined=True).render(
        s=cfg.schema, shape=cfg, claim_wait=CLAIM_WAIT, claimed_in_xact=CLAIMED_IN_XACT,
        counter_buckets=COUNTER_BUCKETS, default_shards=DEFAULT_SHARDS))


def install(engine: Any, qsys: bs.QstoreSystem) -> None:
    cfg = qsys.storage.config
    claim_src = (ROOT / "qstore" / "sql" / "claim_ready.sql").read_text()
    with engine.begin() as conn:
        raw = conn.connection.driver_connection
        for stmt in render(DDL, cfg).split(";\n"):
            if stmt.strip():
                raw.execute(stmt)
        raw.execute(render(lean_claim_text(claim_src), cfg).strip())
        raw.execute(render(COMPLETE, cfg))
        raw.execute(render(CYCLE, cfg))


# -- the drain loop on raw psycopg -------------------------------------------------------------
CLAIM_COLS = ("claim_slot, ready_slot, priority, enqueue_shard, lane_seq, job_id, run_lease, kind, "
              "args")


def arr(values: list[Any]) -> str:
    return "{" + ",".join(str(v) for v in values) + "}"


class Loop:
    """One variant's statements and how a worker thread drives them."""

    def __init__(self, variant: str, schema: str) -> None:
        self.variant = variant
        s = schema
        self.claim_current = (f"SELECT claim_slot, ready_slot, priority, enqueue_shard, lane_seq, job_id, "
                              f"run_lease, kind, args FROM {s}.claim_ready(%s, %s, 0, 0, true)")
        self.complete_current = (f"SELECT job_id, run_lease FROM {s}.complete_receipts("
                                 f"%s::int[], %s::bigint[], %s::bigint[], %s::text[])")
        self.claim_lean = f"SELECT {CLAIM_COLS} FROM {s}.claim_lean(%s, %s, 0, 0, true)"
        self.complete_lean = (f"SELECT job_id, run_lease FROM {s}.complete_lean(%s::int[], %s::bigint[], "
                              f"%s::bigint[], %s::bigint[], %s::bigint[], %s, %s::smallint[], %s::smallint[])")
        self.cycle = (f"SELECT done, {CLAIM_COLS} FROM {s}.cycle_lean(%s::int[], %s::bigint[], %s::bigint[], "
                      f"%s::bigint[], %s::bigint[], %s::smallint[], %s::smallint[], %s, %s)")

    def lean_args(self, got: list[Any]) -> tuple[str, ...]:
        # (claim_slot carries first_seq) ready_slot, first, seq, job, lease, prio, shard
        return (arr([r[1] for r in got]), arr([r[0] for r in got]), arr([r[4] for r in got]),
                arr([r[5] for r in got]), arr([r[6] for r in got]))

    def warm(self, conn: psycopg.Connection[Any]) -> None:
        """Plan every statement of the variant's functions on ``conn`` (a PL/pgSQL function
        is compiled and its statements planned per session, on first use)."""
        q = bs.WARMUP_QUEUE
        if self.variant == "current":
            got = conn.execute(self.claim_current, (q, BATCH), prepare=True).fetchall()
            conn.execute(self.complete_current, (
                arr([r[0] for r in got]), arr([r[5] for r in got]), arr([r[6] for r in got]),
                "{" + ",".join(f'"{r[7]}"' for r in got) + "}"), prepare=True).fetchall()
            return
        got = conn.execute(self.claim_lean, (q, BATCH), prepare=True).fetchall()
        if self.variant == "lean_cycle":
            rows = conn.execute(self.cycle, (*self.lean_args(got), arr([r[2] for r in got]),
                                             arr([r[3] for r in got]), q, BATCH), prepare=True).fetchall()
            got = [r[1:] for r in rows if not r[0]]
        conn.execute(self.complete_lean, (*self.lean_args(got), q, arr([r[2] for r in got]),
                                          arr([r[3] for r in got])), prepare=True).fetchall()

    def run(self, conn: psycopg.Connection[Any], expected: int, st: dict[str, Any], lock: threading.Lock,
            start: threading.Barrier) -> None:
        q = bs.QUEUE
        ids: list[int] = []
        calls = 0
        prev: list[Any] = []
        start.wait()
        empties = 0
        while True:
            with lock:
                if st["done"] >= expected:
                    break
            calls += 1
            if self.variant == "lean_cycle":
                a = self.lean_args(prev) if prev else ("{}",) * 5
                rows = conn.execute(self.cycle, (*a, arr([r[2] for r in prev]), arr([r[3] for r in prev]),
                                                 q, BATCH), prepare=True).fetchall()
                done = [r for r in rows if r[0]]
                got = [r[1:] for r in rows if not r[0]]
                if len(done) != len(prev):
                    raise RuntimeError(f"cycle completed {len(done)} of {len(prev)}")
                with lock:
                    st["done"] += len(done)
                ids += [r[6] for r in done]
                prev = got
            else:
                if self.variant == "current":
                    got = conn.execute(self.claim_current, (q, BATCH), prepare=True).fetchall()
                else:
                    got = conn.execute(self.claim_lean, (q, BATCH), prepare=True).fetchall()
            for _ in got:
                pass  # the no-op handler
            if not got and not prev:
                empties += 1
                if empties > 200:
                    break
                time.sleep(0.005)
                continue
            empties = 0
            if self.variant == "lean_cycle":
                continue
            calls += 1
            if self.variant == "current":
                done = conn.execute(self.complete_current, (
                    arr([r[0] for r in got]), arr([r[5] for r in got]), arr([r[6] for r in got]),
                    "{" + ",".join(f'"{r[7]}"' for r in got) + "}"), prepare=True).fetchall()
            else:
                done = conn.execute(self.complete_lean, (*self.lean_args(got), q, arr([r[2] for r in got]),
                                                         arr([r[3] for r in got])), prepare=True).fetchall()
            if len(done) != len(got):
                raise RuntimeError(f"completed {len(done)} of {len(got)}")
            ids += [r[0] for r in done]
            with lock:
                st["done"] += len(done)
        if prev:  # the cycle's last batch
            a = self.lean_args(prev)
            done = conn.execute(self.complete_lean, (*a, q, arr([r[2] for r in prev]), arr([r[3] for r in prev])),
                                prepare=True).fetchall()
            ids += [r[0] for r in done]
            with lock:
                st["done"] += len(done)
        with lock:
            st["ids"] += ids
            st["calls"] += calls


def drain_qstore(url: str, variant: str, expected: int, threads: int, meter: ServerMeter) -> dict[str, Any]:
    loop = Loop(variant, SCHEMA)
    conns = [psycopg.connect(libpq_url(url), autocommit=True) for _ in range(threads)]
    for c in conns:
        loop.warm(c)
    st: dict[str, Any] = {"done": 0, "ids": [], "calls": 0}
    lock = threading.Lock()
    start = threading.Barrier(threads + 1)
    errors: list[BaseException] = []

    def work(c: psycopg.Connection[Any]) -> None:
        try:
            loop.run(c, expected, st, lock, start)
        except BaseException as exc:
            errors.append(exc)

    pool = [threading.Thread(target=work, args=(c,), daemon=True) for c in conns]
    for t in pool:
        t.start()
    meter.start()
    cpu0 = time.process_time()
    start.wait()
    t0 = time.perf_counter()
    for t in pool:
        t.join()
    secs = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    meter.sample()
    for c in conns:
        c.execute("SELECT pg_stat_force_next_flush()")
        c.close()
    if errors:
        raise RuntimeError(f"{variant}: {errors[0]!r}") from errors[0]
    return {"jobs": len(st["ids"]), "distinct": len(set(st["ids"])), "seconds": secs, "cpu": cpu,
            "calls": st["calls"]}


def one(engine: Any, url: str, name: str, phase: str, args: argparse.Namespace) -> dict[str, Any]:
    """One drain of variant ``name`` (``variant`` or ``variant@batch``) in ``phase``."""
    global BATCH
    variant, _, batch = name.partition("@")
    BATCH = int(batch) if batch else args.batch
    n = args.jobs
    meter = ServerMeter(engine, breakdown=args.wal_detail and phase == "clean")
    if variant == "classic_pg":
        cpg = ClassicPsycopg(url, "proto_classic_pg")
        cpg.create()
        checkpoint(engine)  # before the load, as bench_storage does: the drain writes no full-page images
        cpg.enqueue_copy(bs.workload(n))
        cpg.vacuum()
        clock: dict[str, float] = {}

        def started() -> None:
            meter.start()
            clock["cpu"] = time.process_time()

        with pinned(engine, phase == "pinned"):
            d = cpg.drain(bs.QUEUE, n, workers=args.threads, batch=BATCH, handle=bs.handler,
                          on_start=started, on_end=meter.sample)
            cpu = time.process_time() - clock["cpu"]
            use = meter.stop(engine)
        cpg.drop()
        res = {"jobs": d.jobs, "distinct": len(set(d.ids)), "seconds": d.seconds, "cpu": cpu,
               "calls": d.round_trips}
    else:
        qsys = bs.QstoreSystem(SCHEMA, None, deadline=None)
        qsys.fresh(engine)
        install(engine, qsys)
        checkpoint(engine)
        with engine.begin() as conn:
            # the warm-up queue's jobs first (claimed before the clock starts), then the drained ones
            qsys.enqueue_copy(conn, qsys.convert(bs.workload(3 * args.threads * BATCH, bs.WARMUP_QUEUE)))
            # in chunks of 1,000 as bench_storage loads (one COPY call fills one lane)
            jobs = qsys.convert(bs.workload(n))
            for i in range(0, n, 1000):
                qsys.enqueue_copy(conn, jobs[i:i + 1000])
        with pinned(engine, phase == "pinned"):
            res = drain_qstore(url, variant, n, args.threads, meter)
            use = meter.stop(engine)
        qsys.drop(engine)
    res["wal"] = use.get("wal_by_relation")
    res.update(per_job(use, res["jobs"], res["cpu"] - use["sampler_cpu_s"]))
    res["jobs_per_s"] = res["jobs"] / res["seconds"]
    res["round_trips_per_job"] = res["calls"] / max(res["jobs"], 1)
    res["variant"], res["phase"] = name, phase
    if res["jobs"] != n or res["distinct"] != n:
        res["problem"] = f"drained {res['jobs']} ({res['distinct']} distinct) of {n}"
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="postgresql+psycopg://postgres@127.0.0.1:5432/bench_worker")
    p.add_argument("--jobs", type=int, default=20_000)
    p.add_argument("--threads", type=int, default=16)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--phases", default="clean")
    p.add_argument("--variants", default="classic_pg,current,lean,lean_cycle")
    p.add_argument("--wal-detail", action="store_true")
    p.add_argument("--batch", type=int, default=10,
                   help="claim batch of every variant not named as VARIANT@BATCH")
    args = p.parse_args()
    ensure_database(args.url)
    engine = make_engine(args.url, 8)
    variants = args.variants.split(",")
    results = []
    for rnd in range(1, args.rounds + 1):
        for phase in args.phases.split(","):
            shift = (rnd - 1) % len(variants)
            for v in variants[shift:] + variants[:shift]:  # the first variant is the reference
                r = one(engine, args.url, v, phase, args)
                r["round"] = rnd
                results.append(r)
                print(f"round {rnd} {phase:<6} {v:<10} {r['jobs_per_s']:>8,.0f} jobs/s  WAL "
                      f"{r['wal_db_bytes_per_job'] or 0:6.0f} B/job  server CPU "
                      f"{r['server_cpu_us_per_job'] or 0:5.0f} us/job  client CPU "
                      f"{r['client_cpu_us_per_job']:4.0f} us/job  xacts {r['server_xacts_per_job']:.3f}/job  "
                      f"statements {r['round_trips_per_job']:.3f}/job  {r.get('problem', 'ok')}", flush=True)
                if r.get("wal"):
                    for rel, e in sorted(r["wal"]["by_record"].items(), key=lambda kv: -kv[1]["bytes"])[:14]:
                        print(f"      {rel:<78} {e['bytes'] / r['jobs']:7.1f} B {e['records'] / r['jobs']:5.2f} rec")
    print(f"\nmedians (per-round ratio to {variants[0]}):")
    for phase in args.phases.split(","):
        ref = variants[0]
        base = {r["round"]: r["jobs_per_s"] for r in results if r["variant"] == ref and r["phase"] == phase}
        for v in variants:
            rs = [r for r in results if r["variant"] == v and r["phase"] == phase]
            rel = statistics.median(r["jobs_per_s"] / base[r["round"]] for r in rs) if base else float("nan")
            med = {k: statistics.median(r[k] or 0 for r in rs) for k in (
                "jobs_per_s", "wal_db_bytes_per_job", "server_cpu_us_per_job", "client_cpu_us_per_job",
                "server_xacts_per_job", "round_trips_per_job")}
            print(f"  {phase:<6} {v:<10} {med['jobs_per_s']:>8,.0f} jobs/s {rel:5.2f}x  WAL "
                  f"{med['wal_db_bytes_per_job']:5.0f} B/job  server CPU {med['server_cpu_us_per_job']:4.0f} us/job  "
                  f"client CPU {med['client_cpu_us_per_job']:3.0f} us/job  xacts {med['server_xacts_per_job']:.3f}  "
                  f"statements {med['round_trips_per_job']:.3f}")
    engine.dispose()
    return 1 if any("problem" in r for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
