## enqueue_job: one job in one server call, with scalar arguments.
##
## What enqueue_jobs does for a batch of one, without its arrays and without the nested
## calls of the batch path: the lane's enqueue sequence is read straight from its head row
## (ensure_lane runs only for a lane that does not exist yet), and the lane's reservation
## lock is the same advisory lock reserve_lanes takes, so single and batch producers
## serialise on one lock per lane and a committed row at lane position p still implies that
## every position below p was committed or aborted.
##
## Takes the unique key (a key another job owns makes the call write nothing and return the
## key and its owner; a released key is taken over in place, as in enqueue_jobs), then
## writes the ready row into the queue ring's current slot, or the scheduled row into the
## deferred wheel (its overflow, deferred_jobs, when due beyond the wheel's span), and
## queues the NOTIFY on p_channel when one is given. Lane choice as in enqueue_jobs: an
## ordering key's hash % shards, else one nextval of lane_rotor % shards.
##
## No SET clause: a function with one pays for saving and restoring the setting on every
## call, and none of these statements is costly enough for JIT to start.
##
## Template parameters: s (schema), default_shards, wheel_slots.
CREATE OR REPLACE FUNCTION ${s}.enqueue_job(p_kind text, p_queue text, p_logical text, p_args jsonb, p_priority smallint, p_max_attempts smallint, p_run_at timestamp with time zone, p_unique_key bytea, p_unique_states text, p_payload jsonb, p_takes_key boolean, p_order_hash numeric, p_channel text) RETURNS TABLE(job_id bigint, conflict_key bytea, conflict_owner bigint) LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
  v_id bigint := nextval('${s}.job_id_seq'::regclass);
  v_shard_count integer;
  v_shard smallint;
  v_seq regclass;
  v_bucket bigint;
BEGIN
  IF p_takes_key THEN
    INSERT INTO ${s}.job_unique_claims AS c (unique_key, job_id) VALUES (p_unique_key, v_id)
      ON CONFLICT (unique_key) DO UPDATE SET job_id = excluded.job_id
      WHERE EXISTS (SELECT 1 FROM ${s}.job_unique_releases r WHERE r.claim_id = c.claim_id);
    IF NOT FOUND THEN
      RETURN QUERY SELECT NULL::bigint, p_unique_key,
        (SELECT c.job_id FROM ${s}.job_unique_claims c
         WHERE c.unique_key = p_unique_key
           AND NOT EXISTS (SELECT 1 FROM ${s}.job_unique_releases r
                           WHERE r.claim_id = c.claim_id));
      RETURN;
    END IF;
  END IF;

  IF p_run_at IS NULL THEN
    v_shard_count := coalesce((SELECT m.enqueue_shards FROM ${s}.queue_meta m
                               WHERE m.queue = p_logical), ${default_shards});
    v_shard := (CASE WHEN v_shard_count <= 1 THEN 0
                     WHEN p_order_hash IS NOT NULL THEN p_order_hash % v_shard_count
                     ELSE nextval('${s}.lane_rotor'::regclass) % v_shard_count END)::smallint;
    SELECT h.enqueue_seq INTO v_seq FROM ${s}.queue_enqueue_heads h
      WHERE h.queue = p_queue AND h.priority = p_priority AND h.enqueue_shard = v_shard;
    IF NOT FOUND THEN
      PERFORM ${s}.ensure_lane(p_queue, p_logical, p_priority, v_shard);
      SELECT h.enqueue_seq INTO STRICT v_seq FROM ${s}.queue_enqueue_heads h
        WHERE h.queue = p_queue AND h.priority = p_priority AND h.enqueue_shard = v_shard;
    END IF;
    -- the lane's reservation lock (reserve_lanes takes the same one), held until commit
    PERFORM pg_advisory_xact_lock(hashtextextended(
      '${s}:reserve:' || p_queue || ':' || p_priority || ':' || v_shard, 0));
    INSERT INTO ${s}.ready_entries (ready_slot, ready_generation, job_id, kind, queue, args,
                                   priority, max_attempts, lane_seq, enqueue_shard,
                                   unique_key, unique_states, payload)
    SELECT rs.current_slot, rs.generation, v_id, p_kind, p_queue, coalesce(p_args, '{}'::jsonb),
           p_priority, p_max_attempts, nextval(v_seq), v_shard, p_unique_key, p_unique_states,
           p_payload
    FROM ${s}.queue_ring_state rs;
  ELSE
    v_bucket := ${s}.wheel_bucket(p_run_at);
    IF v_bucket IS NOT NULL THEN
      INSERT INTO ${s}.deferred_wheel (wheel_slot, bucket, job_id, kind, queue, args, state,
                                      priority, max_attempts, run_at, unique_key,
                                      unique_states, payload)
      VALUES ((v_bucket % ${wheel_slots})::smallint, v_bucket, v_id, p_kind, p_queue,
              coalesce(p_args, '{}'::jsonb), 'scheduled', p_priority, p_max_attempts, p_run_at,
              p_unique_key, p_unique_states, p_payload);
    ELSE
      INSERT INTO ${s}.deferred_jobs (job_id, kind, queue, args, state, priority, max_attempts,
                                     run_at, unique_key, unique_states, payload)
      VALUES (v_id, p_kind, p_queue, coalesce(p_args, '{}'::jsonb), 'scheduled', p_priority,
              p_max_attempts, p_run_at, p_unique_key, p_unique_states, p_payload);
    END IF;
  END IF;

  IF p_channel IS NOT NULL THEN
    PERFORM pg_notify(p_channel, '');
  END IF;
  RETURN QUERY SELECT v_id, NULL::bytea, NULL::bigint;
END
$$
