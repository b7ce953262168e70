"""Frozen DDL of revision 0003: claim queues on a busy lane; completion takes the job kind
from the worker's claim snapshot.

Never edited after landing (see :mod:`qstore.migrations.frozen.r0001`).
"""

from __future__ import annotations

from qstore.migrations.frozen import r0001
from qstore.migrations.frozen.r0001 import Shape

COMPLETE_0001 = ("complete_receipts(p_claim_slots integer[], p_job_ids bigint[], "
                 "p_run_leases bigint[])")
COMPLETE_0003 = ("complete_receipts(p_claim_slots integer[], p_job_ids bigint[], "
                 "p_run_leases bigint[], p_kinds text[])")


def claim_ready(s: str) -> str:
    """``CREATE OR REPLACE FUNCTION <s>.claim_ready`` as revision 0003 installed it."""
    return f"""CREATE OR REPLACE FUNCTION {s}.claim_ready(p_queue text, p_max integer, p_deadline_ms bigint, p_aging_ms bigint, p_receipts boolean) RETURNS TABLE(claim_slot integer, lease_slot integer, lease_generation bigint, ready_slot integer, ready_generation bigint, queue text, priority smallint, effective_priority smallint, enqueue_shard smallint, lane_seq bigint, job_id bigint, run_lease bigint, attempt smallint, max_attempts smallint, kind text, args jsonb, run_at timestamptz, created_at timestamptz, claimed_at timestamptz, deadline_at timestamptz, unique_key bytea, unique_states text, payload jsonb) LANGUAGE plpgsql VOLATILE
SET jit = off SET plan_cache_mode = force_generic_plan SET lock_timeout = '200ms' AS $$
DECLARE
  v_logical text := regexp_replace(p_queue, '#[0-9]+$', '');
  v_now timestamptz := clock_timestamp();
  v_remaining integer := p_max;
  v_lane record;
  v_hint bigint;
  v_pos bigint;
  v_next bigint;
  v_seg_slot integer;
  v_seg_gen bigint;
  v_seg_first bigint;
  v_limit bigint;
  v_rows bigint;
  v_first_pass boolean;
  v_found boolean;
  v_lanes refcursor;
  v_busy record;
  v_have_busy boolean := false;
  v_locked_any boolean := false;
  v_waited boolean := false;
BEGIN
  IF p_max <= 0 THEN RETURN; END IF;
  IF EXISTS (SELECT 1 FROM {s}.queue_meta m WHERE m.queue = v_logical AND m.paused) THEN
    RETURN;
  END IF;
  IF p_aging_ms > 0 THEN
    OPEN v_lanes FOR
    SELECT h.priority AS lane_priority, h.enqueue_shard AS shard, h.claim_seq, h.enqueue_seq
    FROM {s}.queue_claim_heads h
    CROSS JOIN LATERAL (
      SELECT coalesce(pg_sequence_last_value(h.claim_seq), 0) + 1 AS claim_next,
             coalesce(pg_sequence_last_value(h.enqueue_seq), 0) + 1 AS enqueue_next) cur
    LEFT JOIN LATERAL (
      -- the head candidate's age, needed only to order lanes by aged priority
      SELECT r.run_at FROM {s}.ready_entries r
      WHERE r.queue = h.queue AND r.priority = h.priority AND r.enqueue_shard = h.enqueue_shard
        AND r.lane_seq >= cur.claim_next
        AND NOT EXISTS (
          SELECT 1 FROM {s}.ready_tombstones t
          WHERE t.ready_slot = r.ready_slot AND t.queue = r.queue AND t.priority = r.priority
            AND t.enqueue_shard = r.enqueue_shard AND t.lane_seq = r.lane_seq)
      ORDER BY r.lane_seq LIMIT 1) head ON true
    WHERE h.queue = p_queue AND cur.enqueue_next > cur.claim_next
    ORDER BY
      CASE WHEN head.run_at IS NULL THEN NULL
           ELSE greatest(1, h.priority - floor(
             extract(epoch FROM (v_now - head.run_at)) * 1000 / p_aging_ms)::integer)
      END NULLS LAST,
      head.run_at NULLS LAST, h.priority, random();
  ELSE
    -- without aging the order needs no look at the ready rows: lane priority, then shards
    -- in random order so concurrent claimers fan out
    OPEN v_lanes FOR
    SELECT h.priority AS lane_priority, h.enqueue_shard AS shard, h.claim_seq, h.enqueue_seq
    FROM {s}.queue_claim_heads h
    WHERE h.queue = p_queue
      AND coalesce(pg_sequence_last_value(h.enqueue_seq), 0)
          > coalesce(pg_sequence_last_value(h.claim_seq), 0)
    ORDER BY h.priority, random();
  END IF;
  LOOP
    EXIT WHEN v_remaining <= 0 OR v_waited;
    FETCH v_lanes INTO v_lane;
    IF FOUND THEN
      PERFORM 1 FROM {s}.queue_claim_heads h
        WHERE h.queue = p_queue AND h.priority = v_lane.lane_priority
          AND h.enqueue_shard = v_lane.shard
        FOR UPDATE SKIP LOCKED;
      IF NOT FOUND THEN
        IF NOT v_have_busy THEN v_busy := v_lane; v_have_busy := true; END IF;
        CONTINUE;
      END IF;
      v_locked_any := true;
    ELSE
      -- Every lane with work was being claimed by someone else. Rather than return empty
      -- (and have the caller poll), queue on the first busy lane's head for a bounded time
      -- (the function's lock_timeout), but only while holding no other head: a waiter owns
      -- no lane, so waiters cannot form a cycle among themselves.
      EXIT WHEN NOT v_have_busy OR v_locked_any OR v_remaining < p_max;
      v_lane := v_busy;
      v_waited := true;
      BEGIN
        PERFORM 1 FROM {s}.queue_claim_heads h
          WHERE h.queue = p_queue AND h.priority = v_lane.lane_priority
            AND h.enqueue_shard = v_lane.shard
          FOR UPDATE;
      EXCEPTION WHEN lock_not_available OR deadlock_detected THEN
        EXIT;
      END;
      EXIT WHEN NOT FOUND;  -- the head went away while we waited
    END IF;
    -- Under the head lock every later statement sees all committed claims of this lane.
    -- Repeat within the lane while the batch is not full (tombstoned or aborted positions
    -- do not count); later passes see this call's own ranges, so the hint is only moved on
    -- the first pass, over committed evidence alone.
    v_first_pass := true;
    LOOP
    EXIT WHEN v_remaining <= 0;
    v_hint := coalesce(pg_sequence_last_value(v_lane.claim_seq), 0) + 1;
    v_pos := v_hint;
    LOOP
      -- Follow the committed chain of claim ranges. A range starts at a ready row's
      -- position and lives in that row's slot, so each hop is one lane probe over the ready
      -- children plus one range probe pruned to a single child. Positions before the first
      -- committed row are spent: aborted reservations (a producer holds the lane
      -- reservation lock until it commits, so a later row implies earlier ones ended) or
      -- history a prune truncated together with its claim ranges.
      SELECT r.ready_slot, r.ready_generation, r.lane_seq
        INTO v_seg_slot, v_seg_gen, v_seg_first
        FROM {s}.ready_entries r
        WHERE r.queue = p_queue AND r.priority = v_lane.lane_priority
          AND r.enqueue_shard = v_lane.shard AND r.lane_seq >= v_pos
        ORDER BY r.lane_seq LIMIT 1;
      v_found := FOUND;
      EXIT WHEN NOT v_found;
      SELECT cr.last_seq INTO v_next FROM {s}.ready_claim_ranges cr
        WHERE cr.ready_slot = v_seg_slot AND cr.queue = p_queue
          AND cr.priority = v_lane.lane_priority AND cr.enqueue_shard = v_lane.shard
          AND cr.first_seq = v_seg_first;
      IF NOT FOUND THEN
        v_pos := v_seg_first;
        EXIT;
      END IF;
      v_pos := v_next + 1;
    END LOOP;
    IF NOT v_found THEN
      -- Nothing committed ahead (the next reservation may still be in flight).
      IF v_first_pass AND v_pos > v_hint THEN PERFORM setval(v_lane.claim_seq, v_pos - 1); END IF;
      EXIT;
    END IF;
    IF v_first_pass AND v_pos > v_hint THEN PERFORM setval(v_lane.claim_seq, v_pos - 1); END IF;
    v_first_pass := false;
    v_limit := least(v_remaining,
                     coalesce(pg_sequence_last_value(v_lane.enqueue_seq), 0) - v_pos + 1);
    EXIT WHEN v_limit <= 0;
    RETURN QUERY
    WITH picked AS (
      -- v_seg_slot (a plan parameter) rather than r.ready_slot: the tombstone probe is then
      -- pruned to one child when the plan starts, not at every row
      SELECT r.*, EXISTS (
               SELECT 1 FROM {s}.ready_tombstones t
               WHERE t.ready_slot = v_seg_slot AND t.queue = r.queue
                 AND t.priority = r.priority AND t.enqueue_shard = r.enqueue_shard
                 AND t.lane_seq = r.lane_seq) AS tombstoned
      FROM {s}.ready_entries r
      WHERE r.ready_slot = v_seg_slot AND r.queue = p_queue
        AND r.priority = v_lane.lane_priority AND r.enqueue_shard = v_lane.shard
        AND r.lane_seq >= v_pos
      ORDER BY r.lane_seq
      LIMIT v_limit
    ), claim_range AS (
      INSERT INTO {s}.ready_claim_ranges AS cr
        (ready_slot, ready_generation, queue, priority, enqueue_shard, first_seq, last_seq,
         claimed_at)
      SELECT v_seg_slot, v_seg_gen, p_queue, v_lane.lane_priority, v_lane.shard, v_pos,
             max(p.lane_seq), v_now
      FROM picked p HAVING count(*) > 0
      RETURNING cr.last_seq
    ), live AS (
      SELECT p.*,
             CASE WHEN p_aging_ms > 0 THEN greatest(1, p.priority - floor(
                    extract(epoch FROM (v_now - p.run_at)) * 1000 / p_aging_ms)::integer)
                  ELSE p.priority END::smallint AS eff,
             CASE WHEN p_deadline_ms > 0
                  THEN v_now + make_interval(secs => p_deadline_ms / 1000.0) END AS dl
      FROM picked p
      WHERE NOT p.tombstoned
    ), rings AS (
      SELECT (SELECT c.current_slot FROM {s}.claim_ring_state c) AS claim_slot,
             (SELECT l.current_slot FROM {s}.lease_ring_state l) AS lease_slot,
             (SELECT l.generation FROM {s}.lease_ring_state l) AS lease_generation
    ), receipts AS (
      INSERT INTO {s}.lease_claims AS lc
        (claim_slot, job_id, run_lease, ready_slot, ready_generation, queue, priority,
         effective_priority, attempt, max_attempts, lane_seq, enqueue_shard, claimed_at,
         deadline_at)
      SELECT g.claim_slot, p.job_id, p.run_lease + 1, p.ready_slot, p.ready_generation,
             p.queue, p.priority, p.eff, p.attempt + 1, p.max_attempts, p.lane_seq,
             p.enqueue_shard, v_now, p.dl
      FROM live p CROSS JOIN rings g
      WHERE p_receipts
      RETURNING lc.job_id
    ), leased AS (
      INSERT INTO {s}.leases AS le
        (lease_slot, lease_generation, ready_slot, ready_generation, job_id, queue, state,
         priority, effective_priority, attempt, run_lease, max_attempts, lane_seq,
         enqueue_shard, heartbeat_at, deadline_at, attempted_at)
      SELECT g.lease_slot, g.lease_generation, p.ready_slot, p.ready_generation, p.job_id,
             p.queue, 'running', p.priority, p.eff, p.attempt + 1, p.run_lease + 1,
             p.max_attempts, p.lane_seq, p.enqueue_shard, v_now, p.dl, v_now
      FROM live p CROSS JOIN rings g
      WHERE NOT p_receipts
      RETURNING le.job_id
    )
    SELECT CASE WHEN p_receipts THEN g.claim_slot ELSE 0 END, g.lease_slot,
           g.lease_generation, p.ready_slot, p.ready_generation, p.queue, p.priority, p.eff,
           p.enqueue_shard, p.lane_seq, p.job_id, p.run_lease + 1, (p.attempt + 1)::smallint,
           p.max_attempts, p.kind, p.args, p.run_at, p.created_at, v_now, p.dl,
           p.unique_key, p.unique_states, p.payload
    FROM live p CROSS JOIN rings g
    ORDER BY p.lane_seq;
    GET DIAGNOSTICS v_rows = ROW_COUNT;
    v_remaining := v_remaining - v_rows::integer;
    END LOOP;
  END LOOP;
  CLOSE v_lanes;
END
$$"""


def complete_receipts(s: str) -> str:
    """``CREATE OR REPLACE FUNCTION <s>.complete_receipts`` (four arrays) as revision 0003
    installed it."""
    return f"""CREATE OR REPLACE FUNCTION {s}.complete_receipts(p_claim_slots integer[], p_job_ids bigint[], p_run_leases bigint[], p_kinds text[]) RETURNS TABLE(job_id bigint, run_lease bigint) LANGUAGE plpgsql VOLATILE
SET jit = off SET plan_cache_mode = force_generic_plan AS $$
BEGIN
  RETURN QUERY
  WITH input AS (
    SELECT DISTINCT ON (i.job_id, i.run_lease, i.claim_slot)
           i.claim_slot, i.job_id, i.run_lease, i.kind
    FROM unnest(p_claim_slots, p_job_ids, p_run_leases, p_kinds)
         AS i(claim_slot, job_id, run_lease, kind)
    ORDER BY i.job_id, i.run_lease, i.claim_slot
  ), locked AS (
    SELECT c.*, i.kind
    FROM input i
    CROSS JOIN LATERAL (
      SELECT c.* FROM {s}.lease_claims c
      WHERE c.claim_slot = i.claim_slot AND c.job_id = i.job_id AND c.run_lease = i.run_lease
        AND c.materialized_at IS NULL
      FOR UPDATE) c
  ), closed AS (
    INSERT INTO {s}.lease_claim_closures AS cl (claim_slot, job_id, run_lease, outcome)
    SELECT l.claim_slot, l.job_id, l.run_lease, 'completed' FROM locked l
    ON CONFLICT DO NOTHING
    RETURNING cl.claim_slot, cl.job_id, cl.run_lease
  ), done AS (
    INSERT INTO {s}.done_entries AS d
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
    INSERT INTO {s}.queue_terminal_count_deltas
      (ready_slot, ready_generation, queue, priority, enqueue_shard, counter_bucket,
       terminal_delta)
    SELECT d.ready_slot, d.ready_generation, d.queue, d.priority, d.enqueue_shard,
           (d.job_id % 1)::smallint, count(*)
    FROM done d
    GROUP BY 1, 2, 3, 4, 5, 6
    ORDER BY 1, 2, 3, 4, 5, 6
  )
  SELECT c.job_id, c.run_lease FROM closed c;
END
$$"""


def upgrade(shape: Shape) -> list[str]:
    s = shape.schema
    return [f"DROP FUNCTION IF EXISTS {s}.{COMPLETE_0001}", claim_ready(s), complete_receipts(s)]


def downgrade(shape: Shape) -> list[str]:
    s = shape.schema
    claim_0001, complete_0001 = r0001.claim_and_complete(s)
    return [f"DROP FUNCTION IF EXISTS {s}.{COMPLETE_0003}", claim_0001, complete_0001]
