"""Client-side cost of the hot calls: CPU (``time.process_time``) and wall time per call.

Each hot call of the public API is timed over many repetitions next to the cheapest way to
send the same work through raw psycopg (a prepared statement on an autocommit connection):

* an empty claim (``claim_runtime_batch`` on a queue with nothing ready), on an ``Engine``
  and inside a caller's ``Connection``;
* a single-job enqueue (``enqueue``) on an ``Engine``;
* claim + complete of one job on an ``Engine``.

It also counts statements SQLAlchemy compiled during the timed loops (new entries of the
engine's compiled cache): a hot call compiles nothing after warm-up.

Then the single-job enqueue on an ``Engine`` runs side by side with the raw psycopg
``INSERT`` (and the psycopg classic queue's ``INSERT`` that sends its own ``pg_notify``),
interleaved call by call (``--ratio-rounds`` rounds of ``--ratio-block`` calls of each), so
a change of the host's speed moves both sides alike: the ratio calls/s of the API ÷ calls/s
of the raw statement, by total time and by median call, median over the rounds. The API's
own statement (``enqueue_jobs`` with the parameters the API sends) sent by raw psycopg runs
in the same interleaving: API ÷ it is the API's client overhead, and it ÷ the ``INSERT`` is
the best ratio any client could reach with that server function.
The same interleaving runs once more with a task's ``defer(engine, ...)`` (the app's default
telemetry) in the API's place.
``--drain-jobs N`` (default 20,000; 0 skips it) then drains N jobs with ``--drain-threads``
threads over the storage API on the ``Engine``, each thread cycling either
``claim_runtime_batch`` + ``complete_runtime_batch`` (two calls per cycle) or
``complete_and_claim`` (one call per cycle: the previous batch completed, the next one
claimed), claim batch ``--drain-batch``: jobs/s and the process's CPU per job, then a
smaller traced drain of each (``--trace-jobs``) counting round trips per job on the wire.
``--profile NAME`` prints where the client time of one call goes (``cProfile`` over CPU
time, top functions) for ``enqueue`` or ``claim``.

    python scripts/bench_client.py --url postgresql+psycopg://postgres@127.0.0.1:5432/qstore_bench
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy import Engine, text

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _benchlib import WireTrace, ensure_database, format_table, make_engine

from qstore import InsertOpts, InsertParams, QueueStorage, QueueStorageConfig
from qstore.tasks import App, JobContext


class CacheMisses:
    """Counts statements SQLAlchemy had to compile on ``engine``: new entries of its compiled
    cache. (Not a cursor-event listener: qstore sends hot statements through SQLAlchemy's
    ``Connection`` whenever someone listens to cursor events, so a listener would measure
    that path instead of the default one.)"""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @property
    def misses(self) -> int:
        cache = self.engine._compiled_cache
        return len(cache) if cache is not None else 0


def per_call(fn: Callable[[], object], repeat: int, rounds: int) -> tuple[float, float]:
    """Median over ``rounds`` of (CPU µs, wall µs) per call of ``fn``."""
    cpu, wall = [], []
    for _ in range(rounds):
        c0, w0 = time.process_time(), time.perf_counter()
        for _ in range(repeat):
            fn()
        cpu.append((time.process_time() - c0) / repeat * 1e6)
        wall.append((time.perf_counter() - w0) / repeat * 1e6)
    return statistics.median(cpu), statistics.median(wall)


def side_by_side(fns: dict[str, Callable[[], object]], block: int, rounds: int) -> dict[str, dict[str, Any]]:
    """Interleave single calls of ``fns`` (the first is the API call, the others raw ones):
    ``rounds`` rounds of ``block`` calls of each, call after call in turn, each call timed.
    Per raw system and round, the ratio API calls/s ÷ raw calls/s by the round's total time
    (``by_rate``) and by its median call (``by_median_call``, which the host's stalls move
    less); medians over the rounds."""
    if rounds <= 0:
        return {}
    for fn in fns.values():
        for _ in range(50):
            fn()
    names = list(fns)
    calls = list(fns.values())
    per_round: list[dict[str, list[float]]] = []
    clock = time.perf_counter
    for _ in range(rounds):
        times: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(block):
            for name, fn in zip(names, calls, strict=True):
                t0 = clock()
                fn()
                times[name].append(clock() - t0)
        per_round.append(times)
    api, *raws = names
    out = {}
    for name in raws:
        by_rate = [sum(r[name]) / sum(r[api]) for r in per_round]
        by_call = [statistics.median(r[name]) / statistics.median(r[api]) for r in per_round]
        out[name] = {"by_rate": statistics.median(by_rate), "by_median_call": statistics.median(by_call),
                     "rounds_by_rate": [round(x, 3) for x in by_rate],
                     "rounds_by_median_call": [round(x, 3) for x in by_call],
                     "api_median_call_us": statistics.median(statistics.median(r[api]) for r in per_round) * 1e6,
                     "raw_median_call_us": statistics.median(statistics.median(r[name]) for r in per_round) * 1e6}
    return out


LOOPS = ("claim + complete", "complete_and_claim")


def drain_loop(engine: Engine, storage: QueueStorage, loop: str, jobs: int, threads: int,
               batch: int, trace: WireTrace | None = None) -> tuple[float, float, int]:
    """Load ``jobs`` jobs into queue ``drain`` of a fresh install, then drain them with
    ``threads`` threads cycling ``loop`` (see the module docstring); returns (seconds,
    process CPU seconds, statements compiled) of the drain. ``trace``: the drain's
    connections (all new: the pool is emptied after the load) are traced."""
    storage.reset(engine, force=True)
    storage.install(engine)
    with engine.begin() as conn:
        storage.enqueue_batch(conn, "drain", 2, jobs)
    if trace is not None:
        engine.dispose()
        trace.attach_engine(engine)
    misses = CacheMisses(engine)
    before = misses.misses
    done = [0] * threads
    start = threading.Barrier(threads + 1)

    def cycle(n: int) -> None:
        start.wait()
        held: list[Any] = []
        empty = 0
        while empty < 3:
            if loop == "complete_and_claim":
                got = storage.complete_and_claim(engine, held, "drain", batch)
                done[n] += len(got.completed)
                held = got.claimed
            else:
                held = storage.claim_runtime_batch(engine, "drain", batch)
                done[n] += len(storage.complete_runtime_batch(engine, held))
            empty = 0 if held else empty + 1
            if not held:
                time.sleep(0.005)

    pool = [threading.Thread(target=cycle, args=(n,)) for n in range(threads)]
    for t in pool:
        t.start()
    start.wait()
    c0, w0 = time.process_time(), time.perf_counter()
    for t in pool:
        t.join()
    seconds, cpu = time.perf_counter() - w0, time.process_time() - c0
    if sum(done) != jobs:
        raise SystemExit(f"{loop}: completed {sum(done)} of {jobs} jobs")
    return seconds, cpu, misses.misses - before


def drains(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Each loop of :data:`LOOPS` timed over ``--drain-jobs``, then traced over ``--trace-jobs``."""
    storage = QueueStorage(QueueStorageConfig(schema=args.schema + "_drain"))
    out = {}
    loops = [loop for loop in LOOPS if loop != "complete_and_claim" or hasattr(storage, "complete_and_claim")]
    for loop in loops:
        engine = make_engine(args.url, args.drain_threads)
        try:
            drain_loop(engine, storage, loop, args.drain_batch * args.drain_threads * 4, args.drain_threads,
                       args.drain_batch)  # warm: connections, prepared statements, server plans
            seconds, cpu, compiled = drain_loop(engine, storage, loop, args.drain_jobs, args.drain_threads,
                                                args.drain_batch)
        finally:
            engine.dispose()
        traced = make_engine(args.url, args.drain_threads)
        trace = WireTrace()
        try:
            drain_loop(traced, storage, loop, args.trace_jobs, args.drain_threads, args.drain_batch, trace)
            wire = trace.counts()
        finally:
            storage.reset(traced, force=True)
            traced.dispose()
        out[loop] = {"jobs_per_s": args.drain_jobs / seconds, "cpu_us_per_job": cpu / args.drain_jobs * 1e6,
                     "round_trips_per_job": WireTrace.round_trips(wire) / args.trace_jobs, "compiled": compiled}
    return out


def profile(fn: Callable[[], object], repeat: int) -> None:
    """Print the functions one call of ``fn`` spends its client CPU in (cProfile)."""
    import cProfile
    import pstats

    for _ in range(200):
        fn()
    prof = cProfile.Profile(time.process_time)
    prof.enable()
    for _ in range(repeat):
        fn()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="postgresql+psycopg://postgres@127.0.0.1:5432/qstore_bench")
    ap.add_argument("--schema", default="qstore_client_bench")
    ap.add_argument("--repeat", type=int, default=2000, help="calls per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ratio-rounds", type=int, default=5, help="rounds of interleaved calls (0: skip)")
    ap.add_argument("--ratio-block", type=int, default=1000, help="calls of each system per round")
    ap.add_argument("--profile", choices=("enqueue", "claim"), help="profile one call and exit")
    ap.add_argument("--drain-jobs", type=int, default=20_000, help="jobs per drain (0: skip the drains)")
    ap.add_argument("--drain-threads", type=int, default=8)
    ap.add_argument("--drain-batch", type=int, default=10)
    ap.add_argument("--trace-jobs", type=int, default=2_000, help="jobs of the traced drains")
    ap.add_argument("--json", help="write the figures to this file")
    args = ap.parse_args()

    ensure_database(args.url)
    engine = make_engine(args.url, 1)
    storage = QueueStorage(QueueStorageConfig(schema=args.schema))
    storage.reset(engine, force=True)
    storage.install(engine)
    misses = CacheMisses(engine)
    dsn = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    raw = psycopg.connect(dsn, autocommit=True)
    sch = args.schema
    job = InsertParams(kind="bench", args={"n": 1}, opts=InsertOpts(queue="bench"))

    def api_claim_engine() -> object:
        return storage.claim_runtime_batch(engine, "empty", 10)

    held = engine.connect()

    def api_claim_connection() -> object:
        return storage.claim_runtime_batch(held, "empty", 10)

    claim_sql = f"SELECT * FROM {sch}.claim_ready(%s, %s, %s, %s, %s)"

    def raw_claim() -> object:
        return raw.execute(claim_sql, ("empty", 10, 0, 0, True), prepare=True).fetchall()

    def api_enqueue() -> object:
        return storage.enqueue(engine, job)

    raw.execute("CREATE TABLE IF NOT EXISTS public.bench_client_classic "
                "(id bigserial PRIMARY KEY, kind text, queue text, args jsonb)")

    def raw_insert() -> object:
        return raw.execute("INSERT INTO public.bench_client_classic (kind, queue, args) "
                           "VALUES (%s, %s, %s) RETURNING id",
                           ("bench", "bench", '{"n": 1}'), prepare=True).fetchone()

    def raw_insert_notify() -> object:
        return raw.execute("WITH j AS (INSERT INTO public.bench_client_classic (kind, queue, args) "
                           "VALUES (%s, %s, %s) RETURNING id) SELECT j.id, pg_notify(%s, '') FROM j",
                           ("bench", "bench", '{"n": 1}', "bench_client"), prepare=True).fetchone()

    # the API's own enqueue statement and parameters, sent by raw psycopg: the server's share
    from qstore.storage import enqueue as enqueuing
    from qstore.storage.jobs import prepare_jobs

    enqueue_sql, enqueue_params = enqueuing._enqueue_one_stmt(storage.tables).in_order(
        engine.dialect, enqueuing._VALUE_KEYS,
        enqueuing._one_values(storage.tables, prepare_jobs([job], 1, field="job")[0]))

    def raw_enqueue_jobs() -> object:
        return raw.execute(enqueue_sql, enqueue_params, prepare=True).fetchall()

    if args.profile:
        profile({"enqueue": api_enqueue, "claim": api_claim_engine}[args.profile], args.repeat)
        raw.execute("DROP TABLE public.bench_client_classic")
        raw.close()
        held.close()
        storage.reset(engine, force=True)
        engine.dispose()
        return

    def api_claim_complete() -> object:
        storage.enqueue(engine, job)
        claimed = storage.claim_runtime_batch(engine, "bench", 1)
        return storage.complete_runtime_batch(engine, claimed)

    cases: list[tuple[str, Callable[[], object], int]] = [
        ("empty claim, API, Engine", api_claim_engine, args.repeat),
        ("empty claim, API, Connection (caller's transaction)", api_claim_connection, args.repeat),
        ("empty claim, raw psycopg (prepared, autocommit)", raw_claim, args.repeat),
        ("single-job enqueue, API, Engine", api_enqueue, args.repeat // 2),
        ("single INSERT, raw psycopg (classic)", raw_insert, args.repeat // 2),
        ("single INSERT + pg_notify, raw psycopg", raw_insert_notify, args.repeat // 2),
        ("enqueue + claim + complete of one job, API, Engine", api_claim_complete, args.repeat // 4),
    ]
    rows: list[list[str]] = []
    figures: dict[str, Any] = {}
    for name, fn, repeat in cases:
        for _ in range(50):  # warm: plans, compiled cache, server function compile
            fn()
        before = misses.misses
        cpu, wall = per_call(fn, repeat, args.rounds)
        compiled = misses.misses - before
        figures[name] = {"cpu_us": round(cpu, 1), "wall_us": round(wall, 1), "cache_misses": compiled}
        rows.append([name, f"{cpu:.1f}", f"{wall:.1f}", str(compiled)])
        if fn is api_claim_connection:
            held.rollback()
    held.close()
    ratios = side_by_side({"enqueue": api_enqueue, "insert": raw_insert, "insert_notify": raw_insert_notify,
                           "enqueue_jobs_raw": raw_enqueue_jobs},
                          args.ratio_block, args.ratio_rounds)
    # the same with a task's defer (what an application calls), the app's default telemetry
    app = App(storage)

    @app.task(kind="bench", queue="bench")
    def bench(ctx: JobContext, n: int) -> None: ...

    def task_defer() -> object:
        return bench.defer(engine, n=1)

    defer_ratios = side_by_side({"defer": task_defer, "insert": raw_insert, "insert_notify": raw_insert_notify,
                                 "enqueue_jobs_raw": raw_enqueue_jobs},
                                args.ratio_block, args.ratio_rounds)
    raw.execute("DROP TABLE public.bench_client_classic")
    raw.close()
    with engine.begin() as conn:
        conn.execute(text(f'DROP SCHEMA "{sch}" CASCADE'))
    engine.dispose()
    if args.drain_jobs > 0:
        figures["drain"] = drains(args)
    print(format_table(["call", "CPU µs/call", "wall µs/call", "compiles"], rows))
    if args.drain_jobs > 0:
        print(f"\nDrain of {args.drain_jobs:,} jobs, {args.drain_threads} threads, claim {args.drain_batch}, "
              f"Engine (round trips from a traced drain of {args.trace_jobs:,}):")
        print(format_table(["loop", "jobs/s", "client CPU µs/job", "round trips/job", "statements compiled"],
                           [[name, f"{d['jobs_per_s']:,.0f}", f"{d['cpu_us_per_job']:.1f}",
                             f"{d['round_trips_per_job']:.3f}", str(d["compiled"])]
                            for name, d in figures["drain"].items()]))
    for what, found, key in (("Single-job enqueue", ratios, "side_by_side"),
                             ("A task's single defer", defer_ratios, "defer_side_by_side")):
        if not found:
            continue
        figures[key] = found
        print(f"\n{what} on an Engine ÷ raw psycopg, side by side ({args.ratio_rounds} rounds "
              f"of {args.ratio_block} calls each, interleaved call by call; calls/s ratio, median of the rounds):")
        for name, r in found.items():
            print(f"  vs {name:<14} by rate {r['by_rate']:.2f}x, by median call {r['by_median_call']:.2f}x "
                  f"({r['api_median_call_us']:.0f} vs {r['raw_median_call_us']:.0f} µs)   per round by median "
                  f"call {' '.join(f'{x:.2f}' for x in r['rounds_by_median_call'])}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
