"""The server functions and views of the head revision, one complete SQL text each.

Every ``*.sql`` file in this package is the whole text of one function or view as the
latest revision installs it, readable top to bottom with its comments. The texts are Mako
templates: ``${s}`` is the install's schema (a validated identifier, the only name written
unquoted), ``shape`` its configuration (slot counts: claim and completion have one static
branch per ring child, written as a ``% for`` loop over the slots), and the constants of
:mod:`qstore.config` that the server shares with the runtime. Lines starting with ``##``
document the template and are not part of the rendered text.

A change to a text here ships as a new Alembic revision whose frozen module holds a copy of
the changed files (``tests/test_sql_texts.py`` checks that the last revision installs exactly
these texts).
"""

from __future__ import annotations

import functools
from importlib import resources
from typing import Any

from mako.template import Template

from qstore.config import (
    CLAIM_WAIT,
    CLAIMED_IN_XACT,
    CLOSURE_BLOCK,
    COUNTER_BUCKETS,
    DEFAULT_SHARDS,
    DONE_BLOCK,
    READY_SLOT_SEEN,
    WHEEL_BUCKET_SECONDS,
    WHEEL_GUARD_SLOTS,
    WHEEL_SLOTS,
    QueueStorageConfig,
)
from qstore.errors import ISOLATION_SQLSTATE

__all__ = ["FUNCTIONS", "RINGS", "VIEWS", "function_texts", "render", "view_texts"]

#: The head's functions, in the order an install creates them (a function another one
#: calls comes first).
FUNCTIONS = ("backoff_duration", "ensure_lane", "reserve_lanes", "claim_ready", "complete_receipts",
             "wheel_bucket", "enqueue_jobs", "enqueue_job", "unique_claim_renew")
#: The rings whose cursor views ``ring_state.sql`` renders.
RINGS = ("queue", "lease", "claim")
#: The head's views.
VIEWS = ("terminal_jobs", *(f"{ring}_ring_state" for ring in RINGS))


@functools.cache
def _template(name: str) -> Template:
    text = resources.files(__package__).joinpath(f"{name}.sql").read_text(encoding="utf-8")
    return Template(text=text, strict_undefined=True)


def render(name: str, cfg: QueueStorageConfig, **extra: Any) -> str:
    """The text of template ``name`` (``claim_ready``, ``ring_state``, ...) for an install
    of ``cfg``: one complete ``CREATE OR REPLACE`` statement, without trailing whitespace."""
    params = dict(s=cfg.schema, shape=cfg, claim_wait=CLAIM_WAIT, claimed_in_xact=CLAIMED_IN_XACT,
                  ready_slot_seen=READY_SLOT_SEEN, counter_buckets=COUNTER_BUCKETS, default_shards=DEFAULT_SHARDS,
                  done_block=DONE_BLOCK, closure_block=CLOSURE_BLOCK,
                  isolation_sqlstate=ISOLATION_SQLSTATE,
                  wheel_seconds=WHEEL_BUCKET_SECONDS, wheel_slots=WHEEL_SLOTS,
                  wheel_span=WHEEL_SLOTS - WHEEL_GUARD_SLOTS, **extra)
    return str(_template(name).render(**params)).strip()


def _ring_slots(cfg: QueueStorageConfig, ring: str) -> int:
    return {"queue": cfg.queue_slot_count, "lease": cfg.lease_slot_count,
            "claim": cfg.claim_slot_count}[ring]


def function_texts(cfg: QueueStorageConfig) -> tuple[str, ...]:
    """``CREATE OR REPLACE FUNCTION`` of every head function for ``cfg``, in :data:`FUNCTIONS` order."""
    return tuple(render(name, cfg) for name in FUNCTIONS)


def view_texts(cfg: QueueStorageConfig) -> tuple[str, ...]:
    """``CREATE OR REPLACE VIEW`` of every head view for ``cfg``, in :data:`VIEWS` order."""
    return (render("terminal_jobs", cfg),
            *(render("ring_state", cfg, ring=ring, slots=_ring_slots(cfg, ring)) for ring in RINGS))
