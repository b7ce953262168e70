"""qstore substrate: the three rings, control plane, functions and views.

Revision ID: 0001
Revises:
Create Date: 2026-12-02
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.schema import CreateSchema

from alembic import op
from qstore.migrate import drop_install, migration_config
from qstore.schema import storage_schema

revision = "0001"
down_revision = None
branch_labels = ("qstore",)
depends_on = None


def upgrade(**kw: Any) -> None:
    cfg = migration_config(kw)
    bind = op.get_bind()
    bind.execute(CreateSchema(cfg.schema, if_not_exists=True))
    storage_schema(cfg, as_of="0001").metadata.create_all(bind)


def downgrade(**kw: Any) -> None:
    cfg = migration_config(kw)
    drop_install(op.get_bind(), storage_schema(cfg, as_of="0001"))
