## complete_receipts: the completion fast path, one round trip for a batch of plain
## receipt-only attempts.
##
## Per claim slot present in the input, two statements. The first locks each receipt by
## primary key in its claim child. The second, which therefore sees every closure committed
## before the locks were granted (each statement of a volatile function takes a new
## snapshot), keeps the receipts that no closure of either form names yet (whoever closes
## an attempt first wins: every closer locks the receipt before it checks) and appends for
## them one batch closure per block of CLOSURE_BLOCK job ids that holds two or more of them
## (lease_claim_closure_batches: the members' job ids and run leases as arrays in job-id
## order) or a narrow closure for a block that holds one, one batch done row per
## lane and block of lane positions that holds two or more of them (done_batches: the
## members' positions, job ids, run leases, attempts and start times as arrays in position
## order; their body stays on the ready rows) or a narrow done row for a lane and block
## that holds one (cheaper than a batch row of one member), and grouped terminal-count
## deltas. Returns the attempts it completed. A receipt that was materialised (by a
## callback, or by a heartbeat of a worker older than revision 0013) is left to the general
## path; an unknown slot matches nothing (stale). Each statement names its child (see
## claim_ready.sql for why). p_kinds (the kind each worker got from its claim) goes into
## the narrow rows.
##
## Only in READ COMMITTED: in REPEATABLE READ or SERIALIZABLE every statement would read
## the transaction's first snapshot, and a closure committed while the lock was awaited
## would go unseen; the function raises isolation_sqlstate there, before it locks anything.
##
## Template parameters: s (schema), shape (slot counts), counter_buckets, done_block,
## closure_block, isolation_sqlstate.
CREATE OR REPLACE FUNCTION ${s}.complete_receipts(p_claim_slots integer[], p_job_ids bigint[], p_run_leases bigint[], p_kinds text[]) RETURNS TABLE(job_id bigint, run_lease bigint) LANGUAGE plpgsql VOLATILE
SET jit = off SET plan_cache_mode = force_generic_plan AS $$
DECLARE
  v_slot integer;
  v_jobs bigint[];
  v_leases bigint[];
  v_kinds text[];
BEGIN
  -- the check after the locks needs a fresh snapshot per statement (see above)
  IF current_setting('transaction_isolation') <> 'read committed' THEN
    RAISE EXCEPTION USING ERRCODE = '${isolation_sqlstate}',
      MESSAGE = 'qstore ends attempts only in READ COMMITTED transactions; this one is '
                || current_setting('transaction_isolation');
  END IF;
  FOREACH v_slot IN ARRAY ARRAY(SELECT DISTINCT x FROM unnest(p_claim_slots) x ORDER BY 1) LOOP
% for k in range(shape.claim_slot_count):
    ${'IF' if loop.first else 'ELSIF'} v_slot = ${k} THEN
      SELECT array_agg(c.job_id), array_agg(c.run_lease), array_agg(i.kind)
        INTO v_jobs, v_leases, v_kinds
      FROM (
        SELECT DISTINCT ON (i.job_id, i.run_lease, i.claim_slot)
               i.claim_slot, i.job_id, i.run_lease, i.kind
        FROM unnest(p_claim_slots, p_job_ids, p_run_leases, p_kinds)
             AS i(claim_slot, job_id, run_lease, kind)
        WHERE i.claim_slot = v_slot
        ORDER BY i.job_id, i.run_lease, i.claim_slot
      ) i
      CROSS JOIN LATERAL (
        SELECT c.job_id, c.run_lease FROM ${s}.lease_claims_${k} c
        WHERE c.job_id = i.job_id AND c.run_lease = i.run_lease
          AND c.materialized_at IS NULL
        FOR UPDATE) c;
      CONTINUE WHEN v_jobs IS NULL;
      RETURN QUERY
      -- Each lookup is a subquery that PostgreSQL can neither flatten into a join (LIMIT,
      -- OFFSET 0) nor therefore turn into a hash join over a whole child: the plan is
      -- generic and made once per session, when the children may still look empty.
      WITH ended AS (
        SELECT c.*, l.kind
        FROM unnest(v_jobs, v_leases, v_kinds) AS l(job_id, run_lease, kind)
        CROSS JOIN LATERAL (
          SELECT c.* FROM ${s}.lease_claims_${k} c
          WHERE c.job_id = l.job_id AND c.run_lease = l.run_lease
            AND NOT EXISTS (
                  SELECT 1 FROM ${s}.lease_claim_closures_${k} cl
                  WHERE cl.job_id = c.job_id AND cl.run_lease = c.run_lease OFFSET 0)
            AND NOT EXISTS (
                  SELECT 1 FROM ${s}.lease_claim_closure_batches_${k} cb
                  WHERE cb.job_block = c.job_id / ${closure_block} AND c.job_id = ANY (cb.job_ids)
                    AND EXISTS (SELECT 1 FROM unnest(cb.job_ids, cb.run_leases) AS m(job_id, run_lease)
                                WHERE m.job_id = c.job_id AND m.run_lease = c.run_lease)
                  OFFSET 0)
          LIMIT 1) c
      ), closers AS (
        SELECT e.job_id / ${closure_block} AS job_block, count(*) AS n,
               array_agg(e.job_id ORDER BY e.job_id, e.run_lease) AS job_ids,
               array_agg(e.run_lease ORDER BY e.job_id, e.run_lease) AS run_leases
        FROM ended e
        GROUP BY 1
      ), closed AS (
        INSERT INTO ${s}.lease_claim_closure_batches_${k} (claim_slot, job_block, job_ids, run_leases)
        SELECT ${k}, g.job_block, g.job_ids, g.run_leases FROM closers g WHERE g.n > 1
      ), closed_single AS (
        -- a block of one: a narrow closure, so a block's batch rows stay few where
        -- completions come one at a time (a lookup reads every batch row of its block)
        INSERT INTO ${s}.lease_claim_closures_${k} (claim_slot, job_id, run_lease, outcome)
        SELECT ${k}, g.job_ids[1], g.run_leases[1], 'completed' FROM closers g WHERE g.n = 1
      ), grouped AS (
        SELECT e.ready_slot, e.ready_generation, e.queue, e.priority, e.enqueue_shard,
               e.lane_seq / ${done_block} AS lane_block, count(*) AS n,
               array_agg(e.lane_seq ORDER BY e.lane_seq) AS lane_seqs,
               array_agg(e.job_id ORDER BY e.lane_seq) AS job_ids,
               array_agg(e.run_lease ORDER BY e.lane_seq) AS run_leases,
               array_agg(e.attempt ORDER BY e.lane_seq) AS attempts,
               array_agg(e.claimed_at ORDER BY e.lane_seq) AS attempted_ats,
               min(e.kind) AS kind, clock_timestamp() AS finalized_at
        FROM ended e
        GROUP BY 1, 2, 3, 4, 5, 6
      ), batched AS (
        INSERT INTO ${s}.done_batches
          (ready_slot, ready_generation, queue, priority, enqueue_shard, lane_block, lane_seqs,
           job_ids, run_leases, attempts, attempted_ats, finalized_at)
        SELECT g.ready_slot, g.ready_generation, g.queue, g.priority, g.enqueue_shard,
               g.lane_block, g.lane_seqs, g.job_ids, g.run_leases, g.attempts, g.attempted_ats,
               g.finalized_at
        FROM grouped g WHERE g.n > 1
      ), single AS (
        -- a group of one: a narrow done row costs less than a batch row of one member
        INSERT INTO ${s}.done_entries
          (ready_slot, ready_generation, job_id, kind, queue, state, priority, attempt, run_lease,
           lane_seq, enqueue_shard, attempted_at, finalized_at)
        SELECT g.ready_slot, g.ready_generation, g.job_ids[1], g.kind, g.queue, 'completed',
               g.priority, g.attempts[1], g.run_leases[1], g.lane_seqs[1], g.enqueue_shard,
               g.attempted_ats[1], g.finalized_at
        FROM grouped g WHERE g.n = 1
      ), deltas AS (
        INSERT INTO ${s}.queue_terminal_count_deltas
          (ready_slot, ready_generation, queue, priority, enqueue_shard, counter_bucket,
           terminal_delta)
        SELECT e.ready_slot, e.ready_generation, e.queue, e.priority, e.enqueue_shard,
               (e.job_id % ${counter_buckets})::smallint, count(*)
        FROM ended e
        GROUP BY 1, 2, 3, 4, 5, 6
        ORDER BY 1, 2, 3, 4, 5, 6
      )
      SELECT e.job_id, e.run_lease FROM ended e;
% endfor
    END IF;
  END LOOP;
END
$$
