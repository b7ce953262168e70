"""Frozen DDL of revision 0017: a claim looks first where it last found a lane's rows.

``claim_ready`` looked a lane's position up first in the queue ring's current slot, and on
a miss in every slot at once (one index scan per slot, sixteen by default). A backlog
enqueued before the ring last turned lies in an older slot, so each claim from it paid that
look at every slot before it found the first row. The claim now keeps the slot it last
found a row in as a session setting (``qstore.ready_slot_seen.<schema>``) and looks there
first; the current slot is the first guess of a session that has none. A hint only: a miss
falls back to the look at every slot, as before. Nothing else changes: the same lanes in
the same order, the same rows, ranges and receipts. The downgrade restores the text of
revision 0016. The new text is in the ``r0017`` folder next to this module. Never edited
after landing (see :mod:`qstore.migrations.frozen.r0001`).
"""

from __future__ import annotations

from qstore.migrations.frozen import r0010
from qstore.migrations.frozen.r0001 import Shape

#: The session setting's name (suffixed ``.<schema>`` in the text).
READY_SLOT_SEEN = "qstore.ready_slot_seen"


def upgrade(shape: Shape) -> list[str]:
    return [r0010.render("r0017", "claim_ready", shape, ready_slot_seen=READY_SLOT_SEEN)]


def downgrade(shape: Shape) -> list[str]:
    return [r0010.render("r0016", "claim_ready", shape)]
