"""Steady-state soak: qstore and the in-repo classic queue side by side, in one run.

Both systems run *at the same time* against one PostgreSQL database, each with its own
producer (a fixed offered rate), its own draining workers and — for qstore — a maintenance
thread that rotates and prunes all three rings every ``--rotate`` seconds. The run has three
equal phases:

* ``clean``    — nothing holds the MVCC horizon;
* ``pinned``   — one extra connection sits idle in a transaction that holds an xid, so no
  dead tuple deleted after it began can be removed by (auto)vacuum for either system;
* ``recovery`` — the pin is released.

Every ``--sample`` seconds it records, per system and table family, dead tuples
(``n_dead_tup``), total bytes (heap + indexes + toast) and the completed-jobs throughput.
When the server runs with ``autovacuum = off`` (as the development machines do) the script
runs ``VACUUM`` on both systems' tables every ``--vacuum-interval`` seconds, standing in for
autovacuum, so the classic queue is given the same chance to recover as in production.

Output: a JSON time series, a PNG plot (matplotlib) and a verdict against the targets of
issue 5: qstore dead tuples <= 1 % of the classic queue's at the end of the pinned phase;
qstore total bytes back within 10 % of the clean-phase level by the end of recovery; no
throughput collapse while pinned (completed rate >= 90 % of the offered rate).

    python scripts/bench_steady.py --rate 1000 --duration 600 --plot docs/steady.png
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, text

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _benchlib import XminPin, ensure_database, family_of, make_engine, server_info
from classic_queue import ClassicQueue

from qstore import QueueStorage, QueueStorageConfig
from qstore.storage.jobs import InsertOpts, InsertParams

QUEUE = "steady"
DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/bench_steady"


@dataclass
class Counters:
    enqueued: int = 0
    completed: int = 0
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, name: str, n: int) -> None:
        with self.lock:
            setattr(self, name, getattr(self, name) + n)


class System:
    """What the soak needs from a queue: enqueue, claim + complete, and a schema to sample."""

    name: str
    schema: str

    def install(self, engine: Engine) -> None:
        raise NotImplementedError

    def drop(self, engine: Engine) -> None:
        raise NotImplementedError

    def enqueue(self, engine: Engine, n: int, seq: int) -> int:
        raise NotImplementedError

    def work(self, engine: Engine, batch: int) -> int:
        raise NotImplementedError

    def maintain(self, engine: Engine) -> None:
        raise NotImplementedError


class QstoreSystem(System):
    name = "qstore"

    def __init__(self, schema: str, shards: int) -> None:
        self.schema = schema
        self.shards = shards
        self.storage = QueueStorage(QueueStorageConfig(schema=schema))
        self.opts = InsertOpts(queue=QUEUE)
        self.maintenance: dict[str, int] = {}

    def install(self, engine: Engine) -> None:
        self.storage.reset(engine)
        self.storage.prepare_schema(engine)
        if self.shards > 1:
            self.storage.set_queue_options(engine, QUEUE, enqueue_shards=self.shards)

    def drop(self, engine: Engine) -> None:
        self.storage.reset(engine)

    def enqueue(self, engine: Engine, n: int, seq: int) -> int:
        jobs = [InsertParams("steady_job", {"seq": seq + i}, self.opts) for i in range(n)]
        return self.storage.enqueue_params_batch(engine, jobs)

    def work(self, engine: Engine, batch: int) -> int:
        claimed = self.storage.claim_runtime_batch(engine, QUEUE, batch)
        if not claimed:
            return 0
        return len(self.storage.complete_runtime_batch(engine, claimed))

    def maintain(self, engine: Engine) -> None:
        s = self.storage
        for name, op in (("rotate", s.rotate), ("prune", s.prune_oldest),
                         ("rotate_leases", s.rotate_leases), ("prune_leases", s.prune_oldest_leases),
                         ("rotate_claims", s.rotate_claims), ("prune_claims", s.prune_oldest_claims)):
            outcome = op(engine)
            key = f"{name}:{outcome.kind}"
            self.maintenance[key] = self.maintenance.get(key, 0) + 1


class ClassicSystem(System):
    name = "classic"

    def __init__(self, schema: str) -> None:
        self.schema = schema
        self.q = ClassicQueue(schema)

    def install(self, engine: Engine) -> None:
        with engine.begin() as conn:
            self.q.drop(conn)
            self.q.create(conn)

    def drop(self, engine: Engine) -> None:
        with engine.begin() as conn:
            self.q.drop(conn)

    def enqueue(self, engine: Engine, n: int, seq: int) -> int:
        with engine.begin() as conn:
            return self.q.enqueue_insert(conn, [(QUEUE, "steady_job", 2, {"seq": seq + i})
                                                for i in range(n)])

    def work(self, engine: Engine, batch: int) -> int:
        with engine.begin() as conn:
            jobs = self.q.claim(conn, QUEUE, batch)
        if not jobs:
            return 0
        with engine.begin() as conn:
            return self.q.complete(conn, [j.id for j in jobs])

    def maintain(self, engine: Engine) -> None:
        return None


def sample_tables(engine: Engine, schemas: list[str]) -> dict[str, dict[str, dict[str, int]]]:
    """``{schema: {family: {"dead": n_dead_tup, "bytes": total bytes}}}``."""
    sql = text(
        "SELECT n.nspname, c.relname, coalesce(s.n_dead_tup, 0), pg_total_relation_size(c.oid) "
        "FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid "
        "WHERE n.nspname = ANY(:schemas) AND c.relkind = 'r'"
    )
    out: dict[str, dict[str, dict[str, int]]] = {s: {} for s in schemas}
    with engine.connect() as conn:
        conn.execute(text("SELECT pg_stat_clear_snapshot()"))
        for schema, rel, dead, size in conn.execute(sql, {"schemas": schemas}).all():
            fam = out[schema].setdefault(family_of(rel), {"dead": 0, "bytes": 0})
            fam["dead"] += int(dead)
            fam["bytes"] += int(size)
        conn.rollback()
    return out


def vacuum_schemas(engine: Engine, schemas: list[str]) -> None:
    """Stand-in for autovacuum: plain VACUUM of every table of the given schemas."""
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        rels = conn.execute(text(
            "SELECT quote_ident(n.nspname) || '.' || quote_ident(c.relname) "
            "FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = ANY(:s) AND c.relkind = 'r'"), {"s": schemas}).scalars().all()
        for rel in rels:
            with contextlib.suppress(Exception):  # a ring child locked meanwhile: next round
                conn.execute(text(f"VACUUM {rel}"))


def loop(stop: threading.Event, every: float, fn: Callable[[], None], errors: list[str]) -> None:
    next_at = time.monotonic()
    while not stop.is_set():
        try:
            fn()
        except Exception as err:  # keep the soak running; report at the end
            errors.append(f"{type(err).__name__}: {err}"[:300])
        next_at += every
        stop.wait(max(0.0, next_at - time.monotonic()))


def run(args: argparse.Namespace) -> dict[str, Any]:
    ensure_database(args.url)
    systems: list[System] = [QstoreSystem(args.qstore_schema, args.qstore_shards),
                             ClassicSystem(args.classic_schema)]
    engine = make_engine(args.url, args.workers * len(systems) + 8)
    info = server_info(engine)
    emulate_autovacuum = args.vacuum_interval > 0 and info["postgres"]["autovacuum"] == "off"
    for s in systems:
        s.install(engine)
    counters = {s.name: Counters() for s in systems}
    stop = threading.Event()
    threads: list[threading.Thread] = []
    tick = 0.1

    for s in systems:
        c = counters[s.name]
        per_tick = args.rate * tick
        carry = {"x": 0.0, "seq": 0}

        def produce(s: System = s, c: Counters = c, carry: dict[str, float] = carry,
                    per_tick: float = per_tick) -> None:
            carry["x"] += per_tick
            n = int(carry["x"])
            if n:
                carry["x"] -= n
                c.add("enqueued", s.enqueue(engine, n, int(carry["seq"])))
                carry["seq"] += n

        threads.append(threading.Thread(target=loop, args=(stop, tick, produce, c.errors), daemon=True))

        def worker(s: System = s, c: Counters = c) -> None:
            while not stop.is_set():
                try:
                    done = s.work(engine, args.batch)
                except Exception as err:
                    c.errors.append(f"{type(err).__name__}: {err}"[:300])
                    done = 0
                if done:
                    c.add("completed", done)
                else:
                    stop.wait(0.02)

        threads += [threading.Thread(target=worker, daemon=True) for _ in range(args.workers)]
        threads.append(threading.Thread(target=loop, args=(stop, args.rotate, lambda s=s: s.maintain(engine),
                                                           c.errors), daemon=True))
    if emulate_autovacuum:
        vac_errors: list[str] = []
        threads.append(threading.Thread(
            target=loop, args=(stop, args.vacuum_interval,
                               lambda: vacuum_schemas(engine, [s.schema for s in systems]), vac_errors),
            daemon=True))

    phase_len = args.duration / 3
    samples: list[dict[str, Any]] = []
    pin: XminPin | None = None
    t0 = time.monotonic()
    for t in threads:
        t.start()
    last = {s.name: 0 for s in systems}
    phase = "clean"
    try:
        while (elapsed := time.monotonic() - t0) < args.duration:
            if phase == "clean" and elapsed >= phase_len:
                pin = XminPin(engine).__enter__()
                phase = "pinned"
            elif phase == "pinned" and elapsed >= 2 * phase_len:
                assert pin is not None
                pin.__exit__(None, None, None)
                pin = None
                phase = "recovery"
            tables = sample_tables(engine, [s.schema for s in systems])
            row: dict[str, Any] = {"t": round(elapsed, 1), "phase": phase}
            for s in systems:
                c = counters[s.name]
                done = c.completed
                row[s.name] = {
                    "dead": sum(f["dead"] for f in tables[s.schema].values()),
                    "bytes": sum(f["bytes"] for f in tables[s.schema].values()),
                    "families": tables[s.schema],
                    "completed_per_s": (done - last[s.name]) / args.sample if samples else None,
                    "backlog": c.enqueued - done,
                }
                last[s.name] = done
            samples.append(row)
            print(f"t={row['t']:6.1f}s {phase:8s} " + "  ".join(
                f"{s.name}: dead={row[s.name]['dead']:>8,} bytes={row[s.name]['bytes'] / 2**20:7.1f}MiB "
                f"rate={row[s.name]['completed_per_s'] or 0:7.0f}/s backlog={row[s.name]['backlog']:>6,}"
                for s in systems), flush=True)
            time.sleep(max(0.0, args.sample - (time.monotonic() - t0 - elapsed)))
    finally:
        stop.set()
        if pin is not None:
            pin.__exit__(None, None, None)
        for t in threads:
            t.join(timeout=10)
    result = {
        "config": {k: v for k, v in vars(args).items() if k not in ("url", "plot", "json")},
        "machine": info,
        "emulated_autovacuum": emulate_autovacuum,
        "samples": samples,
        "errors": {s.name: counters[s.name].errors[:20] for s in systems},
        "qstore_maintenance": systems[0].maintenance if isinstance(systems[0], QstoreSystem) else {},
    }
    result["verdict"] = verdict(samples, args.rate)
    if not args.keep:
        for s in systems:
            s.drop(engine)
    engine.dispose()
    return result


def verdict(samples: list[dict[str, Any]], rate: float) -> dict[str, Any]:
    def phase(p: str) -> list[dict[str, Any]]:
        return [s for s in samples if s["phase"] == p]

    pinned, clean, recovery = phase("pinned"), phase("clean"), phase("recovery")
    end_pinned = pinned[-1]
    dead_q, dead_c = end_pinned["qstore"]["dead"], end_pinned["classic"]["dead"]
    dead_pct = 100.0 * dead_q / dead_c if dead_c else None
    clean_bytes = statistics.median(s["qstore"]["bytes"] for s in clean[len(clean) // 2:])
    end_bytes = recovery[-1]["qstore"]["bytes"]
    bytes_ratio = end_bytes / clean_bytes
    rates = {p: {n: statistics.median(x for s in phase(p) if (x := s[n]["completed_per_s"]) is not None)
                 for n in ("qstore", "classic")} for p in ("clean", "pinned", "recovery")}
    return {
        "dead_end_of_pinned": {"qstore": dead_q, "classic": dead_c, "qstore_pct_of_classic": dead_pct,
                               "target": "<= 1 %", "result": "PASS" if dead_pct is not None and dead_pct <= 1 else "FAIL"},
        "qstore_bytes": {"clean_median": clean_bytes, "end_of_recovery": end_bytes, "ratio": bytes_ratio,
                         "target": "<= 1.10", "result": "PASS" if bytes_ratio <= 1.10 else "FAIL"},
        "median_completed_per_s": rates,
        "qstore_pinned_rate": {"value": rates["pinned"]["qstore"], "target": f">= {0.9 * rate:.0f}/s",
                               "result": "PASS" if rates["pinned"]["qstore"] >= 0.9 * rate else "FAIL"},
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result["samples"]
    t = [s["t"] for s in samples]
    fig, axes = plt.subplots(3, 1, figsize=(10, 10), sharex=True)
    for name, style in (("qstore", "-"), ("classic", "--")):
        axes[0].plot(t, [max(1, s[name]["dead"]) for s in samples], style, label=name)
        axes[1].plot(t, [s[name]["bytes"] / 2**20 for s in samples], style, label=name)
        axes[2].plot(t, [s[name]["completed_per_s"] or 0 for s in samples], style, label=name)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("dead tuples (n_dead_tup)")
    axes[1].set_ylabel("total bytes (MiB)")
    axes[2].set_ylabel("completed jobs/s")
    axes[2].set_xlabel("seconds")
    pinned = [s["t"] for s in samples if s["phase"] == "pinned"]
    for ax in axes:
        if pinned:
            ax.axvspan(min(pinned), max(pinned), color="orange", alpha=0.15,
                       label="horizon pinned" if ax is axes[0] else None)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper left")
    cfg = result["config"]
    fig.suptitle(f"steady soak: {cfg['rate']} jobs/s offered, {cfg['workers']} workers/system, "
                 f"batch {cfg['batch']}, maintenance every {cfg['rotate']} s")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=DEFAULT_URL)
    p.add_argument("--rate", type=float, default=1000.0, help="offered jobs/s per system")
    p.add_argument("--duration", type=float, default=600.0, help="seconds, split in three phases")
    p.add_argument("--workers", type=int, default=4, help="draining threads per system")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rotate", type=float, default=1.0, help="qstore maintenance interval (s)")
    p.add_argument("--sample", type=float, default=5.0)
    p.add_argument("--vacuum-interval", type=float, default=10.0,
                   help="VACUUM both systems this often when server autovacuum is off (0: never)")
    p.add_argument("--qstore-shards", type=int, default=1)
    p.add_argument("--qstore-schema", default="steady_qstore")
    p.add_argument("--classic-schema", default="steady_classic")
    p.add_argument("--json", type=Path, default=Path("docs/steady.json"))
    p.add_argument("--plot", type=Path, default=Path("docs/steady.png"))
    p.add_argument("--keep", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    result["command"] = " ".join(["python", "scripts/bench_steady.py", *(argv or sys.argv[1:])])
    args.json.parent.mkdir(parents=True, exist_ok=True)
    slim = dict(result, samples=[{k: v for k, v in s.items()} for s in result["samples"]])
    args.json.write_text(json.dumps(slim, indent=1, default=str) + "\n")
    try:
        plot(result, args.plot)
        print(f"wrote {args.plot}")
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[dev]'): no plot", file=sys.stderr)
    print(json.dumps(result["verdict"], indent=2))
    print("errors:", json.dumps(result["errors"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
