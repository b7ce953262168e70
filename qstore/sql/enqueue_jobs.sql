## enqueue_jobs: a whole enqueue in one server call.
##
## Allocates the ids, takes the unique keys (a key another job owns makes the call write
## nothing and return the key and its owner instead of raising, so a caller's transaction
## stays usable; a key whose claim was released, a row in job_unique_releases, is free and
## taken over in place: the row lock makes one of concurrent takers win, and the others
## re-check the row the winner wrote, whose new claim_id no release names), picks each ready row's lane, reserves lane positions in the lock order
## every producer follows (queue in byte order, then priority, then shard), inserts ready
## rows into the queue ring's current slot and scheduled rows into the deferred wheel (or
## its overflow, deferred_jobs, when due beyond the wheel's span), and queues
## the NOTIFY wake-ups. On an autocommitted connection a single-job enqueue is one round
## trip; a single job takes a scalar branch (about a third of the set-based branch's cost).
##
## Lane choice: a row with an ordering key goes to `ordering hash % shards`; the key-less
## ready rows of one call share the lane `rotor % shards`, where rotor is one nextval of
## lane_rotor per call, so consecutive enqueues go round-robin over the lanes while one
## batch stays FIFO in one lane. A queue without a queue_meta row has default_shards lanes.
##
## Template parameters: s (schema), default_shards, wheel_slots.
CREATE OR REPLACE FUNCTION ${s}.enqueue_jobs(p_kinds text[], p_queues text[], p_logicals text[], p_args jsonb[], p_priorities smallint[], p_max_attempts smallint[], p_run_ats timestamp with time zone[], p_unique_keys bytea[], p_unique_states text[], p_payloads jsonb[], p_takes_key boolean[], p_order_hashes numeric[], p_channels text[]) RETURNS TABLE(job_ids bigint[], conflict_key bytea, conflict_owner bigint) LANGUAGE plpgsql VOLATILE
SET jit = off AS $$
#variable_conflict use_column
DECLARE
  v_n integer := coalesce(array_length(p_kinds, 1), 0);
  v_ids bigint[];
  v_wanted integer;
  v_taken integer;
  v_ords integer[];
  v_shards smallint[];
  v_lq text[];
  v_ll text[];
  v_lp smallint[];
  v_ls smallint[];
  v_lc integer[];
  v_starts bigint[];
  v_rotor bigint;
  v_id bigint;
  v_shard_count integer;
  v_shard smallint;
  v_bucket bigint;
BEGIN
  IF v_n = 0 THEN
    RETURN QUERY SELECT '{}'::bigint[], NULL::bytea, NULL::bigint;
    RETURN;
  END IF;

  IF v_n = 1 THEN
    -- one job: the same steps without the set-based machinery
    v_id := nextval('${s}.job_id_seq'::regclass);
    IF p_takes_key[1] THEN
      INSERT INTO ${s}.job_unique_claims AS c (unique_key, job_id) VALUES (p_unique_keys[1], v_id)
        ON CONFLICT (unique_key) DO UPDATE SET job_id = excluded.job_id
        WHERE EXISTS (SELECT 1 FROM ${s}.job_unique_releases r WHERE r.claim_id = c.claim_id);
      IF NOT FOUND THEN
        RETURN QUERY SELECT NULL::bigint[], p_unique_keys[1],
          (SELECT c.job_id FROM ${s}.job_unique_claims c
           WHERE c.unique_key = p_unique_keys[1]
             AND NOT EXISTS (SELECT 1 FROM ${s}.job_unique_releases r
                             WHERE r.claim_id = c.claim_id));
        RETURN;
      END IF;
    END IF;
    IF p_run_ats[1] IS NULL THEN
      v_shard_count := coalesce((SELECT m.enqueue_shards FROM ${s}.queue_meta m
                                 WHERE m.queue = p_logicals[1]), ${default_shards});
      v_shard := (CASE WHEN v_shard_count <= 1 THEN 0
                       WHEN p_order_hashes[1] IS NOT NULL THEN p_order_hashes[1] % v_shard_count
                       ELSE nextval('${s}.lane_rotor'::regclass) % v_shard_count END)::smallint;
      v_starts := ${s}.reserve_lanes(ARRAY[p_queues[1]], ARRAY[p_logicals[1]], ARRAY[p_priorities[1]],
                                    ARRAY[v_shard], ARRAY[1]);
      INSERT INTO ${s}.ready_entries (ready_slot, ready_generation, job_id, kind, queue, args,
                                     priority, max_attempts, lane_seq, enqueue_shard,
                                     unique_key, unique_states, payload)
      SELECT rs.current_slot, rs.generation, v_id, p_kinds[1], p_queues[1],
             coalesce(p_args[1], '{}'::jsonb), p_priorities[1], p_max_attempts[1], v_starts[1],
             v_shard, p_unique_keys[1], p_unique_states[1], p_payloads[1]
      FROM ${s}.queue_ring_state rs;
    ELSE
      v_bucket := ${s}.wheel_bucket(p_run_ats[1]);
      IF v_bucket IS NOT NULL THEN
        INSERT INTO ${s}.deferred_wheel (wheel_slot, bucket, job_id, kind, queue, args, state,
                                        priority, max_attempts, run_at, unique_key,
                                        unique_states, payload)
        VALUES ((v_bucket % ${wheel_slots})::smallint, v_bucket, v_id, p_kinds[1], p_queues[1],
                coalesce(p_args[1], '{}'::jsonb), 'scheduled', p_priorities[1],
                p_max_attempts[1], p_run_ats[1], p_unique_keys[1], p_unique_states[1],
                p_payloads[1]);
      ELSE
        INSERT INTO ${s}.deferred_jobs (job_id, kind, queue, args, state, priority, max_attempts,
                                       run_at, unique_key, unique_states, payload)
        VALUES (v_id, p_kinds[1], p_queues[1], coalesce(p_args[1], '{}'::jsonb), 'scheduled',
                p_priorities[1], p_max_attempts[1], p_run_ats[1], p_unique_keys[1],
                p_unique_states[1], p_payloads[1]);
      END IF;
    END IF;
    PERFORM pg_notify(c.channel, '') FROM unnest(p_channels) AS c(channel);
    RETURN QUERY SELECT ARRAY[v_id], NULL::bytea, NULL::bigint;
    RETURN;
  END IF;
  v_ids := ARRAY(SELECT nextval('${s}.job_id_seq'::regclass) FROM generate_series(1, v_n));

  SELECT count(*) INTO v_wanted FROM unnest(p_takes_key) AS t(takes) WHERE t.takes;
  IF v_wanted > 0 THEN
    -- a key named twice in the call is taken once (the other row then reports a conflict)
    WITH ins AS (
      INSERT INTO ${s}.job_unique_claims AS c (unique_key, job_id)
      SELECT DISTINCT ON (k.key) k.key, k.id
      FROM unnest(p_unique_keys, v_ids, p_takes_key) AS k(key, id, takes)
      WHERE k.takes
      ORDER BY k.key, k.id
      ON CONFLICT (unique_key) DO UPDATE SET job_id = excluded.job_id
        WHERE EXISTS (SELECT 1 FROM ${s}.job_unique_releases r WHERE r.claim_id = c.claim_id)
      RETURNING 1)
    SELECT count(*) INTO v_taken FROM ins;
    IF v_taken < v_wanted THEN
      -- this call's own claims go (keys it took over included: they were free)
      DELETE FROM ${s}.job_unique_claims c WHERE c.job_id = ANY (v_ids);
      RETURN QUERY
        SELECT NULL::bigint[], k.key, o.job_id
        FROM unnest(p_unique_keys, p_takes_key) WITH ORDINALITY AS k(key, takes, ord)
        JOIN ${s}.job_unique_claims o ON o.unique_key = k.key
        WHERE k.takes
          AND NOT EXISTS (SELECT 1 FROM ${s}.job_unique_releases r WHERE r.claim_id = o.claim_id)
        ORDER BY k.ord LIMIT 1;
      IF NOT FOUND THEN
        RETURN QUERY SELECT NULL::bigint[], NULL::bytea, NULL::bigint;
      END IF;
      RETURN;
    END IF;
  END IF;

  IF EXISTS (SELECT 1 FROM unnest(p_run_ats, p_order_hashes) AS u(run_at, hash)
             WHERE u.run_at IS NULL AND u.hash IS NULL) THEN
    v_rotor := nextval('${s}.lane_rotor'::regclass);
  END IF;
  SELECT array_agg(x.ord ORDER BY x.ord), array_agg(x.shard ORDER BY x.ord)
    INTO v_ords, v_shards
  FROM (
    SELECT r.ord,
           (CASE WHEN r.shards <= 1 THEN 0
                 WHEN r.hash IS NOT NULL THEN r.hash % r.shards
                 ELSE v_rotor % r.shards
            END)::smallint AS shard
    FROM (
      SELECT u.ord, u.queue, u.priority, u.hash,
             coalesce(m.enqueue_shards, ${default_shards}) AS shards
      FROM unnest(p_queues, p_logicals, p_priorities, p_order_hashes, p_run_ats)
             WITH ORDINALITY AS u(queue, logical, priority, hash, run_at, ord)
      LEFT JOIN ${s}.queue_meta m ON m.queue = u.logical
      WHERE u.run_at IS NULL) r) x;

  IF v_ords IS NOT NULL THEN
    SELECT array_agg(l.queue ORDER BY l.queue COLLATE "C", l.priority, l.shard),
           array_agg(l.logical ORDER BY l.queue COLLATE "C", l.priority, l.shard),
           array_agg(l.priority ORDER BY l.queue COLLATE "C", l.priority, l.shard),
           array_agg(l.shard ORDER BY l.queue COLLATE "C", l.priority, l.shard),
           array_agg(l.n ORDER BY l.queue COLLATE "C", l.priority, l.shard)
      INTO v_lq, v_ll, v_lp, v_ls, v_lc
    FROM (SELECT p_queues[o.ord] AS queue, min(p_logicals[o.ord]) AS logical,
                 p_priorities[o.ord] AS priority, o.shard, count(*)::integer AS n
          FROM unnest(v_ords, v_shards) AS o(ord, shard)
          GROUP BY 1, 3, 4) l;
    v_starts := ${s}.reserve_lanes(v_lq, v_ll, v_lp, v_ls, v_lc);

    INSERT INTO ${s}.ready_entries (ready_slot, ready_generation, job_id, kind, queue, args,
                                   priority, max_attempts, lane_seq, enqueue_shard,
                                   unique_key, unique_states, payload)
    SELECT rs.current_slot, rs.generation, v_ids[o.ord], p_kinds[o.ord], p_queues[o.ord],
           coalesce(p_args[o.ord], '{}'::jsonb), p_priorities[o.ord], p_max_attempts[o.ord],
           l.start + row_number() OVER (PARTITION BY l.i ORDER BY o.ord) - 1, o.shard,
           p_unique_keys[o.ord], p_unique_states[o.ord], p_payloads[o.ord]
    FROM unnest(v_ords, v_shards) AS o(ord, shard)
    JOIN unnest(v_lq, v_lp, v_ls, v_starts) WITH ORDINALITY AS l(queue, priority, shard, start, i)
      ON l.queue = p_queues[o.ord] AND l.priority = p_priorities[o.ord] AND l.shard = o.shard
    CROSS JOIN ${s}.queue_ring_state rs;
  END IF;

  IF v_ords IS NULL OR array_length(v_ords, 1) < v_n THEN
    -- each scheduled row into its wheel bucket, or into the overflow when due beyond the
    -- wheel's span
    WITH d AS (
      SELECT v_ids[u.ord] AS id, u.kind, u.queue, coalesce(u.args, '{}'::jsonb) AS args,
             u.priority, u.max_attempts, u.run_at, u.key, u.states, u.payload,
             ${s}.wheel_bucket(u.run_at) AS bucket
      FROM unnest(p_kinds, p_queues, p_args, p_priorities, p_max_attempts, p_run_ats,
                  p_unique_keys, p_unique_states, p_payloads)
             WITH ORDINALITY AS u(kind, queue, args, priority, max_attempts, run_at, key, states,
                                  payload, ord)
      WHERE u.run_at IS NOT NULL),
    wheel AS (
      INSERT INTO ${s}.deferred_wheel (wheel_slot, bucket, job_id, kind, queue, args, state,
                                      priority, max_attempts, run_at, unique_key, unique_states,
                                      payload)
      SELECT (d.bucket % ${wheel_slots})::smallint, d.bucket, d.id, d.kind, d.queue, d.args,
             'scheduled', d.priority, d.max_attempts, d.run_at, d.key, d.states, d.payload
      FROM d WHERE d.bucket IS NOT NULL)
    INSERT INTO ${s}.deferred_jobs (job_id, kind, queue, args, state, priority, max_attempts,
                                   run_at, unique_key, unique_states, payload)
    SELECT d.id, d.kind, d.queue, d.args, 'scheduled', d.priority, d.max_attempts, d.run_at,
           d.key, d.states, d.payload
    FROM d WHERE d.bucket IS NULL;
  END IF;

  PERFORM pg_notify(c.channel, '') FROM unnest(p_channels) AS c(channel);
  RETURN QUERY SELECT v_ids, NULL::bytea, NULL::bigint;
END
$$
