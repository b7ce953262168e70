"""Side-by-side storage benchmark: qstore against the in-repo classic queue.

One run, one PostgreSQL, identical workload for both systems. For each phase (``clean``,
then ``pinned``) and each system:

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

Then ratios and the targets of issue 3 (PASS/FAIL). Example::

    python scripts/bench_storage.py --jobs 20000 --threads 16 --batch 32 --json bench.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _benchlib import (
    XminPin,
    checkpoint,
    dead_tuples,
    drain,
    ensure_database,
    ensure_pgstattuple,
    format_table,
    make_engine,
    server_info,
    timed_enqueue,
    wal_position,
    wal_since,
)
from classic_queue import ClassicQueue

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/bench_storage"
QUEUE = "bench"
# sorts before QUEUE and is enqueued before the measured jobs: every key the drain appends
# (job ids, queue names) stays the largest in its index, as without a warm-up
WARMUP_QUEUE = "a_warmup"
KIND = "bench_job"
PRIORITY = 2
PHASES = ("clean", "pinned")

TARGETS = {
    "clean_drain_ratio": 0.8,  # qstore / classic, >=
    "pinned_drain_ratio": 1.2,  # qstore / classic, >=
    "copy_enqueue_jobs_per_s": 30_000,  # qstore, >=
    "pinned_dead_pct": 5.0,  # qstore dead / classic dead, <= (percent)
}

Job = tuple[str, str, int, dict[str, Any]]  # (queue, kind, priority, args)


def workload(n: int, queue: str = QUEUE) -> list[Job]:
    return [(queue, KIND, PRIORITY, {"n": i, "payload": "x" * 16}) for i in range(n)]


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

    def fresh(self, engine: Engine) -> None:
        with engine.begin() as conn:
            self.q.drop(conn)
            self.q.create(conn)

    def drop(self, engine: Engine) -> None:
        with engine.begin() as conn:
            self.q.drop(conn)

    def convert(self, jobs: Sequence[Job]) -> Sequence[Any]:
        return jobs

    def enqueue_copy(self, conn: Connection, jobs: Sequence[Any]) -> int:
        return self.q.enqueue_copy(conn, jobs)

    def enqueue_insert(self, conn: Connection, jobs: Sequence[Any]) -> int:
        return self.q.enqueue_insert(conn, jobs)

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

    def __init__(self, schema: str, shards: int = 1) -> None:
        from qstore.config import QueueStorageConfig
        from qstore.storage import QueueStorage
        from qstore.storage.jobs import InsertOpts, InsertParams

        self.storage = QueueStorage(QueueStorageConfig(schema=schema))
        self.schema = schema
        self.shards = shards
        self._params = InsertParams
        self._opts_type = InsertOpts
        self._deadline = timedelta(minutes=5)
        for method in ("enqueue_params_copy", "enqueue_params_batch",
                       "claim_runtime_batch", "complete_runtime_batch"):
            if not hasattr(self.storage, method):
                raise RuntimeError(f"QueueStorage has no {method}()")

    def fresh(self, engine: Engine) -> None:
        self.storage.reset(engine)
        self.storage.prepare_schema(engine)
        if self.shards > 1:  # a hot queue's lanes: claimers of one lane serialise on its head
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

    def claim(self, target: Connection | Engine, batch: int, queue: str = QUEUE) -> Sequence[Any]:
        # an Engine target is qstore's own-transaction mode
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


def run_one(engine: Engine, system: Any, phase: str, jobs: Sequence[Job], args: argparse.Namespace,
            exact_dead: bool) -> dict[str, Any]:
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

    system.fresh(engine)
    if args.warmup:
        enqueue_warmup(engine, system, args.batch)
    checkpoint(engine)
    secs, wrote = timed_enqueue(
        engine, lambda c, b: as_count(system.enqueue_copy(c, b)), prepared, args.enqueue_chunk
    )
    if wrote != n:
        raise RuntimeError(f"{system.name}: COPY wrote {wrote} of {n} jobs")
    res["copy_enqueue"] = {"seconds": secs, "jobs_per_s": n / secs}
    if args.warmup:
        warm_pool(engine, system, args.batch)

    pin = XminPin(engine) if phase == "pinned" else None
    wal_from = wal_position(engine)
    if pin is not None:
        pin.__enter__()
        res["pinned_xid"] = pin.xid
    try:
        d = drain(
            engine,
            threads=args.threads,
            claim=lambda c: system.claim(c, args.batch),
            complete=system.complete,
            ids_of=system.ids_of,
            expected=n,
            idle_exit=args.idle_exit,
            own_transactions=args.transactions == "own",
        )
        wal_bytes = wal_since(engine, wal_from)
        with engine.connect() as conn, conn.begin():
            leftover = len(system.claim(conn, args.batch))
        dead = dead_tuples(engine, system.schema, exact_dead)
    finally:
        if pin is not None:
            pin.__exit__(None, None, None)

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
        "wal_bytes_per_job": wal_bytes / max(d.jobs, 1),
        "claim_calls": d.claim_calls,
        "empty_claims": d.empty_claims,
        "early_exits": d.early_exits,
        "per_thread_min": min(d.per_thread),
        "per_thread_max": max(d.per_thread),
    }
    res["dead_tuples"] = dead
    res["dead_total"] = sum(f["dead"] for f in dead.values())
    res["problems"] = problems
    return res


# -- report ---------------------------------------------------------------------------------
def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def fmt(x: float | None, spec: str = ",.0f") -> str:
    return "n/a" if x is None else format(x, spec)


def median(values: list[float]) -> float | None:
    vals = sorted(values)
    if not vals:
        return None
    mid = len(vals) // 2
    return vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2


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
    verdicts: dict[str, dict[str, Any]] = {}
    for key, (value, op, target) in checks.items():
        if value is None:
            verdicts[key] = {"value": None, "target": f"{op} {target}", "result": "SKIP"}
            continue
        ok = value >= target if op == ">=" else value <= target
        verdicts[key] = {"value": value, "target": f"{op} {target}",
                         "result": "PASS" if ok else "FAIL"}
    summary["targets"] = verdicts
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
    print("\nTargets (issue 3):")
    for key, v in s["targets"].items():
        value = "n/a" if v["value"] is None else (
            f"{v['value']:,.0f}" if key == "copy_enqueue_jobs_per_s" else f"{v['value']:.2f}")
        print(f"  {v['result']:<4}  {key:<24} {value:>10}  (target {v['target']})")


# -- main -----------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=DEFAULT_URL,
                   help="SQLAlchemy URL (psycopg 3 driver); the database is created if missing")
    p.add_argument("--jobs", type=int, default=20_000)
    p.add_argument("--threads", type=int, default=16)
    p.add_argument("--batch", type=int, default=32, help="claim batch size")
    p.add_argument("--enqueue-chunk", type=int, default=1000,
                   help="jobs per enqueue call (and transaction)")
    p.add_argument("--rounds", type=int, default=3,
                   help="repeat every (phase, system) measurement; medians are reported")
    p.add_argument("--idle-exit", type=float, default=1.0,
                   help="a worker stops after this many seconds of empty claims (default 1.0)")
    p.add_argument("--transactions", choices=("own", "explicit"), default="own",
                   help="own: claim and complete get the Engine and run as their own "
                        "transaction (one autocommitted statement each where the system can); "
                        "explicit: the worker wraps each call in BEGIN/COMMIT on its connection")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="drain on cold pooled connections (each session plans, and qstore's "
                        "functions compile, during the timed drain)")
    p.add_argument("--set", dest="settings", action="append", default=[], metavar="NAME=VALUE",
                   help="session setting for every benchmark connection, e.g. --set jit=off "
                        "(repeatable; applies to both systems)")
    p.add_argument("--skip-qstore", action="store_true")
    p.add_argument("--skip-classic", action="store_true")
    p.add_argument("--phases", default=",".join(PHASES),
                   help="comma-separated subset of clean,pinned")
    p.add_argument("--qstore-schema", default="bench_qstore")
    p.add_argument("--qstore-shards", type=int, default=1,
                   help="enqueue shards of the benchmark queue (queue_meta.enqueue_shards)")
    p.add_argument("--classic-schema", default="bench_classic")
    p.add_argument("--keep", action="store_true", help="keep the schemas after the run")
    p.add_argument("--json", type=Path, help="write the results here")
    a = p.parse_args(argv)
    a.phases = [x.strip() for x in a.phases.split(",") if x.strip()]
    for item in a.settings:
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip():
            p.error(f"--set expects NAME=VALUE, got {item!r}")
    if any(x not in PHASES for x in a.phases):
        p.error(f"--phases must be a subset of {','.join(PHASES)}")
    if min(a.jobs, a.threads, a.batch, a.enqueue_chunk, a.rounds) < 1:
        p.error("--jobs, --threads, --batch, --enqueue-chunk and --rounds must be >= 1")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.url.startswith("postgresql+psycopg://"):
        print("warning: COPY needs the psycopg 3 driver (postgresql+psycopg://)", file=sys.stderr)
    ensure_database(args.url)
    settings = dict(item.split("=", 1) for item in args.settings)
    engine = make_engine(args.url, args.threads, settings)
    exact = ensure_pgstattuple(engine)
    info = server_info(engine)
    print(f"jobs={args.jobs} threads={args.threads} batch={args.batch} "
          f"enqueue_chunk={args.enqueue_chunk} transactions={args.transactions} warmup={args.warmup} qstore_shards={args.qstore_shards} cpus={info['cpus']} "
          f"postgres={info['postgres']['server_version']} "
          f"autovacuum={info['postgres']['autovacuum']} jit={info['postgres']['jit']} "
          f"dead-tuple source={'pgstattuple' if exact else 'n_dead_tup'}"
          + (f" settings={settings}" if settings else ""))

    systems: list[Any] = []
    if not args.skip_qstore:
        systems.append(QstoreSystem(args.qstore_schema, args.qstore_shards))
    if not args.skip_classic:
        systems.append(ClassicSystem(args.classic_schema))
    jobs = workload(args.jobs)

    results: list[dict[str, Any]] = []
    started = time.time()
    try:
        for rnd in range(1, args.rounds + 1):
            for phase in args.phases:
                for system in systems:
                    print(f"... round {rnd}/{args.rounds}: {system.name} / {phase}", flush=True)
                    r = run_one(engine, system, phase, jobs, args, exact)
                    r["round"] = rnd
                    print(f"    INSERT {r['insert_enqueue']['jobs_per_s']:,.0f} j/s, "
                          f"COPY {r['copy_enqueue']['jobs_per_s']:,.0f} j/s, "
                          f"drain {r['drain']['jobs_per_s']:,.0f} j/s, "
                          f"dead {r['dead_total']:,}", flush=True)
                    results.append(r)
    finally:
        if not args.keep:
            for system in systems:
                system.drop(engine)
        engine.dispose()

    summary = summarise(results)
    print_report(results, summary)
    problems = [f"{r['system']}/{r['phase']}: {p}" for r in results for p in r["problems"]]
    if args.json:
        payload = {
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
        args.json.write_text(json.dumps(payload, indent=2, default=str) + "\n")
        print(f"\nwrote {args.json}")
    if problems:
        print("\nINVALID RUN:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
