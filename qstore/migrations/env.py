"""Packaged Alembic environment: see :func:`qstore.migrate.run_env`."""

from qstore.migrate import run_env

run_env()
