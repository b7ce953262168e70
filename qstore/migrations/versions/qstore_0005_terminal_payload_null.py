"""Narrow done rows keep their payload NULL, so terminal history shows the job's metadata.

A narrow done row (a claimed attempt reaching a terminal state) leaves its body columns
NULL and hydrates them from its ready row; ``payload`` NULL means "the ready row's". Before
this revision the general terminal path (completion by id, completion of heartbeated or
materialised attempts, other outcomes that leave the payload unchanged) bound Python
``None`` as JSON ``null``, which is not NULL: ``coalesce`` stopped there and the job's
metadata and tags read back empty from ``load_job`` and ``terminal_jobs``. The code now
binds SQL NULL; this revision repairs the rows already written (narrow rows only: those
with NULL ``args``; a one-off UPDATE of short-lived history).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02
"""

from __future__ import annotations

from typing import Any

from alembic import op
from qstore.migrate import revision_shape, run_statements
from qstore.migrations.frozen import r0005

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade(**kw: Any) -> None:
    run_statements(op.get_bind(), r0005.upgrade(revision_shape(kw)))


def downgrade(**kw: Any) -> None:
    run_statements(op.get_bind(), r0005.downgrade(revision_shape(kw)))
