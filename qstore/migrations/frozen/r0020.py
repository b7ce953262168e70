"""Frozen DDL of revision 0020: the completion fast path closes the attempts it completes
with batch closures.

The fast completion (``complete_receipts``) appended one ``lease_claim_closures`` row per
completed attempt, with its primary-key entry and the confirmation record of its
``ON CONFLICT``: about 230 bytes of WAL per job, the largest share of what a drained job
still wrote. It now appends one ``lease_claim_closure_batches`` row per call, claim slot
and block of ``CLOSURE_BLOCK`` (64) job ids, holding the members' job ids and run leases
as arrays in job-id order. The table is a claim-ring family (one child per claim slot,
truncated with the slot) indexed on its block and slot, so whether a receipt is closed is
found from its job id by one index probe.

Exactly once per attempt: the primary key of ``lease_claim_closures`` can no longer decide
alone, because a batch closure has no key per member. Every closer already locked the
receipt before closing it. The fast path now does that in one statement and, in a later
one (which sees every closure committed before the lock was granted), closes only the
receipts that no closure of either form names. The general path's closing statement,
which follows its own lock statement, checks the batch form as well. That later snapshot
exists only in READ COMMITTED, so the function raises SQLSTATE ``QS001`` in any other
isolation.

Rows written before this revision stay in ``lease_claim_closures``; readers read both.
Code from before this revision reads only the narrow form: it would count completed
attempts as running, and its rescue would find them open. Its workers and maintainers
must not run beside this revision (``docs/deploying.md``). The downgrade moves every
member back into a ``lease_claim_closures`` row (outcome ``completed``), drops the table
and restores the text of revision 0019. The new text is in the ``r0020`` folder next to
this module. Never edited after landing (see :mod:`qstore.migrations.frozen.r0001`).
"""

from __future__ import annotations

from qstore.migrations.frozen import r0010
from qstore.migrations.frozen.r0001 import Shape
from qstore.migrations.frozen.r0019 import DONE_BLOCK

#: Job ids per block of a batch closure.
CLOSURE_BLOCK = 64
#: SQLSTATE of ``complete_receipts`` outside READ COMMITTED.
ISOLATION_SQLSTATE = "QS001"


def upgrade(shape: Shape) -> list[str]:
    s = shape.schema
    out = [f"""CREATE TABLE {s}.lease_claim_closure_batches (
    claim_slot INTEGER NOT NULL,
    job_block BIGINT NOT NULL,
    job_ids BIGINT[] NOT NULL,
    run_leases BIGINT[] NOT NULL,
    closed_at TIMESTAMP WITH TIME ZONE DEFAULT clock_timestamp() NOT NULL
)
 PARTITION BY LIST (claim_slot)"""]
    out += [f"CREATE TABLE {s}.lease_claim_closure_batches_{k} PARTITION OF {s}.lease_claim_closure_batches "
            f"FOR VALUES IN ({k})" for k in range(shape.claim_slot_count)]
    out += [
        f"CREATE INDEX lease_claim_closure_batches_block_idx ON {s}.lease_claim_closure_batches "
        "(job_block, claim_slot)",
        r0010.render("r0020", "complete_receipts", shape, done_block=DONE_BLOCK, closure_block=CLOSURE_BLOCK,
                      isolation_sqlstate=ISOLATION_SQLSTATE),
    ]
    return out


def downgrade(shape: Shape) -> list[str]:
    s = shape.schema
    return [
        f"""INSERT INTO {s}.lease_claim_closures (claim_slot, job_id, run_lease, outcome, closed_at)
SELECT b.claim_slot, m.job_id, m.run_lease, 'completed', b.closed_at
FROM {s}.lease_claim_closure_batches b
CROSS JOIN LATERAL unnest(b.job_ids, b.run_leases) AS m(job_id, run_lease)
ORDER BY b.claim_slot, m.job_id, m.run_lease""",
        r0010.render("r0019", "complete_receipts", shape, done_block=DONE_BLOCK),
        f"DROP TABLE {s}.lease_claim_closure_batches",
    ]
