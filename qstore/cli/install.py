"""``qstore install``: install or upgrade a schema and activate it.

``--grant ROLE`` also gives a runtime role its privileges (:mod:`qstore.schema.grants`) in the same
transaction; ``--print-grants ROLE`` only prints them. The install's shape is read back from
the database: the recorded shape wins, and a ``--*-slot-count`` that conflicts with it is
refused naming both values.
"""

from __future__ import annotations

import argparse
from typing import Any, TextIO

from sqlalchemy import Connection

from qstore import migrate
from qstore.cli.common import _engine, _explicit_shape, _url
from qstore.config import QueueStorageConfig
from qstore.errors import translate_errors
from qstore.schema import grants
from qstore.storage import QueueStorage
from qstore.storage.targets import Policy, run

__all__ = ["cmd_install", "register"]


@translate_errors
def cmd_install(args: argparse.Namespace, out: TextIO) -> int:
    QueueStorageConfig(schema=args.schema)  # a bad --schema is named before anything connects
    engine = _engine(_url(args, "install"))

    def install(conn: Connection) -> tuple[QueueStorage, bool, list[str]] | None:
        """The install, in one transaction; None when the grants were only printed."""
        migrate.lock_install(conn, args.schema)
        state = migrate.install_state(conn, args.schema)
        config = migrate.resolve_shape(args.schema, state.config, _explicit_shape(args))
        if args.print_grants is not None:
            own = state.version is None or not state.version.host
            for statement in grants.runtime_grants(config, args.print_grants, version_table=own):
                print(f"{statement};", file=out)
            return None
        storage = QueueStorage(config)
        ran = storage.prepare_schema(conn)
        storage.activate_backend(conn)
        granted = grants.apply_runtime_grants(conn, config, args.grant) if args.grant else []
        return storage, ran, granted

    try:
        done = run(Policy.JOIN, engine, install, "qstore install")
    finally:
        engine.dispose()
    if done is None:
        return 0
    storage, ran, granted = done
    what = "installed/upgraded" if ran else "already at head"
    print(f"qstore schema {storage.schema()!r} {what} and active", file=out)
    if granted:
        print(f"granted the runtime privileges on {storage.schema()!r} to {args.grant!r} "
              f"({len(granted)} statements)", file=out)
    return 0


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add ``qstore install`` to the subcommands."""
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
