"""Server CPU of a worker's claim cycle at a trickle, and how the server plans it.

One loop on two kept connections of an ``Engine`` (as a producer and a worker's claim cycle
hold them): enqueue one job, then ``complete_and_claim`` the job claimed before and claim
the new one, one job per cycle (the worker's cycle when jobs arrive one at a time). Each
block of ``--cycles`` cycles is timed by the claiming backend's own CPU (``/proc/<pid>/schedstat``,
the server process on this host) and by wall time per ``complete_and_claim`` call.
Reported: the medians over ``--blocks`` blocks, and how the server planned the cycle's
prepared statement on that connection (``pg_prepared_statements``: the generic plan is made
once, a custom plan at every execution).

The qstore this interpreter imports is measured; to compare two checkouts, run the script
alternately with ``PYTHONPATH=<checkout>`` and compare pair by pair. The script installs a
schema of its own and drops it at the end. The server must run on this host (its backend's
CPU is read from ``/proc``).

    python scripts/bench_trickle_cycle.py --cycles 1000 --blocks 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _benchlib import finish, process_cpu

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
QUEUE = "trickle"


def measure(url: str, schema: str, cycles: int, blocks: int, warm: int) -> dict[str, Any]:
    """Install ``schema``, run the blocks, and return the medians and the plan counts."""
    from sqlalchemy import create_engine, text

    from qstore import InsertOpts, InsertParams, QueueStorage, QueueStorageConfig
    from qstore.migrate import upgrade
    from qstore.storage.targets import keeping_engine, release_kept

    config = QueueStorageConfig(schema=schema)
    engine = create_engine(url, pool_size=3)
    with engine.begin() as conn:
        upgrade(conn, config)
    storage = QueueStorage(config)
    producing, claiming = keeping_engine(engine), keeping_engine(engine)
    claimed: list[Any] = []
    n = 0

    def cycle() -> float:
        nonlocal claimed, n
        n += 1
        storage.enqueue(producing, InsertParams("trickle", {"n": n}, InsertOpts(queue=QUEUE)))
        t0 = time.perf_counter()
        claimed = storage.complete_and_claim(claiming, claimed, QUEUE, 1).claimed
        return time.perf_counter() - t0

    cpu_us: list[float] = []
    wall_us: list[float] = []
    try:
        for _ in range(warm):
            cycle()
        _, driver, _ = claiming.__dict__["qstore_kept_connection"].take()
        pid = int(driver.execute("SELECT pg_backend_pid()").fetchone()[0])
        for _ in range(blocks):
            c0 = process_cpu(pid)
            walls = [cycle() for _ in range(cycles)]
            cpu_us.append((process_cpu(pid) - c0) / cycles * 1e6)
            wall_us.append(statistics.median(walls) * 1e6)
        plans = driver.execute(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements "
            "WHERE statement LIKE '%complete_receipts(%' AND statement LIKE '%claim_ready(%'").fetchall()
    finally:
        release_kept(producing)
        release_kept(claiming)
        with engine.begin() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        engine.dispose()
    generic, custom = (int(plans[0][0]), int(plans[0][1])) if plans else (0, 0)
    return {"backend_cpu_us": statistics.median(cpu_us), "call_p50_us": statistics.median(wall_us),
            "blocks_cpu_us": cpu_us, "generic_plans": generic, "custom_plans": custom}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--url", default=DEFAULT_URL)
    parser.add_argument("--cycles", type=int, default=1000, help="cycles per block")
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--warm", type=int, default=100, help="cycles before the first block")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    schema = f"qstore_trickle_{uuid.uuid4().hex[:8]}"
    figures = measure(args.url, schema, args.cycles, args.blocks, args.warm)
    print(f"trickle cycle (enqueue one job, complete_and_claim it): backend CPU "
          f"{figures['backend_cpu_us']:.0f} us per cycle (blocks: "
          f"{', '.join(f'{x:.0f}' for x in figures['blocks_cpu_us'])}), call p50 {figures['call_p50_us']:.0f} us; "
          f"the cycle's statement: {figures['generic_plans']} generic, {figures['custom_plans']} custom plans")
    return finish(Path(args.json) if args.json else None, figures, [])


if __name__ == "__main__":
    raise SystemExit(main())
