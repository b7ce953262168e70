"""Frozen DDL of revision 0016: a claim leaves a lane once it has taken all the lane had.

``claim_ready`` reads a lane's enqueue position before it claims from it; when the claim
took a live row at every position up to that one, it leaves the lane instead of making one
more pass over it (a probe for the next position, in the ready child and, when that misses,
in every child) that could only find jobs enqueued since, which the next claim takes. At a
trickle, where each claim finds one job, that pass cost 4-16% of the claim's server time. Nothing else changes: the same lanes in the same order, the same rows, ranges and
receipts. The downgrade restores the text of revision 0010. The new text is in the
``r0016`` folder next to this module. Never edited after landing (see
:mod:`qstore.migrations.frozen.r0001`).
"""

from __future__ import annotations

from qstore.migrations.frozen import r0010
from qstore.migrations.frozen.r0001 import Shape


def upgrade(shape: Shape) -> list[str]:
    return [r0010.render("r0016", "claim_ready", shape)]


def downgrade(shape: Shape) -> list[str]:
    return [r0010.render("r0010", "claim_ready", shape)]
