## claim_ready: one claim in one round trip.
##
## Picks lanes of a physical queue by (effective) priority, takes a lane's head row with
## SKIP LOCKED, follows the lane's committed chain of claim ranges from its cursor hint,
## consumes up to p_max positions of one ready segment, records the claim range and writes
## receipts (or leases), and returns the claimed jobs. A lane is left as soon as the claim
## has taken every position its enqueue sequence had reached (no second pass to find that
## nothing follows).
##
## A lane's position is looked up first in the ring slot where this session's claims last
## found a ready row (the session setting ready_slot_seen.<schema>; the ring's current slot
## when there is none), then in the slot a hop led to, and in every child only on a miss: a
## backlog enqueued before the ring last turned lies in an older slot than the current one,
## and a look at every child costs one index scan per slot.
##
## Template parameters: s (schema), shape (slot counts), claim_wait (the function's
## lock_timeout), claimed_in_xact (the transaction-local setting a claim sets once it has
## written a range), ready_slot_seen (the session setting's name, suffixed with the schema).
## Every read of a queue-ring child names the child through a static
## branch per slot (a cached generic plan over a partitioned parent would lock every child
## and index at each execution); receipts and leases go through their parents (tuple routing
## opens only the child a row lands in).
CREATE OR REPLACE FUNCTION ${s}.claim_ready(p_queue text, p_max integer, p_deadline_ms bigint, p_aging_ms bigint, p_receipts boolean) RETURNS TABLE(claim_slot integer, lease_slot integer, lease_generation bigint, ready_slot integer, ready_generation bigint, queue text, priority smallint, effective_priority smallint, enqueue_shard smallint, lane_seq bigint, job_id bigint, run_lease bigint, attempt smallint, max_attempts smallint, kind text, args jsonb, run_at timestamptz, created_at timestamptz, claimed_at timestamptz, deadline_at timestamptz, unique_key bytea, unique_states text, payload jsonb) LANGUAGE plpgsql VOLATILE
SET jit = off SET plan_cache_mode = force_generic_plan SET lock_timeout = '${claim_wait}' AS $$
DECLARE
  v_logical text := regexp_replace(p_queue, '#[0-9]+$', '');
  v_now timestamptz := clock_timestamp();
  v_remaining integer := p_max;
  v_prios smallint[];
  v_shards smallint[];
  v_claim_seqs regclass[];
  v_enq_seqs regclass[];
  v_i integer := 0;
  v_lane_priority smallint;
  v_lane_shard smallint;
  v_claim_seq regclass;
  v_enq_seq regclass;
  v_busy integer := 0;
  v_locked_any boolean := false;
  v_waited boolean := false;
  v_blocked boolean := false;
  v_may_move_hint boolean := current_setting('${claimed_in_xact}', true) IS DISTINCT FROM 'on';
  v_hint bigint;
  v_pos bigint;
  v_next bigint;
  v_seg_slot integer;
  v_seg_gen bigint;
  v_seg_first bigint;
  v_limit bigint;
  v_enq_last bigint;
  v_rows bigint;
  v_first_pass boolean;
  v_found boolean;
  v_guess integer;
  v_seen integer := nullif(current_setting('${ready_slot_seen}.${s}', true), '')::integer;
  v_lane record;
BEGIN
  IF p_max <= 0 THEN RETURN; END IF;
  IF EXISTS (SELECT 1 FROM ${s}.queue_meta m WHERE m.queue = v_logical AND m.paused) THEN
    RETURN;
  END IF;

  -- 1. The lanes with work, in the order they are tried.
  IF p_aging_ms > 0 THEN
    BEGIN
      SELECT array_agg(o.priority ORDER BY o.n), array_agg(o.enqueue_shard ORDER BY o.n),
             array_agg(o.claim_seq ORDER BY o.n), array_agg(o.enqueue_seq ORDER BY o.n)
        INTO v_prios, v_shards, v_claim_seqs, v_enq_seqs
      FROM (
        SELECT h.priority, h.enqueue_shard, h.claim_seq, h.enqueue_seq,
               row_number() OVER (ORDER BY
                 CASE WHEN head.run_at IS NULL THEN NULL
                      ELSE greatest(1, h.priority - floor(
                        extract(epoch FROM (v_now - head.run_at)) * 1000 / p_aging_ms)::integer)
                 END NULLS LAST,
                 head.run_at NULLS LAST, h.priority, random()) AS n
        FROM ${s}.queue_claim_heads h
        CROSS JOIN LATERAL (
          SELECT coalesce(pg_sequence_last_value(h.claim_seq), 0) + 1 AS claim_next,
                 coalesce(pg_sequence_last_value(h.enqueue_seq), 0) + 1 AS enqueue_next) cur
        LEFT JOIN LATERAL (
          -- the head candidate's age, needed only to order lanes by aged priority
          SELECT r.run_at FROM ${s}.ready_entries r
          WHERE r.queue = h.queue AND r.priority = h.priority
            AND r.enqueue_shard = h.enqueue_shard AND r.lane_seq >= cur.claim_next
            AND NOT EXISTS (
              SELECT 1 FROM ${s}.ready_tombstones t
              WHERE t.ready_slot = r.ready_slot AND t.queue = r.queue
                AND t.priority = r.priority AND t.enqueue_shard = r.enqueue_shard
                AND t.lane_seq = r.lane_seq)
          ORDER BY r.lane_seq LIMIT 1) head ON true
        WHERE h.queue = p_queue AND cur.enqueue_next > cur.claim_next) o;
    EXCEPTION WHEN lock_not_available THEN
      RETURN;  -- a prune holds a ring child the ordering needs: nothing claimed, no error
    END;
  ELSE
    -- without aging the order needs no look at the ready rows: lane priority, then shards
    -- in random order so concurrent claimers fan out
    SELECT array_agg(o.priority ORDER BY o.n), array_agg(o.enqueue_shard ORDER BY o.n),
           array_agg(o.claim_seq ORDER BY o.n), array_agg(o.enqueue_seq ORDER BY o.n)
      INTO v_prios, v_shards, v_claim_seqs, v_enq_seqs
    FROM (
      SELECT h.priority, h.enqueue_shard, h.claim_seq, h.enqueue_seq,
             row_number() OVER (ORDER BY h.priority, random()) AS n
      FROM ${s}.queue_claim_heads h
      WHERE h.queue = p_queue
        AND coalesce(pg_sequence_last_value(h.enqueue_seq), 0)
            > coalesce(pg_sequence_last_value(h.claim_seq), 0)) o;
  END IF;

  -- 2. Lane by lane until the batch is full.
  LOOP
    EXIT WHEN v_remaining <= 0 OR v_waited OR v_blocked;
    v_i := v_i + 1;
    IF v_i <= coalesce(array_length(v_prios, 1), 0) THEN
      v_lane_priority := v_prios[v_i];
      v_lane_shard := v_shards[v_i];
      v_claim_seq := v_claim_seqs[v_i];
      v_enq_seq := v_enq_seqs[v_i];
      PERFORM 1 FROM ${s}.queue_claim_heads h
        WHERE h.queue = p_queue AND h.priority = v_lane_priority
          AND h.enqueue_shard = v_lane_shard
        FOR UPDATE SKIP LOCKED;
      IF NOT FOUND THEN
        IF v_busy = 0 THEN v_busy := v_i; END IF;
        CONTINUE;
      END IF;
      v_locked_any := true;
    ELSE
      -- Every lane with work was being claimed by someone else. Rather than return empty
      -- (and have the caller poll), queue on the first busy lane's head for a bounded time
      -- (the function's lock_timeout), but only while holding no other head: a waiter owns
      -- no lane, so waiters cannot form a cycle among themselves.
      EXIT WHEN v_busy = 0 OR v_locked_any OR v_remaining < p_max;
      v_lane_priority := v_prios[v_busy];
      v_lane_shard := v_shards[v_busy];
      v_claim_seq := v_claim_seqs[v_busy];
      v_enq_seq := v_enq_seqs[v_busy];
      v_waited := true;
      BEGIN
        PERFORM 1 FROM ${s}.queue_claim_heads h
          WHERE h.queue = p_queue AND h.priority = v_lane_priority
            AND h.enqueue_shard = v_lane_shard
          FOR UPDATE;
      EXCEPTION WHEN lock_not_available OR deadlock_detected THEN
        EXIT;
      END;
      EXIT WHEN NOT FOUND;  -- the head went away while we waited
    END IF;
    -- the probes below name the lane through a record
    SELECT v_lane_priority AS lane_priority, v_lane_shard AS shard INTO v_lane;
    -- Under the head lock every later statement sees all committed claims of this lane.
    -- Repeat within the lane while the batch is not full (tombstoned or aborted positions
    -- do not count); later passes see this call's own ranges, so the hint is only moved on
    -- the first pass, over committed evidence alone (and only by the first claim of a
    -- transaction: a later one could see its own transaction's uncommitted ranges).
    v_first_pass := true;
    v_guess := coalesce(v_seen, (SELECT q.current_slot FROM ${s}.queue_ring_state q));
    LOOP
      EXIT WHEN v_remaining <= 0;
      v_hint := coalesce(pg_sequence_last_value(v_claim_seq), 0) + 1;
      v_pos := v_hint;

      -- 3. Find the first unclaimed position of the lane.
      BEGIN
        LOOP
          -- Follow the committed chain of claim ranges. A range starts at a ready row's
          -- position and lives in that row's slot, so each hop is one probe for the
          -- position plus one range probe, each in a single child. The position is looked
          -- up first in the child the chain was last seen in (to begin with, the slot this
          -- session last found a row in, else the ring's current slot): positions are
          -- unique per lane, so a row at v_pos is the first one
          -- at or after it; only a miss scans every child, and only when the lane's enqueue
          -- sequence has reached v_pos (no row at or after it can exist otherwise).
          -- Positions before the first committed row are spent: aborted reservations (a
          -- producer holds the lane reservation lock until it commits, so a later row
          -- implies earlier ones ended) or history a prune truncated with its claim ranges.
          v_found := false;
% for k in range(shape.queue_slot_count):
          ${'IF' if loop.first else 'ELSIF'} v_guess = ${k} THEN
            SELECT r.ready_slot, r.ready_generation, r.lane_seq
              INTO v_seg_slot, v_seg_gen, v_seg_first
              FROM ${s}.ready_entries_${k} r
              WHERE r.queue = p_queue AND r.priority = v_lane.lane_priority
                AND r.enqueue_shard = v_lane.shard AND r.lane_seq = v_pos;
            v_found := FOUND;
% endfor
          END IF;
          IF NOT v_found AND coalesce(pg_sequence_last_value(v_enq_seq), 0) >= v_pos THEN
            SELECT r.ready_slot, r.ready_generation, r.lane_seq
              INTO v_seg_slot, v_seg_gen, v_seg_first
              FROM ${s}.ready_entries r
              WHERE r.queue = p_queue AND r.priority = v_lane.lane_priority
                AND r.enqueue_shard = v_lane.shard AND r.lane_seq >= v_pos
              ORDER BY r.lane_seq LIMIT 1;
            v_found := FOUND;
          END IF;
          EXIT WHEN NOT v_found;
          v_guess := v_seg_slot;
          IF v_seen IS DISTINCT FROM v_seg_slot THEN  -- (a session setting: it outlives the call)
            v_seen := v_seg_slot;
            PERFORM set_config('${ready_slot_seen}.${s}', v_seg_slot::text, false);
          END IF;
          v_next := NULL;
% for k in range(shape.queue_slot_count):
          ${'IF' if loop.first else 'ELSIF'} v_seg_slot = ${k} THEN
            SELECT cr.last_seq INTO v_next FROM ${s}.ready_claim_ranges_${k} cr
              WHERE cr.queue = p_queue AND cr.priority = v_lane.lane_priority
                AND cr.enqueue_shard = v_lane.shard AND cr.first_seq = v_seg_first;
% endfor
          END IF;
          IF v_next IS NULL THEN
            v_pos := v_seg_first;
            EXIT;
          END IF;
          v_pos := v_next + 1;
        END LOOP;
        IF v_found THEN
          -- the segment's ready and range children are locked by the probes above; take
          -- the tombstone child too, so the claim below never waits on a prune
% for k in range(shape.queue_slot_count):
          ${'IF' if loop.first else 'ELSIF'} v_seg_slot = ${k} THEN
            LOCK TABLE ${s}.ready_tombstones_${k} IN ACCESS SHARE MODE;
% endfor
          END IF;
        END IF;
      EXCEPTION WHEN lock_not_available THEN
        v_blocked := true;  -- a prune holds a child: return what was claimed so far
      END;
      EXIT WHEN v_blocked;
      IF NOT v_found THEN
        -- Nothing committed ahead (the next reservation may still be in flight).
        IF v_first_pass AND v_may_move_hint AND v_pos > v_hint THEN
          PERFORM setval(v_claim_seq, v_pos - 1);
        END IF;
        EXIT;
      END IF;
      IF v_first_pass AND v_may_move_hint AND v_pos > v_hint THEN
        PERFORM setval(v_claim_seq, v_pos - 1);
      END IF;
      v_first_pass := false;
      v_enq_last := coalesce(pg_sequence_last_value(v_enq_seq), 0);
      v_limit := least(v_remaining, v_enq_last - v_pos + 1);
      EXIT WHEN v_limit <= 0;

      -- 4. Claim from v_pos on in the segment's child: pick, record the range, write
      --    receipts or leases, return the rows (v_rows: how many).
      v_rows := 0;
      PERFORM set_config('${claimed_in_xact}', 'on', true);
% for k in range(shape.queue_slot_count):
      ${'IF' if loop.first else 'ELSIF'} v_seg_slot = ${k} THEN
        RETURN QUERY
        WITH picked AS (
          SELECT r.*, EXISTS (
                   SELECT 1 FROM ${s}.ready_tombstones_${k} t
                   WHERE t.queue = r.queue
                     AND t.priority = r.priority AND t.enqueue_shard = r.enqueue_shard
                     AND t.lane_seq = r.lane_seq) AS tombstoned
          FROM ${s}.ready_entries_${k} r
          WHERE r.queue = p_queue
            AND r.priority = v_lane.lane_priority AND r.enqueue_shard = v_lane.shard
            AND r.lane_seq >= v_pos
          ORDER BY r.lane_seq
          LIMIT v_limit
        ), claim_range AS (
          INSERT INTO ${s}.ready_claim_ranges_${k} AS cr
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
          SELECT (SELECT c.current_slot FROM ${s}.claim_ring_state c) AS claim_slot,
                 (SELECT l.current_slot FROM ${s}.lease_ring_state l) AS lease_slot,
                 (SELECT l.generation FROM ${s}.lease_ring_state l) AS lease_generation
        ), receipts AS (
          INSERT INTO ${s}.lease_claims AS lc
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
          INSERT INTO ${s}.leases AS le
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
% endfor
      END IF;
      v_remaining := v_remaining - v_rows::integer;
      -- Every position the lane had reserved when v_enq_last was read is claimed now (all
      -- v_limit rows were live, so the last of them is at v_enq_last or beyond): another
      -- pass could only find what was enqueued since, which the next claim takes.
      EXIT WHEN v_rows = v_limit AND v_pos + v_limit > v_enq_last;
    END LOOP;
  END LOOP;
END
$$
