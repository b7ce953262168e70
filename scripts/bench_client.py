"""Client-side cost of the hot calls: CPU (``time.process_time``) and wall time per call.

Each hot call of the public API is timed over many repetitions next to the cheapest way to
send the same work through raw psycopg (a prepared statement on an autocommit connection):

* an empty claim (``claim_runtime_batch`` on a queue with nothing ready), on an ``Engine``
  and inside a caller's ``Connection``;
* a single-job enqueue (``enqueue``) on an ``Engine``;
* claim + complete of one job on an ``Engine``.

It also counts statements SQLAlchemy compiled during the timed loops (new entries of the
engine's compiled cache): a hot call compiles nothing after warm-up.

    python scripts/bench_client.py --url postgresql+psycopg://postgres@127.0.0.1:5432/qstore_bench
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
from sqlalchemy import Engine, text

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _benchlib import ensure_database, format_table, make_engine

from qstore import InsertOpts, InsertParams, QueueStorage, QueueStorageConfig


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="postgresql+psycopg://postgres@127.0.0.1:5432/qstore_bench")
    ap.add_argument("--schema", default="qstore_client_bench")
    ap.add_argument("--repeat", type=int, default=2000, help="calls per round")
    ap.add_argument("--rounds", type=int, default=5)
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
        ("enqueue + claim + complete of one job, API, Engine", api_claim_complete, args.repeat // 4),
    ]
    rows, figures = [], {}
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
    raw.execute("DROP TABLE public.bench_client_classic")
    raw.close()
    with engine.begin() as conn:
        conn.execute(text(f'DROP SCHEMA "{sch}" CASCADE'))
    engine.dispose()
    print(format_table(["call", "CPU µs/call", "wall µs/call", "compiles"], rows))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
