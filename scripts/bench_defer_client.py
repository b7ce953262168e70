"""Client and server CPU of one single-job enqueue on an ``Engine``, next to the same work
sent by hand.

Five ways of writing one job, each timed over ``--calls`` calls per round with
``time.process_time()`` (client CPU), ``time.perf_counter()`` (wall, for calls/s) and the CPU
the database's backends spent meanwhile (server CPU, from ``/proc``: the server must run on
this host; the other sessions sit idle while a case runs):

* ``defer``: a task's ``defer(engine, n=1)`` (the app's default telemetry);
* ``defer_kept``: the same inside ``with qstore.kept_connection(engine) as producing``
  (one connection kept for the whole loop; a tree without ``kept_connection`` skips it);
* ``enqueue``: ``QueueStorage.enqueue(engine, InsertParams(...))`` of the same job;
* ``raw``: the very SQL text and parameters ``enqueue`` sends (``<schema>.enqueue_job(...)``),
  executed on a held cursor of an autocommit psycopg connection: the least any client of that
  server function can spend;
* ``classic``: the hand-written psycopg queue's producer
  (``ClassicPsycopg(...).producer().enqueue(...)`` from ``classic_psycopg.py``: a prepared
  ``INSERT`` + ``pg_notify`` on an autocommit connection).

Each qstore tree under test runs in a process of its own (``--tree LABEL=DIR``: ``DIR`` holds
the ``qstore`` package to import; repeat it to compare trees, e.g. a checkout of ``main``
against a branch; default: the ``qstore`` this interpreter imports). This process installs
the schemas, then runs ``--rounds`` rounds; in each round every tree's process runs one block
of every case, the order of the trees and of the cases rotating from round to round, so a
change of the host's speed moves every figure alike. Reported: the median over the rounds
of CPU µs per call and of calls/s, and each case's calls/s over the classic producer's (the
median of the per-round ratios). The schemas are dropped at the end.

    python scripts/bench_defer_client.py --tree main=/tmp/qstore-main --tree branch=.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

HERE = Path(__file__).resolve().parent
CASES = ("defer", "defer_kept", "enqueue", "raw", "classic")
DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def _server_cpu(db: str) -> float | None:
    """CPU seconds so far of the backends of database ``db`` on this host (None when the
    server runs elsewhere)."""
    from _benchlib import database_backends_cpu

    backends = database_backends_cpu(db)
    return sum(backends.values()) if backends else None


def _time(fn: Callable[[], object], calls: int, db: str) -> tuple[float, float, float | None]:
    """(client CPU µs per call, calls/s by wall time, server CPU µs per call) of ``calls``
    calls of ``fn``. The server's figure is what every backend of ``db`` spent meanwhile:
    the others sit idle while ``fn`` runs."""
    s0 = _server_cpu(db)
    c0, w0 = time.process_time(), time.perf_counter()
    for _ in range(calls):
        fn()
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    s1 = _server_cpu(db)
    server = None if s0 is None or s1 is None else (s1 - s0) / calls * 1e6
    return cpu / calls * 1e6, calls / wall, server


def serve(url: str, schema: str, classic_schema: str, warm: int) -> None:
    """The child process: builds the cases on the ``qstore`` it imports (all of
    :data:`CASES` its ``qstore`` has), says which, then answers each ``<calls> <first case
    index>`` line on stdin with one JSON line of figures."""
    import psycopg
    from classic_psycopg import ClassicPsycopg
    from sqlalchemy import create_engine

    import qstore
    from qstore import InsertOpts, InsertParams, QueueStorage, QueueStorageConfig
    from qstore.storage import enqueue as enqueuing
    from qstore.storage.jobs import prepare_jobs
    from qstore.tasks import App, JobContext

    engine = create_engine(url, pool_size=2)
    storage = QueueStorage(QueueStorageConfig(schema=schema))
    app = App(storage)

    @app.task(kind="bench", queue="bench")
    def bench(ctx: JobContext, n: int) -> None: ...

    job = InsertParams("bench", {"n": 1}, InsertOpts(queue="bench"))
    # the statement and values exactly as ``enqueue`` sends them
    sql, params = enqueuing._enqueue_one_stmt(storage.tables).in_order(
        engine.dialect, enqueuing._VALUE_KEYS,
        enqueuing._one_values(storage.tables, prepare_jobs([job], 1, field="job")[0]))
    dsn = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    raw = psycopg.connect(dsn, autocommit=True)
    cur = raw.cursor()
    producer = ClassicPsycopg(url, classic_schema).producer()

    def defer() -> object:
        return bench.defer(engine, n=1)

    kept = getattr(qstore, "kept_connection", None)  # (absent from older trees)
    blocks = contextlib.ExitStack()
    producing: Any = blocks.enter_context(kept(engine)) if kept is not None else engine

    def defer_kept() -> object:
        return bench.defer(producing, n=1)

    def enqueue() -> object:
        return storage.enqueue(engine, job)

    def raw_sql() -> object:
        cur.execute(sql, params)
        return cur.fetchall()

    def classic() -> object:
        return producer.enqueue("bench", "bench", 2, {"n": 1})

    fns = {"defer": defer, "defer_kept": defer_kept, "enqueue": enqueue, "raw": raw_sql, "classic": classic}
    cases = [name for name in CASES if name != "defer_kept" or kept is not None]
    db = str(engine.url.database)
    for name in cases:
        _time(fns[name], warm, db)
    print(json.dumps({"qstore": qstore.__file__, "cases": cases}), flush=True)
    for line in sys.stdin:
        calls, first = (int(x) for x in line.split())
        order = cases[first % len(cases):] + cases[:first % len(cases)]
        out = {}
        for name in order:
            cpu, rate, server = _time(fns[name], calls, db)
            out[name] = {"cpu_us": cpu, "calls_per_s": rate, "server_cpu_us": server}
        print(json.dumps(out), flush=True)
    blocks.close()
    producer.close()
    raw.close()
    engine.dispose()


def _child(label: str, tree: Path | None, args: argparse.Namespace) -> subprocess.Popen[str]:
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(tree), str(HERE), env.get("PYTHONPATH", "")])
    return subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--serve", "--url", args.url, "--schema", args.schema,
         "--classic-schema", args.classic_schema, "--warm", str(args.warm)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=HERE)


def _reply(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out: IO[str] | None = proc.stdout
    assert out is not None
    line = out.readline()
    if not line:
        raise SystemExit(f"a benchmark process ended early (exit {proc.wait()})")
    reply: dict[str, Any] = json.loads(line)
    return reply


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=DEFAULT_URL)
    ap.add_argument("--schema", default="qstore_defer_client_bench")
    ap.add_argument("--classic-schema", default="bench_defer_client_classic")
    ap.add_argument("--tree", action="append", default=[], metavar="LABEL=DIR",
                    help="a qstore tree to measure (DIR holds the qstore package); repeatable")
    ap.add_argument("--calls", type=int, default=3000, help="calls of each case per round")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warm", type=int, default=300, help="calls of each case before the first round")
    ap.add_argument("--json", help="write the figures to this file")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    if args.serve:
        serve(args.url, args.schema, args.classic_schema, args.warm)
        return 0

    from _benchlib import ensure_database, format_table
    from classic_psycopg import ClassicPsycopg
    from sqlalchemy import create_engine

    from qstore import QueueStorage, QueueStorageConfig

    trees: list[tuple[str, Path | None]] = []
    for spec in args.tree:
        label, sep, path = spec.partition("=")
        if not sep or not (Path(path) / "qstore" / "__init__.py").is_file():
            raise SystemExit(f"--tree {spec!r}: expected LABEL=DIR with DIR/qstore/__init__.py")
        trees.append((label, Path(path).resolve()))
    if not trees:
        trees.append(("this", None))

    ensure_database(args.url)
    engine = create_engine(args.url)
    storage = QueueStorage(QueueStorageConfig(schema=args.schema))
    storage.reset(engine, force=True)
    storage.install(engine)
    classic = ClassicPsycopg(args.url, args.classic_schema)
    classic.create()
    procs: dict[str, subprocess.Popen[str]] = {}
    results: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in trees}
    cases: dict[str, list[str]] = {}
    try:
        for label, tree in trees:
            procs[label] = _child(label, tree, args)
            hello = _reply(procs[label])
            cases[label] = hello["cases"]
            print(f"{label}: {hello['qstore']}", file=sys.stderr)
        for r in range(args.rounds):
            order = trees[r % len(trees):] + trees[:r % len(trees)]
            for label, _ in order:
                proc = procs[label]
                assert proc.stdin is not None
                proc.stdin.write(f"{args.calls} {r % len(CASES)}\n")
                proc.stdin.flush()
                results[label].append(_reply(proc))
    finally:
        for proc in procs.values():
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(timeout=60)
        storage.reset(engine, force=True)  # drops the schema
        classic.drop()
        engine.dispose()

    figures: dict[str, Any] = {}
    rows = []
    for label, _ in trees:
        rounds = results[label]
        for name in cases[label]:
            cpu = statistics.median(x[name]["cpu_us"] for x in rounds)
            rate = statistics.median(x[name]["calls_per_s"] for x in rounds)
            vs_classic = statistics.median(x[name]["calls_per_s"] / x["classic"]["calls_per_s"] for x in rounds)
            cpu_vs_raw = statistics.median(x[name]["cpu_us"] - x["raw"]["cpu_us"] for x in rounds)
            servers = [x[name].get("server_cpu_us") for x in rounds]
            server = statistics.median(servers) if None not in servers else None
            figures.setdefault(label, {})[name] = {"cpu_us": round(cpu, 1), "calls_per_s": round(rate),
                                                   "vs_classic": round(vs_classic, 3),
                                                   "cpu_us_above_raw": round(cpu_vs_raw, 1),
                                                   "server_cpu_us": None if server is None else round(server, 1)}
            rows.append([label, name, f"{cpu:.1f}", f"{cpu_vs_raw:+.1f}",
                         "" if server is None else f"{server:.0f}", f"{rate:,.0f}", f"{vs_classic:.2f}x"])
    print(f"{args.rounds} rounds of {args.calls} calls per case (medians over the rounds):")
    print(format_table(["tree", "case", "client CPU µs/call", "client CPU µs over raw", "server CPU µs/call",
                        "calls/s", "rate ÷ classic"], rows))
    if len(trees) > 1:
        base = trees[0][0]
        for label, _ in trees[1:]:
            for name in ("defer", "enqueue"):
                saved = statistics.median(a[name]["cpu_us"] - b[name]["cpu_us"]
                                          for a, b in zip(results[base], results[label], strict=True))
                print(f"{name}: {label} spends {saved:.1f} µs CPU per call less than {base} (median of the rounds)")
    if args.json:
        Path(args.json).write_text(json.dumps({"figures": figures, "rounds": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
