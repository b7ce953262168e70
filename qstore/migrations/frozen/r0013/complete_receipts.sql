## complete_receipts: the completion fast path, one round trip for a batch of plain
## receipt-only attempts.
##
## Locks each receipt by primary key in its claim child, appends a closure (ON CONFLICT DO
## NOTHING: whoever closes an attempt first wins), a narrow done row built from the receipt
## and the job kind the worker carries from its claim (the ready row is not re-read) and
## grouped terminal-count deltas. Returns the attempts it completed. An attempt that
## heartbeated or reported progress (a row in attempt_progress, in its receipt's claim slot)
## or whose receipt was materialised (a callback; a previous release's heartbeat) is left to
## the general path; an unknown slot matches nothing (stale). Two statements per claim slot
## present in the input, each naming its child (see claim_ready.sql for why): the first
## locks the receipts, so the second, with a snapshot taken after the locks were granted,
## sees every progress row a heartbeat appended under the same lock before it committed.
## The progress probe is rendered only for an install with receipts (without, progress rows
## follow the lease ring and no receipt is ever written).
##
## Template parameters: s (schema), shape (slot counts, receipt mode), counter_buckets.
CREATE OR REPLACE FUNCTION ${s}.complete_receipts(p_claim_slots integer[], p_job_ids bigint[], p_run_leases bigint[], p_kinds text[]) RETURNS TABLE(job_id bigint, run_lease bigint) LANGUAGE plpgsql VOLATILE
SET jit = off SET plan_cache_mode = force_generic_plan AS $$
DECLARE
  v_slot integer;
BEGIN
  FOREACH v_slot IN ARRAY ARRAY(SELECT DISTINCT x FROM unnest(p_claim_slots) x ORDER BY 1) LOOP
% for k in range(shape.claim_slot_count):
    ${'IF' if loop.first else 'ELSIF'} v_slot = ${k} THEN
      PERFORM 1
      FROM (SELECT DISTINCT i.job_id, i.run_lease
            FROM unnest(p_claim_slots, p_job_ids, p_run_leases) AS i(claim_slot, job_id, run_lease)
            WHERE i.claim_slot = v_slot
            ORDER BY i.job_id, i.run_lease) i
      CROSS JOIN LATERAL (
        SELECT 1 FROM ${s}.lease_claims_${k} c
        WHERE c.job_id = i.job_id AND c.run_lease = i.run_lease
        FOR UPDATE) c;
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
        JOIN ${s}.lease_claims_${k} c ON c.job_id = i.job_id AND c.run_lease = i.run_lease
        WHERE c.materialized_at IS NULL
% if shape.lease_claim_receipts:
          AND NOT EXISTS (SELECT 1 FROM ${s}.attempt_progress_${k} p
                          WHERE p.job_id = c.job_id AND p.run_lease = c.run_lease)
% endif
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
