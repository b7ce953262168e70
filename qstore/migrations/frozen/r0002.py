"""Frozen DDL of revision 0002: the per-queue DLQ policy column ``queue_meta.dlq_enabled``.

Never edited after landing (see :mod:`qstore.migrations.frozen.r0001`).
"""

from __future__ import annotations

from qstore.migrations.frozen.r0001 import Shape


def upgrade(shape: Shape) -> list[str]:
    return [f"ALTER TABLE {shape.schema}.queue_meta ADD COLUMN dlq_enabled BOOLEAN DEFAULT false NOT NULL"]


def downgrade(shape: Shape) -> list[str]:
    return [f"ALTER TABLE {shape.schema}.queue_meta DROP COLUMN dlq_enabled"]
