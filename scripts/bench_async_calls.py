"""Client CPU of single hot calls on the async face, one coroutine.

Four cases, each timed over ``--calls`` calls per block with ``time.process_time()``
(client CPU) and ``time.perf_counter()`` (wall, for calls/s), ``--blocks`` blocks each:

* ``enqueue``: ``AsyncQueueStorage.enqueue(async_engine, one job)``;
* ``claim``: ``claim_runtime_batch(async_engine, queue, 1)`` of one waiting job;
* ``enqueue_in_tx`` / ``claim_in_tx``: the same inside ``async with async_engine.begin()
  as conn:``, one transaction per call (its begin and commit counted).

Reported: the median over the blocks of CPU µs per call and of calls/s. The qstore this
interpreter imports is measured; to compare two checkouts, run the script alternately with
``PYTHONPATH=<checkout>`` and compare pair by pair (the host's speed moves between runs).
The script installs a schema of its own and drops it at the end.

    python scripts/bench_async_calls.py --calls 1000 --blocks 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
CASES = ("enqueue", "claim", "enqueue_in_tx", "claim_in_tx")


async def _block(call: Callable[[], Awaitable[Any]], calls: int) -> tuple[float, float]:
    """(CPU µs per call, calls/s by wall time) of ``calls`` awaited calls."""
    c0, w0 = time.process_time(), time.perf_counter()
    for _ in range(calls):
        await call()
    return (time.process_time() - c0) / calls * 1e6, calls / (time.perf_counter() - w0)


async def measure(url: str, schema: str, calls: int, blocks: int, warm: int) -> dict[str, dict[str, float]]:
    """Install ``schema``, time every case, and return its medians."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.ext.asyncio import create_async_engine

    from qstore import InsertOpts, InsertParams, QueueStorage, QueueStorageConfig
    from qstore.aio import AsyncQueueStorage
    from qstore.migrate import upgrade

    config = QueueStorageConfig(schema=schema)
    engine = create_engine(url)
    with engine.begin() as conn:
        upgrade(conn, config)
    aengine = create_async_engine(url, pool_size=2)
    astorage = AsyncQueueStorage(QueueStorage(config))
    job = InsertParams("bench", {"n": 1}, InsertOpts(queue="bench"))

    async def in_tx(op: Callable[[Any], Awaitable[Any]]) -> Any:
        async with aengine.begin() as conn:
            return await op(conn)

    cases: dict[str, Callable[[], Awaitable[Any]]] = {
        "enqueue": lambda: astorage.enqueue(aengine, job),
        "claim": lambda: astorage.claim_runtime_batch(aengine, "bench", 1),
        "enqueue_in_tx": lambda: in_tx(lambda c: astorage.enqueue(c, job)),
        "claim_in_tx": lambda: in_tx(lambda c: astorage.claim_runtime_batch(c, "bench", 1)),
    }
    figures: dict[str, list[tuple[float, float]]] = {name: [] for name in CASES}
    try:
        for _ in range(warm):  # prepared statements and pool connections in place
            await cases["enqueue"]()
            await cases["claim"]()
        for _ in range(blocks):
            for name in CASES:  # each claim block finds the jobs the enqueue block before it wrote
                figures[name].append(await _block(cases[name], calls))
    finally:
        await aengine.dispose()
        with engine.begin() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        engine.dispose()
    return {name: {"cpu_us": statistics.median(c for c, _ in got), "calls_per_s": statistics.median(r for _, r in got)}
            for name, got in figures.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=DEFAULT_URL)
    p.add_argument("--calls", type=int, default=1000, help="calls per block")
    p.add_argument("--blocks", type=int, default=5)
    p.add_argument("--warm", type=int, default=200, help="untimed enqueue-and-claim pairs first")
    p.add_argument("--json", help="write the figures here too")
    args = p.parse_args(argv)
    schema = f"qstore_async_calls_{uuid.uuid4().hex[:8]}"
    figures = asyncio.run(measure(args.url, schema, args.calls, args.blocks, args.warm))
    for name, f in figures.items():
        print(f"{name:<14} {f['cpu_us']:>7.0f} µs CPU per call  {f['calls_per_s']:>8,.0f} calls/s")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(figures, out, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
