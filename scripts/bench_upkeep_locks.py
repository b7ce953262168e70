"""How long ring upkeep holds its exclusive locks, measured under load.

A prune takes ``ACCESS EXCLUSIVE`` on the children of one slot and holds it until its
transaction commits; a claim that needs one of those children waits (up to its own
``lock_timeout``) or passes it by. This script runs producers and claim/complete workers on
a small ring while an aggressive upkeep loop rotates and prunes every ring and rolls the
counters up, and records for every prune and rollup that took its exclusive lock the time
from the lock being granted to the commit (client side: from the ``LOCK TABLE`` statement's
return to the ``COMMIT``'s). It also records every claim's latency and any error a claim
raised (there must be none).

    python scripts/bench_upkeep_locks.py --seconds 60 --json docs/upkeep_locks.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, event

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _benchlib import ensure_database, make_engine, server_info

from qstore import InsertOpts, InsertParams, QueueStorage, QueueStorageConfig

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/bench_upkeep"
QUEUE = "locks"


@dataclass
class Holds:
    """Lock-to-commit durations per kind of upkeep transaction (seconds)."""

    durations: dict[str, list[float]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, seconds: float) -> None:
        with self.lock:
            self.durations.setdefault(kind, []).append(seconds)


def instrument(engine: Engine, holds: Holds) -> None:
    """Time ``LOCK TABLE … ACCESS EXCLUSIVE`` → ``COMMIT`` on every connection of ``engine``."""
    started: dict[int, tuple[str, float]] = {}

    @event.listens_for(engine, "after_cursor_execute")
    def after(conn: Any, cursor: Any, statement: str, params: Any, context: Any, many: bool) -> None:
        if statement.startswith("LOCK TABLE") and "ACCESS EXCLUSIVE" in statement:
            kind = ("queue_prune" if "ready_entries_" in statement
                    else "claim_prune" if "lease_claims_" in statement
                    else "lease_prune" if "leases_" in statement
                    else "rollup" if "count_deltas_" in statement else "other")
            started.setdefault(id(conn.connection.dbapi_connection), (kind, time.perf_counter()))

    def done(conn: Any) -> None:
        key = id(conn.connection.dbapi_connection)
        if key in started:
            kind, t0 = started.pop(key)
            holds.add(kind, time.perf_counter() - t0)

    event.listen(engine, "commit", done)
    event.listen(engine, "rollback", lambda conn: started.pop(id(conn.connection.dbapi_connection), None))


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=DEFAULT_URL)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--rate", type=float, default=1000.0, help="jobs/s offered by the producer")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--upkeep-every", type=float, default=0.075)
    p.add_argument("--schema", default="bench_upkeep_locks")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)

    ensure_database(args.url)
    engine = make_engine(args.url, args.workers + 4)
    storage = QueueStorage(QueueStorageConfig(schema=args.schema, queue_slot_count=4,
                                              lease_slot_count=2, claim_slot_count=2))
    storage.reset(engine)
    storage.prepare_schema(engine)
    upkeep_engine = make_engine(args.url, 2)
    holds = Holds()
    instrument(upkeep_engine, holds)

    stop = threading.Event()
    claim_lat: list[float] = []
    errors: list[str] = []
    done = [0]
    lock = threading.Lock()

    def producer() -> None:
        n = 0
        batch = max(1, int(args.rate / 100))
        next_at = time.monotonic()
        while not stop.is_set():
            storage.enqueue_params_batch(engine, [InsertParams("j", {"n": n + i}, InsertOpts(queue=QUEUE))
                                                  for i in range(batch)])
            n += batch
            next_at += batch / args.rate
            time.sleep(max(0.0, next_at - time.monotonic()))

    def worker() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                jobs = storage.claim_runtime_batch(engine, QUEUE, 20)
            except Exception as exc:  # a claim must not raise because upkeep runs
                with lock:
                    errors.append(f"{type(exc).__name__}: {exc}")
                continue
            with lock:
                claim_lat.append(time.perf_counter() - t0)
            if jobs:
                finished = storage.complete_runtime_batch(engine, jobs)
                with lock:
                    done[0] += len(finished)
            else:
                time.sleep(0.005)

    def upkeep() -> None:
        while not stop.is_set():
            for rotate, prune in ((storage.rotate, storage.prune_oldest),
                                  (storage.rotate_claims, storage.prune_oldest_claims),
                                  (storage.rotate_leases, storage.prune_oldest_leases)):
                rotate(upkeep_engine)
                prune(upkeep_engine)
            storage.rollup_terminal_count_deltas(upkeep_engine, 4)
            time.sleep(args.upkeep_every)

    threads = [threading.Thread(target=producer), threading.Thread(target=upkeep),
               *(threading.Thread(target=worker) for _ in range(args.workers))]
    for t in threads:
        t.start()
    time.sleep(args.seconds)
    stop.set()
    for t in threads:
        t.join()

    summary: dict[str, Any] = {"server": server_info(engine), "seconds": args.seconds,
                               "completed": done[0], "claim_errors": errors[:20],
                               "claim_error_count": len(errors), "holds_ms": {}, "claim_ms": {}}
    for kind, values in sorted(holds.durations.items()):
        ms = [v * 1000 for v in values]
        summary["holds_ms"][kind] = {"n": len(ms), "p50": round(statistics.median(ms), 2),
                                     "p95": round(pct(ms, 0.95), 2), "p99": round(pct(ms, 0.99), 2),
                                     "max": round(max(ms), 2)}
    cl = [v * 1000 for v in claim_lat]
    summary["claim_ms"] = {"n": len(cl), "p50": round(statistics.median(cl), 2) if cl else 0,
                           "p99": round(pct(cl, 0.99), 2), "max": round(max(cl), 2) if cl else 0}
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    storage.reset(engine)
    engine.dispose()
    upkeep_engine.dispose()
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
