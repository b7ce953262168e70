"""Dead tuples per job, by table, for each kind of job life, under a pinned horizon.

For each kind (``--kinds``; default all) the script installs a fresh qstore schema and a
fresh classic queue (``classic_mix.py``), vacuums both, pins the MVCC horizon (an idle
transaction holding an xid), runs ``--jobs`` jobs of that kind through each system (qstore:
a :class:`~qstore.worker.Worker` with its default settings, its maintainer inside; classic:
the worker threads of ``classic_mix.py``) until every one has completed, stops the workers
and, with the horizon still pinned, counts per table:

* **left**: dead tuples in the table (``pgstattuple``, exact; ``n_dead_tup`` without it):
  what the pin keeps and no VACUUM can remove until it ends;
* **made**: rows updated or deleted (``n_tup_upd + n_tup_del`` of
  ``pg_stat_user_tables``): every one leaves a dead tuple, but in a ring slot that upkeep
  reclaimed with ``TRUNCATE`` during the run it is gone with the slot.

Both per job, ring children folded into their table. Kinds (the lives of ``bench_mix.py``,
plus a callback):

* ``plain``: enqueued, claimed, completed;
* ``delayed``: enqueued 1 s ahead (``run_at``), promoted, claimed, completed;
* ``retry``: the first attempt raises, retried after the backoff, the second completes;
* ``snooze``: the first run snoozes 1 s, the next completes;
* ``unique``: enqueued with a unique key, completed; the workers and the maintainer then go
  on for ``--unique-settle`` s, so upkeep prunes the slot of the jobs' terminal rows and
  releases their keys (a key is held until then);
* ``progress``: the handler sends ``--progress-steps`` heartbeats with progress, completes;
* ``callback`` (qstore only): the handler registers a callback and parks the attempt
  (``WaitForCallback``); the script then completes it with ``complete_external``;
* ``idle``: no job at all, the workers and the maintainer running for ``--idle-seconds``
  (what upkeep itself leaves; its figures are totals, not per job).

    python scripts/dead_tuples_per_job.py --jobs 500 --json docs/dead_tuples_per_job.json
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
import uuid
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
    finish,
    force_stats_flush,
    make_engine,
    server_info,
)
from bench_mix import QUEUE, ClassicMixSystem, Plan, QstoreMix, System
from bench_steady import pin_open, vacuum_schemas

from qstore import InsertOpts, InsertParams
from qstore.tasks import JobContext, WaitForCallback

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/bench_dead_tuples"
KINDS = ("plain", "delayed", "retry", "snooze", "unique", "progress", "callback", "idle")
QSTORE_ONLY = ("callback",)


def table_writes(engine: Engine, schema: str) -> dict[str, int]:
    """Rows updated or deleted so far per table of ``schema`` (ring children folded)."""
    out: dict[str, int] = {}
    with engine.connect() as conn:
        conn.execute(text("SELECT pg_stat_clear_snapshot()"))
        for rel, n in conn.execute(text(
                "SELECT relname, n_tup_upd + n_tup_del FROM pg_stat_user_tables WHERE schemaname = :s"),
                {"s": schema}).all():
            key = family_of(rel)
            out[key] = out.get(key, 0) + int(n)
        conn.rollback()
    return out


def left_dead(engine: Engine, schema: str, exact: bool) -> dict[str, int]:
    """Dead tuples now per table of ``schema`` (ring children folded)."""
    return {name: t["dead"] for name, t in dead_tuples(engine, schema, exact).items()}


class CallbackJobs:
    """qstore's callback life: a task that registers a callback and parks its attempt, and
    the outside system's ``complete_external`` for each token once every job waits."""

    def __init__(self, qs: QstoreMix) -> None:
        self.qs = qs
        self.tokens: list[uuid.UUID] = []
        self.lock = threading.Lock()
        tokens, lock = self.tokens, self.lock

        @qs.app.task(kind="cb", queue=QUEUE)
        def cb(ctx: JobContext, seq: int) -> WaitForCallback:
            token = ctx.register_callback(timeout=300)
            with lock:
                tokens.append(token)
            return WaitForCallback(token)

    def enqueue(self, n: int) -> None:
        for i in range(n):
            self.qs.storage.enqueue(self.qs.engine, InsertParams("cb", {"seq": i}, InsertOpts(queue=QUEUE)))

    def finish(self, n: int, timeout: float) -> bool:
        """Complete every parked job from outside; whether all ``n`` ended completed."""
        worker = self.qs.worker
        assert worker is not None
        until = time.monotonic() + timeout
        while worker.stats.waiting_callback < n and time.monotonic() < until:
            time.sleep(0.05)
        with self.lock:
            tokens = list(self.tokens)
        for token in tokens:
            self.qs.storage.complete_external(self.qs.engine, token, {"ok": True})
        counts = self.qs.storage.queue_counts(self.qs.engine, QUEUE)
        return bool(counts.terminal == n and counts.running == 0)


def measure(kind: str, args: argparse.Namespace, side: Engine, exact: bool) -> dict[str, Any]:
    """One kind: fresh installs, vacuum, pin, run, stop, count (the pin still held). The
    workers' engine is new for each kind: a pooled session of an earlier kind's install
    would keep that install's types cached."""
    engine = make_engine(args.url, 24)
    try:
        return _measure(kind, args, engine, side, exact)
    finally:
        engine.dispose()


def _measure(kind: str, args: argparse.Namespace, engine: Engine, side: Engine, exact: bool) -> dict[str, Any]:
    n = 0 if kind == "idle" else args.jobs
    plan_kind = "plain" if kind in ("idle", "callback") else kind
    plan = Plan.single(plan_kind, max(n, 1), 1.0)
    qs = QstoreMix(engine, args.qstore_schema, plan, args)
    systems: list[System] = [qs]
    if kind not in QSTORE_ONLY:
        systems.append(ClassicMixSystem(args.url, args.classic_schema, plan, args))
    callbacks = CallbackJobs(qs) if kind == "callback" else None
    for s in systems:
        s.install()
        s.start()
    time.sleep(0.5)  # workers and maintainer started; their first upkeep round done
    vacuum_schemas(side, [s.schema for s in systems])
    force_stats_flush(engine)
    time.sleep(1.2)
    before = {s.name: table_writes(side, s.schema) for s in systems}
    ok = True
    began = time.monotonic()
    with XminPin(side) as pin:
        if callbacks is not None:
            callbacks.enqueue(n)
            ok = callbacks.finish(n, args.timeout)
        elif n:
            for i in range(n):
                for s in systems:
                    s.enqueue(i)
            until = time.monotonic() + args.timeout
            while (any(len(s.ledger.completed) < n for s in systems)
                   and time.monotonic() < until):
                time.sleep(0.05)
            ok = all(len(s.ledger.completed) == n and not s.ledger.check(
                {i: 0.0 for i in range(n)}) for s in systems)
            if kind == "unique":
                time.sleep(args.unique_settle)
        else:
            time.sleep(args.idle_seconds)
        seconds = time.monotonic() - began
        reports = {s.name: s.stop() for s in systems}
        force_stats_flush(engine)
        time.sleep(1.2)  # every session has reported its counters
        after = {s.name: table_writes(side, s.schema) for s in systems}
        left = {s.name: left_dead(side, s.schema, exact) for s in systems}
        held = pin_open(side, pin)
    out: dict[str, Any] = {"kind": kind, "jobs": n, "seconds": round(seconds, 2), "ok": ok, "pin_held": held}
    for s in systems:
        tables = sorted(set(after[s.name]) | set(left[s.name]))
        made = {t: after[s.name].get(t, 0) - before[s.name].get(t, 0) for t in tables}
        out[s.name] = {t: {"made": made[t], "left": left[s.name].get(t, 0)} for t in tables
                       if made[t] or left[s.name].get(t, 0)}
        out[f"{s.name}_report"] = reports[s.name]
        s.drop()
    return out


def print_results(results: list[dict[str, Any]]) -> None:
    for system in ("qstore", "classic"):
        print(f"\n{system}: dead tuples per job under a pinned horizon, by table "
              "(left = still dead at the end, made = updates + deletes; idle: totals)")
        for r in results:
            if system not in r:
                continue
            per = max(r["jobs"], 1)
            cells = ", ".join(f"{t} {v['left'] / per:.3g} left / {v['made'] / per:.3g} made"
                              for t, v in sorted(r[system].items()))
            print(f"  {r['kind']:<9} ({r['jobs']} jobs, {r['seconds']:.1f} s{'' if r['ok'] else ', NOT ALL DONE'}): "
                  f"{cells or 'none'}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=DEFAULT_URL)
    p.add_argument("--jobs", type=int, default=500, help="jobs per kind")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    p.add_argument("--idle-seconds", type=float, default=10.0)
    p.add_argument("--unique-settle", type=float, default=60.0,
                   help="unique: s the workers and the maintainer go on after the jobs completed, so "
                        "upkeep can prune their terminal rows and release their keys")
    p.add_argument("--timeout", type=float, default=60.0, help="s to wait for one kind's jobs")
    p.add_argument("--progress-steps", type=int, default=3)
    p.add_argument("--progress-sleep", type=float, default=0.02)
    p.add_argument("--classic-workers", type=int, default=16)
    p.add_argument("--classic-batch", type=int, default=10)
    p.add_argument("--classic-poll", type=float, default=1.0)
    p.add_argument("--qstore-schema", default="dead_qstore")
    p.add_argument("--classic-schema", default="dead_classic")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    a.kinds = [k.strip() for k in a.kinds.split(",") if k.strip()]
    bad = [k for k in a.kinds if k not in KINDS]
    if bad or a.jobs < 1:
        p.error(f"--kinds: unknown {bad}; expected of {', '.join(KINDS)}; --jobs >= 1")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ensure_database(args.url)
    side = make_engine(args.url, 4)
    info = server_info(side)
    exact = ensure_pgstattuple(side)
    results = []
    for kind in args.kinds:
        r = measure(kind, args, side, exact)
        results.append(r)
        print(f"{kind}: {r['jobs']} jobs in {r['seconds']:.1f} s, all done: {r['ok']}, pin held: {r['pin_held']}",
              flush=True)
    print_results(results)
    problems = [f"{r['kind']}: not every job completed" for r in results if not r["ok"]]
    problems += [f"{r['kind']}: the pin ended before the count" for r in results if not r["pin_held"]]
    problems += [f"{r['kind']}: qstore maintenance errors {r['qstore_report']['maintenance_errors']}"
                 for r in results if r["qstore_report"].get("maintenance_errors")]
    side.dispose()
    payload = {"config": {k: v for k, v in vars(args).items() if k not in ("url", "json")}, "machine": info,
               "dead_tuple_source": "pgstattuple (exact)" if exact else "n_dead_tup (statistics)",
               "results": results, "problems": problems}
    return finish(args.json, payload, problems)


if __name__ == "__main__":
    raise SystemExit(main())
