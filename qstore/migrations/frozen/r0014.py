"""Frozen DDL of revision 0014: a done row's ``job_id`` index entry only for wide rows.

A completed attempt's done row is *narrow*: it leaves every body column NULL and shares the
lane key of its ready row, which lives and is pruned in the same queue slot, so it is found
by job id through the ready row's ``job_id`` index. Only *wide* rows (a body of their own,
``created_at`` set, no ready row) need an index on ``job_id``. The upgrade drops
``done_entries_job_id_idx`` and creates ``done_entries_wide_job_id_idx`` on ``job_id``
``WHERE created_at IS NOT NULL``, both on the partitioned parent (so every slot child
follows); the downgrade restores the full index.

Indexes only: no table, server function or view changes. Never edited after landing (see
:mod:`qstore.migrations.frozen.r0001`).
"""

from __future__ import annotations

from qstore.migrations.frozen.r0001 import Shape


def upgrade(shape: Shape) -> list[str]:
    s = shape.schema
    return [
        f"DROP INDEX {s}.done_entries_job_id_idx",
        f"CREATE INDEX done_entries_wide_job_id_idx ON {s}.done_entries (job_id) WHERE created_at IS NOT NULL",
    ]


def downgrade(shape: Shape) -> list[str]:
    s = shape.schema
    return [
        f"DROP INDEX {s}.done_entries_wide_job_id_idx",
        f"CREATE INDEX done_entries_job_id_idx ON {s}.done_entries (job_id)",
    ]
