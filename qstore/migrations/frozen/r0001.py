"""Frozen DDL of revision 0001: the whole substrate of one install.

Every statement this module renders is part of a landed revision and never changes: the
text depends only on the install's shape (schema name, slot counts, stripe count, receipt
mode), never on live code. ``tests/test_revision_freeze.py`` renders it for two shapes and
compares the result against recorded digests.
"""

from __future__ import annotations

from typing import Protocol


class Shape(Protocol):
    """What a frozen template may read of an install's configuration."""

    @property
    def schema(self) -> str: ...
    @property
    def queue_slot_count(self) -> int: ...
    @property
    def lease_slot_count(self) -> int: ...
    @property
    def claim_slot_count(self) -> int: ...
    @property
    def queue_stripe_count(self) -> int: ...
    @property
    def lease_claim_receipts(self) -> bool: ...


def _tables(s: str) -> list[str]:
    return [
        f"""CREATE TYPE {s}.job_state AS ENUM ('scheduled', 'available', 'running', 'completed', 'retryable', 'failed', 'cancelled', 'waiting_external')""",
        f"""CREATE SEQUENCE {s}.job_id_seq START WITH 1""",
        f"""CREATE TABLE {s}.ready_entries (
    ready_slot INTEGER NOT NULL,
    ready_generation BIGINT NOT NULL,
    job_id BIGINT NOT NULL,
    kind TEXT NOT NULL,
    queue TEXT NOT NULL,
    args JSONB DEFAULT '{{}}'::jsonb NOT NULL,
    priority SMALLINT NOT NULL,
    attempt SMALLINT DEFAULT 0 NOT NULL,
    run_lease BIGINT DEFAULT 0 NOT NULL,
    max_attempts SMALLINT DEFAULT 25 NOT NULL,
    lane_seq BIGINT NOT NULL,
    enqueue_shard SMALLINT DEFAULT 0 NOT NULL,
    run_at TIMESTAMP WITH TIME ZONE DEFAULT clock_timestamp() NOT NULL,
    attempted_at TIMESTAMP WITH TIME ZONE,
    created_at TIMESTAMP WITH TIME ZONE DEFAULT clock_timestamp() NOT NULL,
    unique_key BYTEA,
    unique_states TEXT,
    payload JSONB,
    CONSTRAINT ready_entries_pkey PRIMARY KEY (queue, priority, enqueue_shard, lane_seq, ready_slot)
)
 PARTITION BY LIST (ready_slot)""",
        f"""CREATE INDEX ready_entries_job_id_idx ON {s}.ready_entries (job_id)""",
        f"""CREATE TABLE {s}.ready_tombstones (
    ready_slot INTEGER NOT NULL,
    ready_generation BIGINT NOT NULL,
    queue TEXT NOT NULL,
    priority SMALLINT NOT NULL,
    enqueue_shard SMALLINT NOT NULL,
    lane_seq BIGINT NOT NULL,
    job_id BIGINT NOT NULL,
    tombstoned_at TIMESTAMP WITH TIME ZONE DEFAULT clock_timestamp() NOT NULL,
    CONSTRAINT ready_tombstones_pkey PRIMARY KEY (queue, priority, enqueue_shard, lane_seq, ready_slot, ready_generation)
)
 PARTITION BY LIST (ready_slot)""",
        f"""CREATE INDEX ready_tombstones_job_id_idx ON {s}.ready_tombstones (job_id)""",
        f"""CREATE TABLE {s}.ready_claim_ranges (
    ready_slot INTEGER NOT NULL,
    ready_generation BIGINT NOT NULL,
    queue TEXT NOT NULL,
    priority SMALLINT NOT NULL,
    enqueue_shard SMALLINT NOT NULL,
    first_seq BIGINT NOT NULL,
    last_seq BIGINT NOT NULL,
    claimed_at TIMESTAMP WITH TIME ZONE DEFAULT clock_timestamp() NOT NULL,
    CONSTRAINT ready_claim_ranges_pkey PRIMARY KEY (queue, priority, enqueue_shard, first_seq, ready_slot),
    CONSTRAINT ready_claim_ranges_span CHECK (last_seq >= first_seq)
)
 PARTITION BY LIST (ready_slot)""",
        f"""CREATE TABLE {s}.done_entries (
    ready_slot INTEGER NOT NULL,
    ready_generation BIGINT NOT NULL,
    job_id BIGINT NOT NULL,
    kind TEXT NOT NULL,
    queue TEXT NOT NULL,
    state {s}.job_state DEFAULT 'completed' NOT NULL,
    priority SMALLINT NOT NULL,
    attempt SMALLINT NOT NULL,
    run_lease BIGINT NOT NULL,
    lane_seq BIGINT NOT NULL,
    enqueue_shard SMALLINT DEFAULT 0 NOT NULL,
    attempted_at TIMESTAMP WITH TIME ZONE,
    finalized_at TIMESTAMP WITH TIME ZONE DEFAULT clock_timestamp() NOT NULL,
    args JSONB,
    max_attempts SMALLINT,
    run_at TIMESTAMP WITH TIME ZONE,
    created_at TIMESTAMP WITH TIME ZONE,
    unique_key BYTEA,
    unique_states TEXT,
    payload JSONB,
    CONSTRAINT done_entries_pkey PRIMARY KEY (queue, priority, enqueue_shard, lane_seq, ready_slot)
)
 PARTITION BY LIST (ready_slot)""",
        f"""CREATE INDEX done_entries_failed_idx ON {s}.done_entries (queue) WHERE state = 'failed'""",
        f"""CREATE INDEX done_entries_job_id_idx ON {s}.done_entries (job_id)""",
        f"""CREATE TABLE {s}.queue_terminal_count_deltas (
    ready_slot INTEGER NOT NULL,
    ready_generation BIGINT NOT NULL,
    queue TEXT NOT NULL,
    priority SMALLINT NOT NULL,
    enqueue_shard SMALLINT NOT NULL,
    counter_bucket SMALLINT NOT NULL,
    terminal_delta BIGINT NOT NULL,
    recorded_at TIMESTAMP WITH TIME ZONE DEFAULT clock_timestamp() NOT NULL,
    CONSTRAINT queue_terminal_count_deltas_nonzero CHECK (terminal_delta <> 0)
)
 PARTITION BY LIST (ready_slot)""",
        f"""CREATE INDEX queue_terminal_count_deltas_queue_idx ON {s}.queue_terminal_count_deltas (queue, priority)""",
        f"""CREATE TABLE {s}.deferred_jobs (
    job_id BIGINT NOT NULL,
    kind TEXT NOT NULL,
    queue TEXT NOT NULL,
    args JSONB DEFAULT '{{}}'::jsonb NOT NULL,
    state {s}.job_state DEFAULT 'scheduled' NOT NULL,
    priority SMALLINT NOT NULL,
    attempt SMALLINT DEFAULT 0 NOT NULL,
    run_lease BIGINT DEFAULT 0 NOT NULL,
    max_attempts SMALLINT DEFAULT 25 NOT NULL,
    run_at TIMESTAMP WITH TIME ZONE DEFAULT clock_timestamp() NOT NULL,
    attempted_at TIMESTAMP WITH TIME ZONE,
    finalized_at TIMESTAMP WITH TIME ZONE,
    created_at TIMESTAMP WITH TIME ZONE DEFAULT clock_timestamp() NOT NULL,
    unique_key BYTEA,
    unique_states TEXT,
    payload JSONB,
    PRIMARY KEY (job_id),
    CONSTRAINT deferred_jobs_state CHECK (state IN ('scheduled', 'retryable'))
)""",
        f"""CREATE INDEX deferred_jobs_unique_key_idx ON {s}.deferred_jobs (unique_key)""",
        f"""CREATE INDEX deferred_jobs_due_idx ON {s}.deferred_jobs (state, run_at, queue, priority, job_id)""",
        f"""CREATE TABLE {s}.dlq_entries (
    job_id BIGINT NOT NULL,
    kind TEXT NOT NULL,
    queue TEXT NOT NULL,
    args JSONB DEFAULT '{{}}'::jsonb NOT NULL,
    state {s}.job_state DEFAULT 'failed' NOT NULL,
    priority SMALLINT NOT NULL,
    attempt SMALLINT DEFAULT 1 NOT NULL,
    run_lease BIGINT DEFAULT 1 NOT NULL,
    max_attempts SMALLINT DEFAULT 25 NOT NULL,
    run_at TIMESTAMP WITH TIME ZONE DEFAULT clock_timestamp() NOT NULL,
    attempted_at TIMESTAMP WITH TIME ZONE,
    finalized_at TIMESTAMP WITH TIME ZONE,
    created_at TIMESTAMP WITH TIME ZONE DEFAULT clock_timestamp() NOT NULL,
    unique_key BYTEA,
    unique_states TEXT,
    payload JSONB,
    dlq_reason TEXT NOT NULL,
    dlq_at TIMESTAMP WITH TIME ZONE DEFAULT clock_timestamp() NOT NULL,
    original_run_lease BIGINT NOT NULL,
    PRIMARY KEY (job_id)
)""",
        f"""CREATE INDEX dlq_entries_kind_idx ON {s}.dlq_entries (kind)""",
        f"""CREATE INDEX dlq_entries_queue_idx ON {s}.dlq_entries (queue, dlq_at)""",
        f"""CREATE TABLE {s}.leases (
    lease_slot INTEGER NOT NULL,
    lease_generation BIGINT NOT NULL,
    ready_slot INTEGER NOT NULL,
    ready_generation BIGINT NOT NULL,
    job_id BIGINT NOT NULL,
    queue TEXT NOT NULL,
    state {s}.job_state DEFAULT 'running' NOT NULL,
    priority SMALLINT NOT NULL,
    effective_priority SMALLINT NOT NULL,
    attempt SMALLINT DEFAULT 1 NOT NULL,
    run_lease BIGINT DEFAULT 1 NOT NULL,
    max_attempts SMALLINT NOT NULL,
    lane_seq BIGINT NOT NULL,
    enqueue_shard SMALLINT DEFAULT 0 NOT NULL,
    claim_slot INTEGER,
    heartbeat_at TIMESTAMP WITH TIME ZONE,
    deadline_at TIMESTAMP WITH TIME ZONE,
    attempted_at TIMESTAMP WITH TIME ZONE,
    callback_id UUID,
    callback_timeout_at TIMESTAMP WITH TIME ZONE,
    CONSTRAINT leases_pkey PRIMARY KEY (queue, priority, enqueue_shard, lane_seq, lease_slot)
)
 PARTITION BY LIST (lease_slot)""",
        f"""CREATE INDEX leases_callback_idx ON {s}.leases (callback_id)""",
        f"""CREATE INDEX leases_attempt_idx ON {s}.leases (job_id, run_lease)""",
        f"""CREATE INDEX leases_ready_ref_idx ON {s}.leases (ready_slot, ready_generation)""",
        f"""CREATE INDEX leases_callback_timeout_idx ON {s}.leases (state, callback_timeout_at)""",
        f"""CREATE INDEX leases_deadline_idx ON {s}.leases (state, deadline_at)""",
        f"""CREATE TABLE {s}.lease_claims (
    claim_slot INTEGER NOT NULL,
    job_id BIGINT NOT NULL,
    run_lease BIGINT NOT NULL,
    ready_slot INTEGER NOT NULL,
    ready_generation BIGINT NOT NULL,
    queue TEXT NOT NULL,
    priority SMALLINT NOT NULL,
    effective_priority SMALLINT NOT NULL,
    attempt SMALLINT NOT NULL,
    max_attempts SMALLINT NOT NULL,
    lane_seq BIGINT NOT NULL,
    enqueue_shard SMALLINT NOT NULL,
    claimed_at TIMESTAMP WITH TIME ZONE DEFAULT clock_timestamp() NOT NULL,
    materialized_at TIMESTAMP WITH TIME ZONE,
    deadline_at TIMESTAMP WITH TIME ZONE,
    CONSTRAINT lease_claims_pkey PRIMARY KEY (job_id, run_lease, claim_slot)
)
 PARTITION BY LIST (claim_slot)""",
        f"""CREATE INDEX lease_claims_ready_ref_idx ON {s}.lease_claims (ready_slot, ready_generation)""",
        f"""CREATE INDEX lease_claims_deadline_idx ON {s}.lease_claims USING brin (deadline_at) WITH (pages_per_range = 16)""",
        f"""CREATE INDEX lease_claims_stale_idx ON {s}.lease_claims (materialized_at, claimed_at, job_id)""",
        f"""CREATE TABLE {s}.lease_claim_closures (
    claim_slot INTEGER NOT NULL,
    job_id BIGINT NOT NULL,
    run_lease BIGINT NOT NULL,
    outcome TEXT NOT NULL,
    closed_at TIMESTAMP WITH TIME ZONE DEFAULT clock_timestamp() NOT NULL,
    CONSTRAINT lease_claim_closures_pkey PRIMARY KEY (job_id, run_lease, claim_slot)
)
 PARTITION BY LIST (claim_slot)""",
        f"""CREATE TABLE {s}.attempt_state (
    job_id BIGINT NOT NULL,
    run_lease BIGINT NOT NULL,
    heartbeat_at TIMESTAMP WITH TIME ZONE,
    progress JSONB,
    callback_filter TEXT,
    callback_on_complete TEXT,
    callback_on_fail TEXT,
    callback_transform TEXT,
    callback_result JSONB,
    updated_at TIMESTAMP WITH TIME ZONE DEFAULT clock_timestamp() NOT NULL,
    CONSTRAINT attempt_state_pkey PRIMARY KEY (job_id, run_lease)
)
 WITH (fillfactor = 80, autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 50, autovacuum_vacuum_cost_limit = 2000, autovacuum_vacuum_cost_delay = 2)""",
        f"""CREATE TABLE {s}.queue_ring_state (
    singleton BOOLEAN DEFAULT true NOT NULL,
    current_slot INTEGER NOT NULL,
    generation BIGINT NOT NULL,
    slot_count INTEGER NOT NULL,
    terminal_counter_trusted_at TIMESTAMP WITH TIME ZONE,
    CONSTRAINT queue_ring_state_pkey PRIMARY KEY (singleton),
    CONSTRAINT queue_ring_state_singleton CHECK (singleton)
)
 WITH (fillfactor = 50, autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 50, autovacuum_vacuum_cost_limit = 2000, autovacuum_vacuum_cost_delay = 2)""",
        f"""CREATE TABLE {s}.queue_ring_slots (
    slot INTEGER NOT NULL,
    generation BIGINT NOT NULL,
    CONSTRAINT queue_ring_slots_pkey PRIMARY KEY (slot)
)
 WITH (fillfactor = 70, autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 50, autovacuum_vacuum_cost_limit = 2000, autovacuum_vacuum_cost_delay = 2)""",
        f"""CREATE TABLE {s}.lease_ring_state (
    singleton BOOLEAN DEFAULT true NOT NULL,
    current_slot INTEGER NOT NULL,
    generation BIGINT NOT NULL,
    slot_count INTEGER NOT NULL,
    CONSTRAINT lease_ring_state_pkey PRIMARY KEY (singleton),
    CONSTRAINT lease_ring_state_singleton CHECK (singleton)
)
 WITH (fillfactor = 50, autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 50, autovacuum_vacuum_cost_limit = 2000, autovacuum_vacuum_cost_delay = 2)""",
        f"""CREATE TABLE {s}.lease_ring_slots (
    slot INTEGER NOT NULL,
    generation BIGINT NOT NULL,
    CONSTRAINT lease_ring_slots_pkey PRIMARY KEY (slot)
)
 WITH (fillfactor = 70, autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 50, autovacuum_vacuum_cost_limit = 2000, autovacuum_vacuum_cost_delay = 2)""",
        f"""CREATE TABLE {s}.claim_ring_state (
    singleton BOOLEAN DEFAULT true NOT NULL,
    current_slot INTEGER NOT NULL,
    generation BIGINT NOT NULL,
    slot_count INTEGER NOT NULL,
    CONSTRAINT claim_ring_state_pkey PRIMARY KEY (singleton),
    CONSTRAINT claim_ring_state_singleton CHECK (singleton)
)
 WITH (fillfactor = 50, autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 50, autovacuum_vacuum_cost_limit = 2000, autovacuum_vacuum_cost_delay = 2)""",
        f"""CREATE TABLE {s}.claim_ring_slots (
    slot INTEGER NOT NULL,
    generation BIGINT NOT NULL,
    CONSTRAINT claim_ring_slots_pkey PRIMARY KEY (slot)
)
 WITH (fillfactor = 70, autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 50, autovacuum_vacuum_cost_limit = 2000, autovacuum_vacuum_cost_delay = 2)""",
        f"""CREATE TABLE {s}.queue_lanes (
    queue TEXT NOT NULL,
    priority SMALLINT NOT NULL,
    created_at TIMESTAMP WITH TIME ZONE DEFAULT clock_timestamp() NOT NULL,
    CONSTRAINT queue_lanes_pkey PRIMARY KEY (queue, priority)
)""",
        f"""CREATE TABLE {s}.queue_enqueue_heads (
    queue TEXT NOT NULL,
    priority SMALLINT NOT NULL,
    enqueue_shard SMALLINT NOT NULL,
    enqueue_seq REGCLASS NOT NULL,
    CONSTRAINT queue_enqueue_heads_pkey PRIMARY KEY (queue, priority, enqueue_shard)
)
 WITH (fillfactor = 50, autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 50, autovacuum_vacuum_cost_limit = 2000, autovacuum_vacuum_cost_delay = 2)""",
        f"""CREATE TABLE {s}.queue_claim_heads (
    queue TEXT NOT NULL,
    priority SMALLINT NOT NULL,
    enqueue_shard SMALLINT NOT NULL,
    logical_queue TEXT NOT NULL,
    enqueue_seq REGCLASS NOT NULL,
    claim_seq REGCLASS NOT NULL,
    CONSTRAINT queue_claim_heads_pkey PRIMARY KEY (queue, priority, enqueue_shard)
)
 WITH (fillfactor = 50, autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 50, autovacuum_vacuum_cost_limit = 2000, autovacuum_vacuum_cost_delay = 2)""",
        f"""CREATE INDEX queue_claim_heads_logical_idx ON {s}.queue_claim_heads (logical_queue)""",
        f"""CREATE TABLE {s}.queue_terminal_live_counts (
    ready_slot INTEGER NOT NULL,
    queue TEXT NOT NULL,
    priority SMALLINT NOT NULL,
    enqueue_shard SMALLINT NOT NULL,
    counter_bucket SMALLINT NOT NULL,
    live_terminal_count BIGINT DEFAULT 0 NOT NULL,
    CONSTRAINT queue_terminal_live_counts_pkey PRIMARY KEY (ready_slot, queue, priority, enqueue_shard, counter_bucket)
)
 WITH (fillfactor = 50)""",
        f"""CREATE INDEX queue_terminal_live_counts_queue_idx ON {s}.queue_terminal_live_counts (queue, priority)""",
        f"""CREATE TABLE {s}.queue_terminal_rollups (
    queue TEXT NOT NULL,
    priority SMALLINT NOT NULL,
    pruned_completed_count BIGINT DEFAULT 0 NOT NULL,
    CONSTRAINT queue_terminal_rollups_pkey PRIMARY KEY (queue, priority)
)""",
        f"""CREATE TABLE {s}.queue_meta (
    queue TEXT NOT NULL,
    paused BOOLEAN DEFAULT false NOT NULL,
    paused_at TIMESTAMP WITH TIME ZONE,
    paused_by TEXT,
    enqueue_shards SMALLINT DEFAULT 1 NOT NULL,
    CONSTRAINT queue_meta_pkey PRIMARY KEY (queue),
    CONSTRAINT queue_meta_enqueue_shards CHECK (enqueue_shards BETWEEN 1 AND 64)
)""",
        f"""CREATE TABLE {s}.job_unique_claims (
    unique_key BYTEA NOT NULL,
    job_id BIGINT NOT NULL,
    CONSTRAINT job_unique_claims_unique_key_key UNIQUE (unique_key)
)""",
        f"""CREATE INDEX job_unique_claims_job_idx ON {s}.job_unique_claims (job_id)""",
        f"""CREATE TABLE {s}.queue_claimer_leases (
    queue TEXT NOT NULL,
    claimer_slot SMALLINT NOT NULL,
    owner_instance_id UUID NOT NULL,
    lease_epoch BIGINT DEFAULT 0 NOT NULL,
    leased_at TIMESTAMP WITH TIME ZONE DEFAULT clock_timestamp() NOT NULL,
    last_claimed_at TIMESTAMP WITH TIME ZONE DEFAULT clock_timestamp() NOT NULL,
    expires_at TIMESTAMP WITH TIME ZONE NOT NULL,
    CONSTRAINT queue_claimer_leases_pkey PRIMARY KEY (queue, claimer_slot)
)
 WITH (fillfactor = 50, autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 50, autovacuum_vacuum_cost_limit = 2000, autovacuum_vacuum_cost_delay = 2)""",
        f"""CREATE INDEX queue_claimer_leases_owner_idx ON {s}.queue_claimer_leases (queue, owner_instance_id)""",
        f"""CREATE TABLE {s}.queue_claimer_state (
    queue TEXT NOT NULL,
    target_claimers SMALLINT NOT NULL,
    updated_at TIMESTAMP WITH TIME ZONE DEFAULT clock_timestamp() NOT NULL,
    CONSTRAINT queue_claimer_state_pkey PRIMARY KEY (queue)
)
 WITH (fillfactor = 50, autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 50, autovacuum_vacuum_cost_limit = 2000, autovacuum_vacuum_cost_delay = 2)""",
        f"""CREATE TABLE {s}.storage_config (
    singleton BOOLEAN DEFAULT true NOT NULL,
    schema_name TEXT NOT NULL,
    queue_slot_count INTEGER NOT NULL,
    lease_slot_count INTEGER NOT NULL,
    claim_slot_count INTEGER NOT NULL,
    queue_stripe_count INTEGER NOT NULL,
    lease_claim_receipts BOOLEAN NOT NULL,
    installed_at TIMESTAMP WITH TIME ZONE DEFAULT clock_timestamp() NOT NULL,
    CONSTRAINT storage_config_pkey PRIMARY KEY (singleton),
    CONSTRAINT storage_config_singleton CHECK (singleton)
)""",
        f"""CREATE TABLE {s}.runtime_storage_backends (
    backend TEXT NOT NULL,
    schema_name TEXT NOT NULL,
    updated_at TIMESTAMP WITH TIME ZONE DEFAULT clock_timestamp() NOT NULL,
    CONSTRAINT runtime_storage_backends_pkey PRIMARY KEY (backend)
)""",
        f"""CREATE TABLE {s}.storage_transition_state (
    singleton BOOLEAN DEFAULT true NOT NULL,
    current_engine TEXT DEFAULT 'queue_storage' NOT NULL,
    prepared_engine TEXT,
    state TEXT DEFAULT 'prepared' NOT NULL,
    transition_epoch BIGINT DEFAULT 0 NOT NULL,
    details JSONB DEFAULT '{{}}'::jsonb NOT NULL,
    updated_at TIMESTAMP WITH TIME ZONE DEFAULT clock_timestamp() NOT NULL,
    CONSTRAINT storage_transition_state_pkey PRIMARY KEY (singleton),
    CONSTRAINT storage_transition_state_singleton CHECK (singleton),
    CONSTRAINT storage_transition_state_state CHECK (state IN ('canonical', 'prepared', 'mixed_transition', 'active'))
)""",
    ]

def _functions(s: str) -> list[str]:
    return [
        f"""CREATE OR REPLACE FUNCTION {s}.backoff_duration(attempt integer, max_attempts integer) RETURNS interval LANGUAGE sql VOLATILE AS $$
  SELECT least(
    make_interval(secs => power(2, least(attempt, 17))::double precision
                          * (1 + random() * 0.25)),
    interval '24 hours')
$$""",
        f"""CREATE OR REPLACE FUNCTION {s}.ensure_lane(p_queue text, p_logical text, p_priority smallint, p_shard smallint) RETURNS void LANGUAGE plpgsql VOLATILE AS $$
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
        f"""CREATE OR REPLACE FUNCTION {s}.reserve_lanes(p_queues text[], p_logicals text[], p_priorities smallint[], p_shards smallint[], p_counts integer[]) RETURNS bigint[] LANGUAGE plpgsql VOLATILE AS $$
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
        f"""CREATE OR REPLACE FUNCTION {s}.claim_ready(p_queue text, p_max integer, p_deadline_ms bigint, p_aging_ms bigint, p_receipts boolean) RETURNS TABLE(claim_slot integer, lease_slot integer, lease_generation bigint, ready_slot integer, ready_generation bigint, queue text, priority smallint, effective_priority smallint, enqueue_shard smallint, lane_seq bigint, job_id bigint, run_lease bigint, attempt smallint, max_attempts smallint, kind text, args jsonb, run_at timestamptz, created_at timestamptz, claimed_at timestamptz, deadline_at timestamptz, unique_key bytea, unique_states text, payload jsonb) LANGUAGE plpgsql VOLATILE
SET jit = off SET plan_cache_mode = force_generic_plan AS $$
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
BEGIN
  IF p_max <= 0 THEN RETURN; END IF;
  IF EXISTS (SELECT 1 FROM {s}.queue_meta m WHERE m.queue = v_logical AND m.paused) THEN
    RETURN;
  END IF;
  FOR v_lane IN
    SELECT h.priority AS lane_priority, h.enqueue_shard AS shard, h.claim_seq, h.enqueue_seq
    FROM {s}.queue_claim_heads h
    CROSS JOIN LATERAL (
      SELECT coalesce(pg_sequence_last_value(h.claim_seq), 0) + 1 AS claim_next,
             coalesce(pg_sequence_last_value(h.enqueue_seq), 0) + 1 AS enqueue_next) cur
    LEFT JOIN LATERAL (
      -- the head candidate's age, needed only to order lanes by aged priority
      SELECT r.run_at FROM {s}.ready_entries r
      WHERE p_aging_ms > 0
        AND r.queue = h.queue AND r.priority = h.priority AND r.enqueue_shard = h.enqueue_shard
        AND r.lane_seq >= cur.claim_next
        AND NOT EXISTS (
          SELECT 1 FROM {s}.ready_tombstones t
          WHERE t.ready_slot = r.ready_slot AND t.queue = r.queue AND t.priority = r.priority
            AND t.enqueue_shard = r.enqueue_shard AND t.lane_seq = r.lane_seq)
      ORDER BY r.lane_seq LIMIT 1) head ON true
    WHERE h.queue = p_queue AND cur.enqueue_next > cur.claim_next
    ORDER BY
      CASE WHEN p_aging_ms <= 0 THEN h.priority
           WHEN head.run_at IS NULL THEN NULL
           ELSE greatest(1, h.priority - floor(
             extract(epoch FROM (v_now - head.run_at)) * 1000 / p_aging_ms)::integer)
      END NULLS LAST,
      head.run_at NULLS LAST, h.priority, random()
  LOOP
    EXIT WHEN v_remaining <= 0;
    PERFORM 1 FROM {s}.queue_claim_heads h
      WHERE h.queue = p_queue AND h.priority = v_lane.lane_priority
        AND h.enqueue_shard = v_lane.shard
      FOR UPDATE SKIP LOCKED;
    CONTINUE WHEN NOT FOUND;
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
      -- follow the committed chain of claim ranges
      LOOP
        SELECT cr.last_seq INTO v_next FROM {s}.ready_claim_ranges cr
          WHERE cr.queue = p_queue AND cr.priority = v_lane.lane_priority
            AND cr.enqueue_shard = v_lane.shard AND cr.first_seq = v_pos;
        EXIT WHEN NOT FOUND;
        v_pos := v_next + 1;
      END LOOP;
      SELECT r.ready_slot, r.ready_generation, r.lane_seq
        INTO v_seg_slot, v_seg_gen, v_seg_first
        FROM {s}.ready_entries r
        WHERE r.queue = p_queue AND r.priority = v_lane.lane_priority
          AND r.enqueue_shard = v_lane.shard AND r.lane_seq >= v_pos
        ORDER BY r.lane_seq LIMIT 1;
      v_found := FOUND;
      EXIT WHEN NOT v_found OR v_seg_first = v_pos;
      -- Positions before the first committed row are spent: aborted reservations (a producer
      -- holds the lane reservation lock until it commits, so a later row implies earlier
      -- ones ended) or history a prune truncated together with its claim ranges. The first
      -- row may itself start a committed range (its predecessors were pruned): re-follow.
      v_pos := v_seg_first;
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
      SELECT r.*, EXISTS (
               SELECT 1 FROM {s}.ready_tombstones t
               WHERE t.ready_slot = r.ready_slot AND t.queue = r.queue
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
END
$$""",
        f"""CREATE OR REPLACE FUNCTION {s}.complete_receipts(p_claim_slots integer[], p_job_ids bigint[], p_run_leases bigint[]) RETURNS TABLE(job_id bigint, run_lease bigint) LANGUAGE plpgsql VOLATILE
SET jit = off SET plan_cache_mode = force_generic_plan AS $$
BEGIN
  RETURN QUERY
  WITH input AS (
    SELECT DISTINCT i.claim_slot, i.job_id, i.run_lease
    FROM unnest(p_claim_slots, p_job_ids, p_run_leases) AS i(claim_slot, job_id, run_lease)
    ORDER BY i.job_id, i.run_lease, i.claim_slot
  ), locked AS (
    SELECT c.*
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
    SELECT l.ready_slot, l.ready_generation, l.job_id, r.kind, l.queue, 'completed',
           l.priority, l.attempt, l.run_lease, l.lane_seq, l.enqueue_shard, l.claimed_at,
           clock_timestamp()
    FROM locked l
    JOIN closed c ON c.claim_slot = l.claim_slot AND c.job_id = l.job_id
                 AND c.run_lease = l.run_lease
    JOIN {s}.ready_entries r ON r.ready_slot = l.ready_slot AND r.queue = l.queue
                            AND r.priority = l.priority AND r.enqueue_shard = l.enqueue_shard
                            AND r.lane_seq = l.lane_seq
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
$$""",
    ]

def _views(s: str) -> list[str]:
    return [
        f"""CREATE OR REPLACE VIEW {s}.terminal_jobs AS SELECT d.job_id, d.kind, d.queue, d.state, d.priority, d.attempt, d.run_lease,
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
    ]

#: (family, storage parameters of each child, which slot count sizes it)
_CHILDREN = (
    ("ready_entries", "", "queue"),
    ("ready_tombstones", "", "queue"),
    ("ready_claim_ranges", "", "queue"),
    ("done_entries", "", "queue"),
    ("queue_terminal_count_deltas", "", "queue"),
    ("leases", " WITH (fillfactor = 50, autovacuum_vacuum_scale_factor = 0, "
     "autovacuum_vacuum_threshold = 200, autovacuum_vacuum_cost_limit = 2000, "
     "autovacuum_vacuum_cost_delay = 2)", "lease"),
    ("lease_claims", " WITH (fillfactor = 50)", "claim"),
    ("lease_claim_closures", "", "claim"),
)

#: Tables in creation order (dropped in reverse); partition children go with their parent.
_TABLES = (
    "ready_entries", "ready_tombstones", "ready_claim_ranges", "done_entries",
    "queue_terminal_count_deltas", "deferred_jobs", "dlq_entries", "leases", "lease_claims",
    "lease_claim_closures", "attempt_state", "queue_ring_state", "queue_ring_slots",
    "lease_ring_state", "lease_ring_slots", "claim_ring_state", "claim_ring_slots",
    "queue_lanes", "queue_enqueue_heads", "queue_claim_heads", "queue_terminal_live_counts",
    "queue_terminal_rollups", "queue_meta", "job_unique_claims", "queue_claimer_leases",
    "queue_claimer_state", "storage_config", "runtime_storage_backends",
    "storage_transition_state",
)

FUNCTION_SIGNATURES = (
    "backoff_duration(attempt integer, max_attempts integer)",
    "ensure_lane(p_queue text, p_logical text, p_priority smallint, p_shard smallint)",
    "reserve_lanes(p_queues text[], p_logicals text[], p_priorities smallint[], "
    "p_shards smallint[], p_counts integer[])",
    "claim_ready(p_queue text, p_max integer, p_deadline_ms bigint, p_aging_ms bigint, "
    "p_receipts boolean)",
    "complete_receipts(p_claim_slots integer[], p_job_ids bigint[], p_run_leases bigint[])",
)


def _slots(shape: Shape, ring: str) -> int:
    return {"queue": shape.queue_slot_count, "lease": shape.lease_slot_count,
            "claim": shape.claim_slot_count}[ring]


def _children(shape: Shape) -> list[str]:
    s = shape.schema
    return [
        f"CREATE TABLE {s}.{family}_{k} PARTITION OF {s}.{family} FOR VALUES IN ({k}){with_}"
        for family, with_, ring in _CHILDREN for k in range(_slots(shape, ring))
    ]


def _seed(shape: Shape) -> list[str]:
    s = shape.schema
    out = []
    for ring, trusted in (("queue", True), ("lease", False), ("claim", False)):
        n = _slots(shape, ring)
        if trusted:
            out.append(f"INSERT INTO {s}.{ring}_ring_state (current_slot, generation, slot_count, "
                       f"terminal_counter_trusted_at) VALUES (0, 0, {n}, clock_timestamp())")
        else:
            out.append(f"INSERT INTO {s}.{ring}_ring_state (current_slot, generation, slot_count) "
                       f"VALUES (0, 0, {n})")
        rows = ", ".join(f"({k}, {0 if k == 0 else -1})" for k in range(n))
        out.append(f"INSERT INTO {s}.{ring}_ring_slots (slot, generation) VALUES {rows}")
    receipts = "true" if shape.lease_claim_receipts else "false"
    out.append(
        f"INSERT INTO {s}.storage_config (schema_name, queue_slot_count, lease_slot_count, "
        f"claim_slot_count, queue_stripe_count, lease_claim_receipts) VALUES ('{s}', "
        f"{shape.queue_slot_count}, {shape.lease_slot_count}, {shape.claim_slot_count}, "
        f"{shape.queue_stripe_count}, {receipts})")
    out.append(f"INSERT INTO {s}.storage_transition_state DEFAULT VALUES")
    return out


def upgrade(shape: Shape) -> list[str]:
    """Create the schema (if missing) and every object of the install, and seed them."""
    s = shape.schema
    return [f"CREATE SCHEMA IF NOT EXISTS {s}", *_tables(s), *_children(shape), *_seed(shape),
            *_functions(s), *_views(s)]


def downgrade(shape: Shape) -> list[str]:
    """Drop everything :func:`upgrade` created, the per-lane sequences the install made at
    runtime, and the schema itself when nothing else (such as a version table) is left."""
    s = shape.schema
    return [
        f"DROP VIEW IF EXISTS {s}.terminal_jobs",
        *(f"DROP FUNCTION IF EXISTS {s}.{sig}" for sig in FUNCTION_SIGNATURES),
        drop_lane_sequences(s),
        *(f"DROP TABLE {s}.{t}" for t in reversed(_TABLES)),
        f"DROP SEQUENCE {s}.job_id_seq",
        f"DROP TYPE {s}.job_state",
        drop_schema_if_empty(s),
    ]


def drop_lane_sequences(s: str) -> str:
    """A statement dropping the per-lane cursor sequences created at runtime."""
    return f"""DO $qstore$
DECLARE
  r record;
BEGIN
  FOR r IN SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
           WHERE n.nspname = '{s}' AND c.relkind = 'S'
             AND (c.relname LIKE 'queue\\_enqueue\\_seq\\_%' OR c.relname LIKE 'queue\\_claim\\_seq\\_%')
  LOOP
    EXECUTE format('DROP SEQUENCE %I.%I', '{s}', r.relname);
  END LOOP;
END
$qstore$"""


def drop_schema_if_empty(s: str) -> str:
    """A statement dropping schema ``s`` if it holds no relation and no enum type."""
    return f"""DO $qstore$
BEGIN
  IF NOT EXISTS (SELECT 1 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                 WHERE n.nspname = '{s}')
     AND NOT EXISTS (SELECT 1 FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace
                     WHERE n.nspname = '{s}' AND t.typtype = 'e') THEN
    EXECUTE 'DROP SCHEMA {s}';
  END IF;
END
$qstore$"""




def claim_and_complete(s: str) -> tuple[str, str]:
    """The ``claim_ready`` and ``complete_receipts`` (three arrays) statements of this
    revision, for the downgrade of a later revision that replaced them."""
    functions = _functions(s)
    return functions[3], functions[4]


def function_statements(s: str) -> list[str]:
    """This revision's ``CREATE OR REPLACE FUNCTION`` statements, in creation order
    (``backoff_duration``, ``ensure_lane``, ``reserve_lanes``, ``claim_ready``,
    ``complete_receipts``), for later revisions and the head declaration to reuse."""
    return _functions(s)


def view_statements(s: str) -> list[str]:
    """This revision's ``CREATE OR REPLACE VIEW`` statements (``terminal_jobs``)."""
    return _views(s)


def ring_table_statements(s: str) -> dict[str, str]:
    """The ``CREATE TABLE`` statements of the ring cursor tables (``<ring>_ring_state`` and
    ``<ring>_ring_slots``) by table name, for a later revision's downgrade to recreate."""
    out = {}
    for statement in _tables(s):
        for ring in ("queue", "lease", "claim"):
            for kind in ("state", "slots"):
                name = f"{ring}_ring_{kind}"
                if statement.startswith(f"CREATE TABLE {s}.{name} ("):
                    out[name] = statement
    return out
