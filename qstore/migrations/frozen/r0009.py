"""Frozen DDL of revision 0009: a claim that has followed a lane's chain to its end no longer
looks through every queue-ring child when the lane has no position left to find.

When the row at the next position is not in the child the chain was last seen in,
``claim_ready`` looked for the lane's first row at or after that position in the whole
``ready_entries`` partition tree. That lookup opens (and share-locks) every child of the
ring, so it was the costliest step of a claim and the one that queued behind a prune's
exclusive lock. Positions are handed out by the lane's enqueue sequence, so when the
sequence has not reached the position no row at or after it can exist, committed or not:
the lookup is skipped and the claim goes on as if it had found nothing (the cursor hint
moves on exactly as before). The rest of the body is revision 0006's, unchanged; the
downgrade restores revision 0006's statement. Never edited after landing (see
:mod:`qstore.migrations.frozen.r0001`).
"""

from __future__ import annotations

from qstore.migrations.frozen import r0006
from qstore.migrations.frozen.r0001 import Shape

_WHOLE_RING_LOOKUP = """        IF NOT v_found THEN
          SELECT r.ready_slot, r.ready_generation, r.lane_seq"""
_ONLY_WHEN_REACHED = """        IF NOT v_found AND coalesce(pg_sequence_last_value(v_enq_seq), 0) >= v_pos THEN
          SELECT r.ready_slot, r.ready_generation, r.lane_seq"""


def claim_ready(shape: Shape) -> str:
    """``claim_ready`` as this revision installs it (also the head declaration's)."""
    statement = r0006.claim_ready(shape)
    assert statement.count(_WHOLE_RING_LOOKUP) == 1, "revision 0006's claim_ready lookup changed"
    return statement.replace(_WHOLE_RING_LOOKUP, _ONLY_WHEN_REACHED)


def upgrade(shape: Shape) -> list[str]:
    return [claim_ready(shape)]


def downgrade(shape: Shape) -> list[str]:
    return [r0006.claim_ready(shape)]
