## complete_receipts: the completion fast path, one round trip for a batch of plain
## receipt-only attempts.
##
## Locks each receipt by primary key in its claim child, appends a closure (ON CONFLICT DO
## NOTHING: whoever closes an attempt first wins), a narrow done row built from the receipt
## and the job kind the worker carries from its claim (the ready row is not re-read) and
## grouped terminal-count deltas. Returns the attempts it completed. A receipt that was
## materialised (by a callback, or by a heartbeat of a worker older than revision 0013) is
## left to the general path; an unknown slot matches nothing (stale). One statement per claim slot present in the input, each naming its
## child (see claim_ready.sql for why).
##
## Template parameters: s (schema), shape (slot counts), counter_buckets.
CREATE OR REPLACE FUNCTION ${s}.complete_receipts(p_claim_slots integer[], p_job_ids bigint[], p_run_leases bigint[], p_kinds text[]) RETURNS TABLE(job_id bigint, run_lease bigint) LANGUAGE plpgsql VOLATILE
SET jit = off SET plan_cache_mode = force_generic_plan AS $$
DECLARE
  v_slot integer;
BEGIN
  FOREACH v_slot IN ARRAY ARRAY(SELECT DISTINCT x FROM unnest(p_claim_slots) x ORDER BY 1) LOOP
% for k in range(shape.claim_slot_count):
    ${'IF' if loop.first else 'ELSIF'} v_slot = ${k} THEN
      RETURN QUERY
      WITH input AS (
        SELECT DISTINCT ON (i.job_id, i.run_lease, i.claim_slot)
               i.claim_slot, i.job_id, i.run_lease, i.kind
        FROM unnest(p_claim_slots, p_job_ids, p_run_leases, p_kinds)
             AS i(claim_slot, job_id, run_lease, kind)
        WHERE i.claim_slot = v_slot
        ORDER BY i.job_id, i.run_lease, i.claim_slot
      ), locked AS (
        SELECT c.*, i.kind
        FROM input i
        CROSS JOIN LATERAL (
          SELECT c.* FROM ${s}.lease_claims_${k} c
          WHERE c.job_id = i.job_id AND c.run_lease = i.run_lease
            AND c.materialized_at IS NULL
          FOR UPDATE) c
      ), closed AS (
        INSERT INTO ${s}.lease_claim_closures_${k} AS cl (claim_slot, job_id, run_lease, outcome)
        SELECT l.claim_slot, l.job_id, l.run_lease, 'completed' FROM locked l
        ON CONFLICT DO NOTHING
        RETURNING cl.claim_slot, cl.job_id, cl.run_lease
      ), done AS (
        INSERT INTO ${s}.done_entries AS d
          (ready_slot, ready_generation, job_id, kind, queue, state, priority, attempt, run_lease,
           lane_seq, enqueue_shard, attempted_at, finalized_at)
        SELECT l.ready_slot, l.ready_generation, l.job_id, l.kind, l.queue, 'completed',
               l.priority, l.attempt, l.run_lease, l.lane_seq, l.enqueue_shard, l.claimed_at,
               clock_timestamp()
        FROM locked l
        JOIN closed c ON c.claim_slot = l.claim_slot AND c.job_id = l.job_id
                     AND c.run_lease = l.run_lease
        RETURNING d.ready_slot, d.ready_generation, d.queue, d.priority, d.enqueue_shard, d.job_id
      ), deltas AS (
        INSERT INTO ${s}.queue_terminal_count_deltas
          (ready_slot, ready_generation, queue, priority, enqueue_shard, counter_bucket,
           terminal_delta)
        SELECT d.ready_slot, d.ready_generation, d.queue, d.priority, d.enqueue_shard,
               (d.job_id % ${counter_buckets})::smallint, count(*)
        FROM done d
        GROUP BY 1, 2, 3, 4, 5, 6
        ORDER BY 1, 2, 3, 4, 5, 6
      )
      SELECT c.job_id, c.run_lease FROM closed c;
% endfor
    END IF;
  END LOOP;
END
$$
