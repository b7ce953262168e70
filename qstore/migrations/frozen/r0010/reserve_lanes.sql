## reserve_lanes: reserves p_counts[i] consecutive positions in each lane i and returns the
## first of each.
##
## Every producer takes the lanes' reservation locks in one order (queue in byte order, then
## priority, then shard) and holds them until its transaction ends: a committed row at
## position p then implies that every position below p was committed or aborted, which is
## what lets a claim skip positions before the first visible row.
##
## Template parameters: s (schema).
CREATE OR REPLACE FUNCTION ${s}.reserve_lanes(p_queues text[], p_logicals text[], p_priorities smallint[], p_shards smallint[], p_counts integer[]) RETURNS bigint[] LANGUAGE plpgsql VOLATILE AS $$
DECLARE
  v_out bigint[] := '{}';
  v_seq regclass;
  v_start bigint;
BEGIN
  FOR i IN 1 .. coalesce(array_length(p_queues, 1), 0) LOOP
    PERFORM ${s}.ensure_lane(p_queues[i], p_logicals[i], p_priorities[i], p_shards[i]);
    PERFORM pg_advisory_xact_lock(hashtextextended(
      '${s}:reserve:' || p_queues[i] || ':' || p_priorities[i] || ':' || p_shards[i], 0));
    SELECT h.enqueue_seq INTO STRICT v_seq FROM ${s}.queue_enqueue_heads h
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
$$
