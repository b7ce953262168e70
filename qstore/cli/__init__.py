"""Command line: ``python -m qstore install | maintain | worker | status | job | dlq | demo``.

Each subcommand lives in its own module exposing ``register(subparsers, common)``
(:data:`SUBCOMMANDS`); :mod:`qstore.cli.common` holds what they share. ``install`` installs
or upgrades a schema and activates it (:mod:`qstore.cli.install`); ``maintain`` runs an
install's upkeep (:mod:`qstore.cli.maintain`); ``worker`` runs an application's tasks
(:mod:`qstore.cli.worker`); ``status`` reports queues, rings and table
health (:mod:`qstore.cli.status`); ``job`` shows, retries or cancels one job
(:mod:`qstore.cli.job`); ``dlq`` lists, retries or purges dead-lettered jobs
(:mod:`qstore.cli.dlq`); ``demo`` runs the demo steps (:mod:`qstore.cli.demo`). Every refusal
is one line on stderr (exit status 1), never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import TextIO

from qstore.cli import demo
from qstore.cli import dlq as cli_dlq
from qstore.cli import install as cli_install
from qstore.cli import job as cli_job
from qstore.cli import maintain as cli_maintain
from qstore.cli import status as cli_status
from qstore.cli import worker as cli_worker
from qstore.cli.common import (
    URL_ENV,
    CommandFailed,
    _config,
    _engine,
    _explicit_shape,
    _url,
    common_parent,
    database_url,
    one_line,
)
from qstore.cli.demo import (
    DEMO_QUEUE,
    DEMO_STEPS,
    DemoContext,
    DemoStep,
    embedded_database,
    run_demo,
    step_install,
    step_job_lifecycle,
    step_maintenance,
    step_show_rings,
    step_show_tables,
)
from qstore.errors import QueueStorageError

__all__ = [
    "DEMO_QUEUE", "DEMO_STEPS", "SUBCOMMANDS", "URL_ENV", "CommandFailed", "DemoContext",
    "DemoStep", "_config", "_engine", "_explicit_shape", "_url", "build_parser",
    "database_url", "embedded_database", "main", "one_line", "run_demo", "step_install",
    "step_job_lifecycle", "step_maintenance", "step_show_rings", "step_show_tables",
]

#: The modules whose ``register(subparsers, common)`` adds a subcommand, in help order.
SUBCOMMANDS: tuple[ModuleType, ...] = (
    demo, cli_install, cli_maintain, cli_worker, cli_status, cli_job, cli_dlq)


def build_parser() -> argparse.ArgumentParser:
    """The ``qstore`` parser with every module in :data:`SUBCOMMANDS` registered."""
    common = common_parent()
    parser = argparse.ArgumentParser(prog="qstore", description=(__doc__ or "").splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for module in SUBCOMMANDS:
        module.register(sub, common)
    return parser


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Run one subcommand; its exit status, or 1 with one line on stderr for a refusal."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args, out or sys.stdout))
    except QueueStorageError as err:
        print(f"qstore: {one_line(err)}", file=sys.stderr)
        return 1
