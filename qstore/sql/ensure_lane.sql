## ensure_lane: creates a lane (its enqueue and claim cursor sequences and its head rows)
## the first time a job is enqueued into it; a no-op for a lane that exists.
##
## SECURITY DEFINER with a fixed search_path: it runs with the rights of the role that owns
## it (the migration role), so a runtime role that may not create anything in the schema
## can still enqueue into a new queue or priority. The new sequences belong to the owner;
## the owner's default privileges give the runtime role their use.
##
## Template parameters: s (schema).
CREATE OR REPLACE FUNCTION ${s}.ensure_lane(p_queue text, p_logical text, p_priority smallint, p_shard smallint) RETURNS void LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
  v_hash text;
  v_enq text;
  v_claim text;
BEGIN
  IF EXISTS (SELECT 1 FROM ${s}.queue_claim_heads h
             WHERE h.queue = p_queue AND h.priority = p_priority AND h.enqueue_shard = p_shard) THEN
    RETURN;
  END IF;
  PERFORM pg_advisory_xact_lock(hashtextextended(
    '${s}:lane:' || p_queue || ':' || p_priority || ':' || p_shard, 0));
  IF EXISTS (SELECT 1 FROM ${s}.queue_claim_heads h
             WHERE h.queue = p_queue AND h.priority = p_priority AND h.enqueue_shard = p_shard) THEN
    RETURN;
  END IF;
  v_hash := md5(p_queue || ':' || p_priority || ':' || p_shard);
  v_enq := 'queue_enqueue_seq_' || v_hash;
  v_claim := 'queue_claim_seq_' || v_hash;
  EXECUTE format('CREATE SEQUENCE IF NOT EXISTS %I.%I AS bigint MINVALUE 0 START 1 CACHE 1',
                 '${s}', v_enq);
  EXECUTE format('CREATE SEQUENCE IF NOT EXISTS %I.%I AS bigint MINVALUE 0 START 1 CACHE 1',
                 '${s}', v_claim);
  INSERT INTO ${s}.queue_lanes (queue, priority) VALUES (p_queue, p_priority)
    ON CONFLICT DO NOTHING;
  INSERT INTO ${s}.queue_enqueue_heads (queue, priority, enqueue_shard, enqueue_seq)
    VALUES (p_queue, p_priority, p_shard, format('%I.%I', '${s}', v_enq)::regclass)
    ON CONFLICT DO NOTHING;
  INSERT INTO ${s}.queue_claim_heads
      (queue, priority, enqueue_shard, logical_queue, enqueue_seq, claim_seq)
    VALUES (p_queue, p_priority, p_shard, p_logical,
            format('%I.%I', '${s}', v_enq)::regclass, format('%I.%I', '${s}', v_claim)::regclass)
    ON CONFLICT DO NOTHING;
END
$$
