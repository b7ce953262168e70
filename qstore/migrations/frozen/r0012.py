"""Frozen DDL of revision 0012: heartbeats and progress become append-only rows.

* ``attempt_progress`` (LIST-partitioned by ``ring_slot``) takes one row per heartbeat or
  progress report: the attempt, a number from the new sequence ``attempt_progress_seq``
  (the attempt's latest row has the greatest), when it was written, the heartbeat time and
  the progress. Its slots are those of the ring that holds the live attempts: the claim ring
  on an install with receipts (one child per claim slot, a row in its receipt's slot), the
  lease ring without (one child per lease slot, a row in its lease's slot). The ring's prune
  truncates a slot's rows with the slot.
* The upgrade moves what ``attempt_state`` holds of live attempts (``heartbeat_at``,
  ``progress``) into one row each and clears it there; a row left with no callback data is
  deleted. The downgrade moves each live attempt's latest row back (merged with what a
  previous release wrote to ``attempt_state`` meanwhile: the later heartbeat, that
  release's progress first) and drops the table and the sequence.

No server function or view changes. Never edited after landing (see
:mod:`qstore.migrations.frozen.r0001`).
"""

from __future__ import annotations

from qstore.migrations.frozen.r0001 import Shape

#: ``attempt_state``'s callback columns: a row with none of them set holds nothing once its
#: heartbeat and progress moved.
CALLBACK_COLUMNS = ("callback_filter", "callback_on_complete", "callback_on_fail", "callback_transform",
                    "callback_result")


def _slots(shape: Shape) -> int:
    return shape.claim_slot_count if shape.lease_claim_receipts else shape.lease_slot_count


def _live_slot(shape: Shape, alias: str) -> str:
    """A scalar subquery: the ring slot holding the live attempt ``alias.(job_id, run_lease)``
    (its open receipt's claim slot, or its lease's slot without receipts), NULL when the
    attempt is not live. ``alias`` must not be ``c``, ``cl`` or ``l`` (the subquery's own)."""
    s = shape.schema
    if shape.lease_claim_receipts:
        return f"""(SELECT c.claim_slot FROM {s}.lease_claims c
     WHERE c.job_id = {alias}.job_id AND c.run_lease = {alias}.run_lease
       AND NOT EXISTS (SELECT 1 FROM {s}.lease_claim_closures cl
                       WHERE cl.claim_slot = c.claim_slot AND cl.job_id = c.job_id
                         AND cl.run_lease = c.run_lease)
     ORDER BY c.claim_slot LIMIT 1)"""
    return f"""(SELECT l.lease_slot FROM {s}.leases l
     WHERE l.job_id = {alias}.job_id AND l.run_lease = {alias}.run_lease
     ORDER BY l.lease_slot LIMIT 1)"""


def upgrade(shape: Shape) -> list[str]:
    s = shape.schema
    out = [
        f"CREATE SEQUENCE {s}.attempt_progress_seq START WITH 1",
        f"""CREATE TABLE {s}.attempt_progress (
    ring_slot INTEGER NOT NULL,
    job_id BIGINT NOT NULL,
    run_lease BIGINT NOT NULL,
    seq BIGINT NOT NULL,
    written_at TIMESTAMP WITH TIME ZONE DEFAULT clock_timestamp() NOT NULL,
    heartbeat_at TIMESTAMP WITH TIME ZONE,
    progress JSONB,
    CONSTRAINT attempt_progress_pkey PRIMARY KEY (job_id, run_lease, seq, ring_slot)
)
 PARTITION BY LIST (ring_slot)""",
    ]
    out += [f"CREATE TABLE {s}.attempt_progress_{k} PARTITION OF {s}.attempt_progress FOR VALUES IN ({k})"
            for k in range(_slots(shape))]
    out += [
        f"""INSERT INTO {s}.attempt_progress (ring_slot, job_id, run_lease, seq, written_at, heartbeat_at, progress)
SELECT m.ring_slot, m.job_id, m.run_lease, nextval('{s}.attempt_progress_seq'::regclass), m.updated_at,
       m.heartbeat_at, m.progress
FROM (SELECT st.job_id, st.run_lease, st.updated_at, st.heartbeat_at, st.progress,
             {_live_slot(shape, "st")} AS ring_slot
      FROM {s}.attempt_state st
      WHERE st.heartbeat_at IS NOT NULL OR st.progress IS NOT NULL) m
WHERE m.ring_slot IS NOT NULL
ORDER BY m.job_id, m.run_lease""",
        f"""DELETE FROM {s}.attempt_state st
USING {s}.attempt_progress p
WHERE p.job_id = st.job_id AND p.run_lease = st.run_lease
  AND {" AND ".join(f"st.{c} IS NULL" for c in CALLBACK_COLUMNS)}""",
        f"""UPDATE {s}.attempt_state st SET heartbeat_at = NULL, progress = NULL
FROM {s}.attempt_progress p
WHERE p.job_id = st.job_id AND p.run_lease = st.run_lease""",
    ]
    return out


def downgrade(shape: Shape) -> list[str]:
    s = shape.schema
    return [
        f"""INSERT INTO {s}.attempt_state AS st (job_id, run_lease, heartbeat_at, progress, updated_at)
SELECT lt.job_id, lt.run_lease, lt.heartbeat_at, lt.progress, lt.written_at
FROM (SELECT DISTINCT ON (p.job_id, p.run_lease) p.ring_slot, p.job_id, p.run_lease, p.written_at,
             p.heartbeat_at, p.progress
      FROM {s}.attempt_progress p
      ORDER BY p.job_id, p.run_lease, p.seq DESC) lt
WHERE lt.ring_slot = {_live_slot(shape, "lt")}
ORDER BY lt.job_id, lt.run_lease
ON CONFLICT (job_id, run_lease) DO UPDATE
SET heartbeat_at = greatest(st.heartbeat_at, excluded.heartbeat_at),
    progress = coalesce(st.progress, excluded.progress),
    updated_at = greatest(st.updated_at, excluded.updated_at)""",
        f"DROP TABLE {s}.attempt_progress",
        f"DROP SEQUENCE {s}.attempt_progress_seq",
    ]
