"""What every ``qstore`` subcommand shares: where the database is, the options every
subcommand takes, and how a refusal becomes one line.

A subcommand module exposes ``register(subparsers, common)``: it adds its parser(s) with
``parents=[common]`` (``--url``, ``--schema`` and the ring shape options) and sets
``func=cmd(args, out) -> exit status``. :func:`qstore.cli.main` prints any
:class:`~qstore.errors.QueueStorageError` a command raises as one line on stderr (exit 1).
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator
from typing import Any, TextIO

from sqlalchemy import Engine
from sqlalchemy import exc as sa_exc

from qstore import migrate
from qstore.config import DEFAULT_SCHEMA, QueueStorageConfig
from qstore.errors import DatabaseError, QueueStorageError

__all__ = ["URL_ENV", "CommandFailed", "common_parent", "database_url", "one_line"]

URL_ENV = "QSTORE_DATABASE_URL"


class CommandFailed(QueueStorageError):
    """A command-line refusal whose message is already the one line to print."""


def common_parent() -> argparse.ArgumentParser:
    """The options every subcommand takes (used as ``parents=[...]``)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", help=f"SQLAlchemy URL (default: ${URL_ENV})")
    common.add_argument("--schema", default=DEFAULT_SCHEMA,
                        help=f"storage schema (default: {DEFAULT_SCHEMA})")
    common.add_argument("--queue-slot-count", type=int, help="queue ring slots (custom schema)")
    common.add_argument("--lease-slot-count", type=int, help="lease ring slots (custom schema)")
    common.add_argument("--claim-slot-count", type=int, help="claim ring slots (custom schema)")
    return common


@contextlib.contextmanager
def database_url(url: str | None, out: TextIO) -> Iterator[str]:
    """``url``, else ``$QSTORE_DATABASE_URL``, else an embedded server for the duration."""
    given = url or os.environ.get(URL_ENV)
    if given:
        yield given
        return
    from qstore.demo import embedded_database

    print("No --url / QSTORE_DATABASE_URL: starting an embedded PostgreSQL server...", file=out)
    with embedded_database() as embedded:
        yield embedded


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
