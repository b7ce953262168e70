"""Frozen DDL of revision 0010: every server function and view re-created from one whole SQL
text each.

Nothing changes in what the functions and views do: this revision re-creates all of them
from complete texts laid out to be read top to bottom (one ``*.sql`` file per function or
view, in the ``r0010`` folder next to this module, copies of the head's texts as they were
when it landed). From this revision on, a revision that changes a function or view keeps a
copy of each changed text in a folder of its own and renders it with :func:`render` below.

The texts are Mako templates (``${s}`` the schema, ``shape`` the install's slot counts,
``% for`` loops over ring slots); the constants they need are fixed here with the values
they had when the revision landed. The downgrade restores the function texts of the
revisions that last created each function before this one (0001, 0004, 0007, 0008, 0009). Never edited
after landing (see :mod:`qstore.migrations.frozen.r0001`).
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from mako.template import Template

from qstore.migrations.frozen import r0001, r0004, r0007, r0008, r0009
from qstore.migrations.frozen.r0001 import Shape

FUNCTIONS = ("backoff_duration", "ensure_lane", "reserve_lanes", "claim_ready", "complete_receipts",
             "enqueue_jobs")
RINGS = ("queue", "lease", "claim")
CONSTANTS = {"claim_wait": "200ms", "claimed_in_xact": "qstore.claimed_in_xact",
             "counter_buckets": 1, "default_shards": 8}


def render(folder: str, name: str, shape: Shape, **extra: Any) -> str:
    """Text ``<folder>/<name>.sql`` of this package rendered for ``shape`` with
    :data:`CONSTANTS` (``folder`` names the revision that holds the text, e.g. ``r0010``)."""
    text = resources.files(__package__).joinpath(folder).joinpath(f"{name}.sql").read_text(encoding="utf-8")
    template = Template(text=text, strict_undefined=True)
    return str(template.render(s=shape.schema, shape=shape, **CONSTANTS, **extra)).strip()


def _slots(shape: Shape, ring: str) -> int:
    return {"queue": shape.queue_slot_count, "lease": shape.lease_slot_count,
            "claim": shape.claim_slot_count}[ring]


def upgrade(shape: Shape) -> list[str]:
    return [*(render("r0010", name, shape) for name in FUNCTIONS),
            render("r0010", "terminal_jobs", shape),
            *(render("r0010", "ring_state", shape, ring=ring, slots=_slots(shape, ring)) for ring in RINGS)]


def downgrade(shape: Shape) -> list[str]:
    """The previous revisions' function texts. The views are left as they are: PostgreSQL
    keeps a view as its parsed query, and this revision's views parse to the same queries."""
    s = shape.schema
    backoff, _ensure_lane, reserve_lanes, _claim, _complete = r0001.function_statements(s)
    return [backoff, r0008.ensure_lane(s), reserve_lanes, r0009.claim_ready(shape),
            r0004.complete_receipts(shape), r0007.enqueue_jobs(shape)]
