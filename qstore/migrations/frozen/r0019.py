"""Frozen DDL of revision 0019: completed attempts of the completion fast path are written
as batch done rows.

The fast completion (``complete_receipts``) appended one narrow ``done_entries`` row per
completed attempt, with its primary-key entry: about 240 bytes of WAL per job, a third of
a drained job's. It now appends one ``done_batches`` row per call, claim slot, lane and
block of ``DONE_BLOCK`` (1024) lane positions that holds two or more of its attempts,
holding the members' positions, job ids, run leases, attempts and start times as arrays in
position order; the body stays on the ready rows. A lane and block that holds one attempt
still gets a narrow ``done_entries`` row, which costs less than a batch row of one.
``done_batches`` is a queue-ring family (one child per queue slot, truncated with the
slot) indexed on its lane and block, so a job's row is found from its ready row. Every
member is ``completed``, and no path locks, updates or deletes a completed done row, so
batch rows are append-only like the rest of the ring. ``terminal_jobs`` gains a third
branch for them. Rows written before this revision stay in ``done_entries``; readers read
both; code from before this revision does not, so its maintainers must not run beside it
(``docs/deploying.md``). The downgrade moves every member back into a narrow
``done_entries`` row, drops the table and restores the texts of revisions 0010
(``complete_receipts``) and 0018 (``terminal_jobs``). The new texts are in the ``r0019``
folder next to this module. Never edited after landing (see
:mod:`qstore.migrations.frozen.r0001`).
"""

from __future__ import annotations

from qstore.migrations.frozen import r0010
from qstore.migrations.frozen.r0001 import Shape

#: Lane positions per block of a batch done row.
DONE_BLOCK = 1024


def upgrade(shape: Shape) -> list[str]:
    s = shape.schema
    out = [f"""CREATE TABLE {s}.done_batches (
    ready_slot INTEGER NOT NULL,
    ready_generation BIGINT NOT NULL,
    queue TEXT NOT NULL,
    priority SMALLINT NOT NULL,
    enqueue_shard SMALLINT NOT NULL,
    lane_block BIGINT NOT NULL,
    lane_seqs BIGINT[] NOT NULL,
    job_ids BIGINT[] NOT NULL,
    run_leases BIGINT[] NOT NULL,
    attempts SMALLINT[] NOT NULL,
    attempted_ats TIMESTAMP WITH TIME ZONE[] NOT NULL,
    finalized_at TIMESTAMP WITH TIME ZONE DEFAULT clock_timestamp() NOT NULL
)
 PARTITION BY LIST (ready_slot)"""]
    out += [f"CREATE TABLE {s}.done_batches_{k} PARTITION OF {s}.done_batches FOR VALUES IN ({k})"
            for k in range(shape.queue_slot_count)]
    out += [
        f"CREATE INDEX done_batches_lane_idx ON {s}.done_batches (queue, priority, enqueue_shard, lane_block, ready_slot)",
        r0010.render("r0019", "complete_receipts", shape, done_block=DONE_BLOCK),
        r0010.render("r0019", "terminal_jobs", shape, done_block=DONE_BLOCK),
    ]
    return out


def downgrade(shape: Shape) -> list[str]:
    s = shape.schema
    return [
        f"""INSERT INTO {s}.done_entries
  (ready_slot, ready_generation, job_id, kind, queue, state, priority, attempt, run_lease,
   lane_seq, enqueue_shard, attempted_at, finalized_at)
SELECT b.ready_slot, b.ready_generation, m.job_id, r.kind, b.queue, 'completed', b.priority,
       m.attempt, m.run_lease, m.lane_seq, b.enqueue_shard, m.attempted_at, b.finalized_at
FROM {s}.done_batches b
CROSS JOIN LATERAL unnest(b.lane_seqs, b.job_ids, b.run_leases, b.attempts, b.attempted_ats)
     AS m(lane_seq, job_id, run_lease, attempt, attempted_at)
JOIN {s}.ready_entries r
  ON r.ready_slot = b.ready_slot AND r.ready_generation = b.ready_generation
 AND r.queue = b.queue AND r.priority = b.priority AND r.enqueue_shard = b.enqueue_shard
 AND r.lane_seq = m.lane_seq AND r.job_id = m.job_id
ORDER BY b.ready_slot, b.queue, b.priority, b.enqueue_shard, m.lane_seq""",
        r0010.render("r0018", "terminal_jobs", shape),
        r0010.render("r0010", "complete_receipts", shape),
        f"DROP TABLE {s}.done_batches",
    ]
