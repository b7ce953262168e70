"""Frozen DDL of revision 0018: ``terminal_jobs`` finds a job's rows by index.

The view joined every done row to its ready row with a ``LEFT JOIN``, so a filter on
``job_id`` could only be checked against the done rows themselves, and a narrow done row
(a claimed attempt's) has no ``job_id`` index entry: a lookup of one job scanned every
done row retained in the queue ring. The view is now a ``UNION ALL`` of its two kinds of
rows. Narrow rows are joined to their ready rows on the lane key and the job id, so a
filter on ``job_id`` reaches them through the ready rows' ``job_id`` index and the done
rows' primary key; wide rows are read alone, through their partial ``job_id`` index. The
same columns, the same rows: a narrow row always has its ready row (same lane key, same
ring slot, truncated together), and a wide row never has one. The downgrade restores the
text of revision 0010. The new text is in the ``r0018`` folder next to this module. Never
edited after landing (see :mod:`qstore.migrations.frozen.r0001`).
"""

from __future__ import annotations

from qstore.migrations.frozen import r0010
from qstore.migrations.frozen.r0001 import Shape


def upgrade(shape: Shape) -> list[str]:
    return [r0010.render("r0018", "terminal_jobs", shape)]


def downgrade(shape: Shape) -> list[str]:
    return [r0010.render("r0010", "terminal_jobs", shape)]
