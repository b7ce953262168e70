"""``qstore maintain``: run an install's upkeep (:mod:`qstore.runtime.maintainer`) until
interrupted, or every task once with ``--once`` (exit 1 if one failed). A schema that
disappears while it runs stops it with one line (exit 1)."""

from __future__ import annotations

import argparse
import signal
import threading
from collections.abc import Sequence
from typing import Any, TextIO

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from qstore import migrate
from qstore.cli.common import _engine, _explicit_shape, _url
from qstore.config import QueueStorageConfig
from qstore.errors import SchemaNotInstalledError
from qstore.runtime.maintainer import Maintainer, TaskReport
from qstore.storage import QueueStorage

__all__ = ["cmd_maintain", "register"]

#: How often a running ``qstore maintain`` checks that its install still exists (seconds).
INSTALL_CHECK_EVERY = 2.0


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
        try:
            while not stop.wait(INSTALL_CHECK_EVERY):
                _check_installed(engine, storage.schema())
        finally:
            maintainer.stop()
        return 0
    finally:
        engine.dispose()


def _check_installed(engine: Engine, schema: str) -> None:
    """Raise :class:`SchemaNotInstalledError` once ``schema`` is no longer installed (a
    database error here is left to the maintainer's own retries)."""
    try:
        with engine.connect() as conn:
            if migrate.read_recorded_config(conn, schema) is not None:
                return
            found = migrate.found_installs(conn)
    except SQLAlchemyError:
        return
    raise SchemaNotInstalledError(schema, found)


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add ``qstore maintain`` to the subcommands."""
    maintain = sub.add_parser("maintain", parents=[common],
                              help="run the install's upkeep (rings, promotion, rescue, rollup); "
                                   "one leader per install")
    maintain.add_argument("--once", action="store_true",
                          help="run every task once, print what each did and exit (1 if one failed)")
    maintain.set_defaults(func=cmd_maintain)
