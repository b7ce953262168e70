"""Frozen DDL of revision 0005: narrow done rows keep their payload SQL NULL.

Repairs the narrow done rows (``args`` NULL) that an earlier general terminal path wrote
with a JSON ``null`` payload. The downgrade has nothing to undo. Never edited after landing
(see :mod:`qstore.migrations.frozen.r0001`).
"""

from __future__ import annotations

from qstore.migrations.frozen.r0001 import Shape


def upgrade(shape: Shape) -> list[str]:
    s = shape.schema
    return [f"UPDATE {s}.done_entries SET payload = NULL "
            f"WHERE payload = 'null'::jsonb AND args IS NULL"]


def downgrade(shape: Shape) -> list[str]:
    return []
