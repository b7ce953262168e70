"""Frozen DDL of revision 0015: a single-job enqueue with scalar arguments.

Adds ``enqueue_job``, the whole enqueue of one job in one call, beside ``enqueue_jobs``
(unchanged): the same key, lane and ring rules, with scalar arguments instead of
thirteen one-element arrays and without the batch path's nested ``reserve_lanes`` call
(the lane's sequence is read from its head row, ``ensure_lane`` runs only for a new lane,
and the reservation lock is the same advisory lock). A previous release keeps calling
``enqueue_jobs``. The downgrade drops the function. Its text is in the ``r0015`` folder next
to this module. Never edited after landing (see :mod:`qstore.migrations.frozen.r0001`).
"""

from __future__ import annotations

from qstore.migrations.frozen import r0010, r0011
from qstore.migrations.frozen.r0001 import Shape

SIGNATURE = ("enqueue_job(text, text, text, jsonb, smallint, smallint, timestamp with time zone, bytea, "
             "text, jsonb, boolean, numeric, text)")


def upgrade(shape: Shape) -> list[str]:
    return [r0010.render("r0015", "enqueue_job", shape, **r0011.WHEEL)]


def downgrade(shape: Shape) -> list[str]:
    return [f"DROP FUNCTION {shape.schema}.{SIGNATURE}"]
