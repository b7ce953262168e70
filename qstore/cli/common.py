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
import enum
import json
import os
import uuid
from collections.abc import Iterator, Sequence
from datetime import datetime
from typing import Any, TextIO

from sqlalchemy import Engine
from sqlalchemy import exc as sa_exc

from qstore import migrate
from qstore.config import DEFAULT_SCHEMA, QueueStorageConfig
from qstore.embedded import embedded_database
from qstore.errors import QueueStorageError
from qstore.storage import QueueStorage

__all__ = [
    "URL_ENV", "CommandFailed", "common_parent", "database_url", "human_bytes", "installed",
    "json_value", "one_line", "positive_int", "print_json", "table_lines",
]

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
    """``err`` as one line, whitespace collapsed. A :class:`~qstore.errors.QueueStorageError`
    is one line already (a ``DatabaseError`` names the operation, the reason and the
    SQLSTATE, and leaves SQL text, parameters and SQLAlchemy's background link out)."""
    return " ".join(str(err).split())


@contextlib.contextmanager
def installed(args: argparse.Namespace, command: str) -> Iterator[tuple[Engine, QueueStorage]]:
    """An engine on ``--url`` and the storage of the install in ``--schema`` (its recorded
    shape; a conflicting ``--*-slot-count`` is refused). A bad schema name, a bad URL, an
    unreachable server or a schema that is not installed is one line."""
    QueueStorageConfig(schema=args.schema)  # a bad --schema is named before anything connects
    engine = _engine(_url(args, command), pooled=True)
    try:
        storage = QueueStorage.from_existing_schema(args.schema, engine)
        migrate.resolve_shape(args.schema, storage.config, _explicit_shape(args))
        yield engine, storage
    finally:
        engine.dispose()


def positive_int(text_: str, what: str) -> int:
    """``text_`` as a positive integer that fits PostgreSQL ``bigint``, or a one-line
    refusal naming ``what`` (e.g. ``job id``) and the text given."""
    try:
        value = int(text_.strip(), 10)
    except ValueError:
        value = 0
    if not 0 < value < 2**63:
        raise CommandFailed(f"invalid {what} {text_!r}: expected a positive integer")
    return value


def json_value(value: Any) -> Any:
    """``value`` with what JSON cannot hold made plain: datetimes in ISO 8601, bytes in hex,
    UUIDs and enums as strings (containers recursively)."""
    if isinstance(value, dict):
        return {str(k): json_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_value(v) for v in value]
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, enum.Enum):
        return json_value(value.value)
    if isinstance(value, uuid.UUID):
        return str(value)
    return value


def print_json(value: Any, out: TextIO) -> None:
    """``value`` as indented JSON (see :func:`json_value`)."""
    print(json.dumps(json_value(value), indent=2), file=out)


def human_bytes(n: int) -> str:
    """``n`` bytes as ``512 B``, ``1.5 kB``, ``12.0 MB``... (powers of 1024)."""
    size = float(n)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if size < 1024 or unit == "TB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def _number_or_none(value: Any) -> bool:
    return value is None or (isinstance(value, int | float) and not isinstance(value, bool))


def table_lines(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """A fixed-width table: a header line and one line per row, columns two spaces apart;
    numbers right-aligned, anything else left-aligned; None shown as ``-``."""
    cells = [[("-" if v is None else str(v)) for v in row] for row in rows]
    numeric = [bool(rows) and all(_number_or_none(row[i]) for row in rows) for i in range(len(headers))]
    widths = [max([len(h), *(len(c[i]) for c in cells)]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w)
                         for v, w, num in zip(values, widths, numeric, strict=True)).rstrip()

    return [line(list(headers)), *(line(c) for c in cells)]
