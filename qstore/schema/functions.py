"""Server-side functions and views, declared as replaceable entities.

Each entity is plain data (schema, signature, definition) so the runtime needs no extra
dependency; :mod:`qstore.migrate` turns them into ``alembic_utils`` entities when that
package is installed, so ``alembic check`` diffs function bodies too. Bodies are PL/pgSQL
(no Core form exists); the only interpolated name is the validated schema identifier.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from qstore.config import QueueStorageConfig
from qstore.schema.rings import child_name
from qstore.schema.types import COUNTER_BUCKETS

__all__ = ["ServerFunction", "ServerView", "declare_functions", "declare_views"]


@dataclass(frozen=True)
class ServerFunction:
    schema: str
    signature: str  # name(arg types) as pg_get_function_identity_arguments renders them
    definition: str  # RETURNS ... LANGUAGE ... AS $$ ... $$

    @property
    def name(self) -> str:
        return self.signature.split("(", 1)[0]

    def create_sql(self) -> str:
        return f"CREATE OR REPLACE FUNCTION {self.schema}.{self.signature} {self.definition}"

    def drop_sql(self) -> str:
        return f"DROP FUNCTION IF EXISTS {self.schema}.{self.signature}"


@dataclass(frozen=True)
class ServerView:
    schema: str
    name: str
    definition: str  # the SELECT

    def create_sql(self) -> str:
        return f"CREATE OR REPLACE VIEW {self.schema}.{self.name} AS {self.definition}"

    def drop_sql(self) -> str:
        return f"DROP VIEW IF EXISTS {self.schema}.{self.name}"


def _backoff(s: str) -> ServerFunction:
    return ServerFunction(
        s,
        "backoff_duration(attempt integer, max_attempts integer)",
        """RETURNS interval LANGUAGE sql VOLATILE AS $$
  SELECT least(
    make_interval(secs => power(2, least(attempt, 17))::double precision
                          * (1 + random() * 0.25)),
    interval '24 hours')
$$""",
    )


def _ensure_lane(s: str) -> ServerFunction:
    return ServerFunction(
        s,
        "ensure_lane(p_queue text, p_logical text, p_priority smallint, p_shard smallint)",
        f"""RETURNS void LANGUAGE plpgsql VOLATILE AS $$
DECLARE
  v_hash text;
  v_enq text;
  v_claim text;
BEGIN
  IF EXISTS (SELECT 1 FROM {s}.queue_claim_heads h
             WHERE h.queue = p_queue AND h.priority = p_priority AND h.enqueue_shard = p_shard) THEN
    RETURN;
  END IF;
  PERFORM pg_advisory_xact_lock(hashtextextended(
    '{s}:lane:' || p_queue || ':' || p_priority || ':' || p_shard, 0));
  IF EXISTS (SELECT 1 FROM {s}.queue_claim_heads h
             WHERE h.queue = p_queue AND h.priority = p_priority AND h.enqueue_shard = p_shard) THEN
    RETURN;
  END IF;
  v_hash := md5(p_queue || ':' || p_priority || ':' || p_shard);
  v_enq := 'queue_enqueue_seq_' || v_hash;
  v_claim := 'queue_claim_seq_' || v_hash;
  EXECUTE format('CREATE SEQUENCE IF NOT EXISTS %I.%I AS bigint MINVALUE 0 START 1 CACHE 1',
                 '{s}', v_enq);
  EXECUTE format('CREATE SEQUENCE IF NOT EXISTS %I.%I AS bigint MINVALUE 0 START 1 CACHE 1',
                 '{s}', v_claim);
  INSERT INTO {s}.queue_lanes (queue, priority) VALUES (p_queue, p_priority)
    ON CONFLICT DO NOTHING;
  INSERT INTO {s}.queue_enqueue_heads (queue, priority, enqueue_shard, enqueue_seq)
    VALUES (p_queue, p_priority, p_shard, format('%I.%I', '{s}', v_enq)::regclass)
    ON CONFLICT DO NOTHING;
  INSERT INTO {s}.queue_claim_heads
      (queue, priority, enqueue_shard, logical_queue, enqueue_seq, claim_seq)
    VALUES (p_queue, p_priority, p_shard, p_logical,
            format('%I.%I', '{s}', v_enq)::regclass, format('%I.%I', '{s}', v_claim)::regclass)
    ON CONFLICT DO NOTHING;
END
$$""",
    )


def _reserve_lanes(s: str) -> ServerFunction:
    # Reservation lock is transaction-scoped and held until the enqueue commits (trap T1):
    # "position N+1 visible" implies "position N committed or aborted".
    return ServerFunction(
        s,
        "reserve_lanes(p_queues text[], p_logicals text[], p_priorities smallint[], "
        "p_shards smallint[], p_counts integer[])",
        f"""RETURNS bigint[] LANGUAGE plpgsql VOLATILE AS $$
DECLARE
  v_out bigint[] := '{{}}';
  v_seq regclass;
  v_start bigint;
BEGIN
  FOR i IN 1 .. coalesce(array_length(p_queues, 1), 0) LOOP
    PERFORM {s}.ensure_lane(p_queues[i], p_logicals[i], p_priorities[i], p_shards[i]);
    PERFORM pg_advisory_xact_lock(hashtextextended(
      '{s}:reserve:' || p_queues[i] || ':' || p_priorities[i] || ':' || p_shards[i], 0));
    SELECT h.enqueue_seq INTO STRICT v_seq FROM {s}.queue_enqueue_heads h
      WHERE h.queue = p_queues[i] AND h.priority = p_priorities[i]
        AND h.enqueue_shard = p_shards[i];
    v_start := nextval(v_seq);
    IF p_counts[i] > 1 THEN
      PERFORM setval(v_seq, v_start + p_counts[i] - 1);
    END IF;
    v_out := v_out || v_start;
  END LOOP;
  RETURN v_out;
END
$$""",
    )


#: How long a claim queues on a busy lane head when every lane with work is being claimed
#: (below ``deadlock_timeout``, so a wait never turns into a deadlock error).
CLAIM_WAIT = "200ms"

CLAIM_COLUMNS = (
    "claim_slot integer, lease_slot integer, lease_generation bigint, "
    "ready_slot integer, ready_generation bigint, queue text, priority smallint, "
    "effective_priority smallint, enqueue_shard smallint, lane_seq bigint, job_id bigint, "
    "run_lease bigint, attempt smallint, max_attempts smallint, kind text, args jsonb, "
    "run_at timestamptz, created_at timestamptz, claimed_at timestamptz, "
    "deadline_at timestamptz, unique_key bytea, unique_states text, payload jsonb"
)


def _dispatch(var: str, count: int, branch: Callable[[int], str]) -> str:
    """``IF var = 0 THEN branch(0) ELSIF var = 1 THEN … END IF;`` over ``count`` slots: each
    branch is static SQL with its own cached plan, and only the branch taken runs."""
    arms = [f"{'IF' if k == 0 else 'ELSIF'} {var} = {k} THEN\n        {branch(k)}" for k in range(count)]
    return "\n      ".join(arms) + "\n      END IF;"


def _position_probe(s: str, k: int) -> str:
    """The ready row at exactly ``v_pos`` of the lane, in ready child ``k``."""
    return f"""SELECT r.ready_slot, r.ready_generation, r.lane_seq
          INTO v_seg_slot, v_seg_gen, v_seg_first
          FROM {s}.{child_name('ready_entries', k)} r
          WHERE r.queue = p_queue AND r.priority = v_lane.lane_priority
            AND r.enqueue_shard = v_lane.shard AND r.lane_seq = v_pos;
        v_found := FOUND;"""


def _range_probe(s: str, k: int) -> str:
    """The committed claim range starting at ``v_seg_first``, in range child ``k``."""
    return f"""SELECT cr.last_seq INTO v_next FROM {s}.{child_name('ready_claim_ranges', k)} cr
          WHERE cr.queue = p_queue AND cr.priority = v_lane.lane_priority
            AND cr.enqueue_shard = v_lane.shard AND cr.first_seq = v_seg_first;"""


def _segment_claim(s: str, k: int) -> str:
    """The claim of one segment of ready child ``k``: pick, record the range, write
    receipts or leases, return the rows; ``v_rows`` gets how many."""
    return f"""RETURN QUERY
    WITH picked AS (
      SELECT r.*, EXISTS (
               SELECT 1 FROM {s}.{child_name('ready_tombstones', k)} t
               WHERE t.queue = r.queue
                 AND t.priority = r.priority AND t.enqueue_shard = r.enqueue_shard
                 AND t.lane_seq = r.lane_seq) AS tombstoned
      FROM {s}.{child_name('ready_entries', k)} r
      WHERE r.queue = p_queue
        AND r.priority = v_lane.lane_priority AND r.enqueue_shard = v_lane.shard
        AND r.lane_seq >= v_pos
      ORDER BY r.lane_seq
      LIMIT v_limit
    ), claim_range AS (
      INSERT INTO {s}.{child_name('ready_claim_ranges', k)} AS cr
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
    GET DIAGNOSTICS v_rows = ROW_COUNT;"""


def _claim_ready(cfg: QueueStorageConfig) -> ServerFunction:
    """One round trip: pick lanes by effective priority (SKIP LOCKED on the claim head),
    follow the committed claim-range chain from the cursor hint, consume up to p_max
    positions of one ready segment, record the range and write receipts (or leases).

    Every read of the queue ring, and the claim-range append, names one ring child
    (generated per-slot dispatch): a cached generic plan over a partitioned parent locks
    all of its children and their indexes at every execution, and those locks are taken
    again in every transaction. Receipts and leases are appended through their parents
    (tuple routing opens only the child it uses).
    """
    s, slots = cfg.schema, cfg.queue_slot_count
    return ServerFunction(
        s,
        "claim_ready(p_queue text, p_max integer, p_deadline_ms bigint, p_aging_ms bigint, "
        "p_receipts boolean)",
        f"""RETURNS TABLE({CLAIM_COLUMNS}) LANGUAGE plpgsql VOLATILE
SET jit = off SET plan_cache_mode = force_generic_plan SET lock_timeout = '{CLAIM_WAIT}' AS $$
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
  v_guess integer;
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
    v_guess := (SELECT q.current_slot FROM {s}.queue_ring_state q);
    LOOP
    EXIT WHEN v_remaining <= 0;
    v_hint := coalesce(pg_sequence_last_value(v_lane.claim_seq), 0) + 1;
    v_pos := v_hint;
    LOOP
      -- Follow the committed chain of claim ranges. A range starts at a ready row's
      -- position and lives in that row's slot, so each hop is one probe for the position
      -- plus one range probe, each in a single child. The position is looked up first in
      -- the child the chain was last seen in (the ring's current slot to begin with):
      -- positions are unique per lane, so a row at v_pos is the first one at or after it;
      -- only a miss scans every child. Positions before the first committed row are
      -- spent: aborted reservations (a producer holds the lane reservation lock until it
      -- commits, so a later row implies earlier ones ended) or history a prune truncated
      -- together with its claim ranges.
      v_found := false;
      {_dispatch("v_guess", slots, lambda k: _position_probe(s, k))}
      IF NOT v_found THEN
        SELECT r.ready_slot, r.ready_generation, r.lane_seq
          INTO v_seg_slot, v_seg_gen, v_seg_first
          FROM {s}.ready_entries r
          WHERE r.queue = p_queue AND r.priority = v_lane.lane_priority
            AND r.enqueue_shard = v_lane.shard AND r.lane_seq >= v_pos
          ORDER BY r.lane_seq LIMIT 1;
        v_found := FOUND;
      END IF;
      EXIT WHEN NOT v_found;
      v_guess := v_seg_slot;
      v_next := NULL;
      {_dispatch("v_seg_slot", slots, lambda k: _range_probe(s, k))}
      IF v_next IS NULL THEN
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
    v_rows := 0;
    {_dispatch("v_seg_slot", slots, lambda k: _segment_claim(s, k))}
    v_remaining := v_remaining - v_rows::integer;
    END LOOP;
  END LOOP;
  CLOSE v_lanes;
END
$$""",
    )


def _slot_completion(s: str, k: int) -> str:
    """Fast completion of the input attempts whose receipts are in claim child ``k``."""
    return f"""RETURN QUERY
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
      SELECT c.* FROM {s}.{child_name('lease_claims', k)} c
      WHERE c.job_id = i.job_id AND c.run_lease = i.run_lease
        AND c.materialized_at IS NULL
      FOR UPDATE) c
  ), closed AS (
    INSERT INTO {s}.{child_name('lease_claim_closures', k)} AS cl (claim_slot, job_id, run_lease, outcome)
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
           (d.job_id % {COUNTER_BUCKETS})::smallint, count(*)
    FROM done d
    GROUP BY 1, 2, 3, 4, 5, 6
    ORDER BY 1, 2, 3, 4, 5, 6
  )
  SELECT c.job_id, c.run_lease FROM closed c;"""


def _complete_receipts(cfg: QueueStorageConfig) -> ServerFunction:
    """Fast completion of plain receipt-only attempts in one round trip: lock each receipt
    by primary key (index probe, runtime-pruned to its claim slot), append closures
    (``ON CONFLICT DO NOTHING``: whoever closed first wins), narrow done rows built from the
    receipt plus the job kind the worker carries from its claim (STORAGE.md §7.4: no re-read
    of the ready row) and grouped count deltas. Returns the attempts
    it completed; a receipt that was materialised (heartbeat, callback) is left to the
    general path.

    One statement per claim slot present in the input, each naming its ``lease_claims``
    child (see :func:`_claim_ready` for why); an unknown slot matches nothing (stale)."""
    s, slots = cfg.schema, cfg.claim_slot_count
    return ServerFunction(
        s,
        "complete_receipts(p_claim_slots integer[], p_job_ids bigint[], p_run_leases bigint[], "
        "p_kinds text[])",
        f"""RETURNS TABLE(job_id bigint, run_lease bigint) LANGUAGE plpgsql VOLATILE
SET jit = off SET plan_cache_mode = force_generic_plan AS $$
DECLARE
  v_slot integer;
BEGIN
  FOREACH v_slot IN ARRAY ARRAY(SELECT DISTINCT x FROM unnest(p_claim_slots) x ORDER BY 1) LOOP
    {_dispatch("v_slot", slots, lambda k: _slot_completion(s, k))}
  END LOOP;
END
$$""",
    )


def declare_functions(cfg: QueueStorageConfig) -> tuple[ServerFunction, ...]:
    """The server functions of an install of ``cfg`` at the head revision."""
    s = cfg.schema
    return (_backoff(s), _ensure_lane(s), _reserve_lanes(s), _claim_ready(cfg),
            _complete_receipts(cfg))


def declare_views(cfg: QueueStorageConfig) -> tuple[ServerView, ...]:
    s = cfg.schema
    terminal_jobs = ServerView(
        s,
        "terminal_jobs",
        f"""SELECT d.job_id, d.kind, d.queue, d.state, d.priority, d.attempt, d.run_lease,
       coalesce(d.args, r.args, '{{}}'::jsonb) AS args,
       coalesce(d.max_attempts, r.max_attempts, 25::smallint) AS max_attempts,
       coalesce(d.run_at, r.run_at, d.finalized_at) AS run_at,
       coalesce(d.created_at, r.created_at, d.finalized_at) AS created_at,
       d.attempted_at, d.finalized_at,
       coalesce(d.unique_key, r.unique_key) AS unique_key,
       coalesce(d.unique_states, r.unique_states) AS unique_states,
       coalesce(d.payload, r.payload, '{{}}'::jsonb) AS payload,
       d.ready_slot, d.ready_generation, d.lane_seq, d.enqueue_shard
FROM {s}.done_entries d
LEFT JOIN {s}.ready_entries r
  ON r.ready_slot = d.ready_slot AND r.ready_generation = d.ready_generation
 AND r.queue = d.queue AND r.priority = d.priority
 AND r.enqueue_shard = d.enqueue_shard AND r.lane_seq = d.lane_seq""",
    )
    return (terminal_jobs,)
