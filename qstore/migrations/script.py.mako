"""${message}

Revision ID: ${up_revision}
Revises: ${down_revision | comma,n}
Create Date: ${create_date}
"""

from __future__ import annotations

from typing import Any

from alembic import op
import sqlalchemy as sa
${imports if imports else ""}

from qstore.migrate import migration_config

revision = ${repr(up_revision)}
down_revision = ${repr(down_revision)}
branch_labels = ${repr(branch_labels)}
depends_on = ${repr(depends_on)}


def upgrade(**kw: Any) -> None:
    cfg = migration_config(kw)
    ${upgrades if upgrades else "pass"}


def downgrade(**kw: Any) -> None:
    cfg = migration_config(kw)
    ${downgrades if downgrades else "pass"}
