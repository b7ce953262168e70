## terminal_jobs: every finished job still retained in the queue ring, with the fields a
## narrow done row leaves out read from its ready row (a JSON null payload, as an older
## release's general terminal path wrote it, reads as the ready row's payload).
##
## Template parameters: s (schema).
CREATE OR REPLACE VIEW ${s}.terminal_jobs AS SELECT d.job_id, d.kind, d.queue, d.state, d.priority, d.attempt, d.run_lease,
       coalesce(d.args, r.args, '{}'::jsonb) AS args,
       coalesce(d.max_attempts, r.max_attempts, 25::smallint) AS max_attempts,
       coalesce(d.run_at, r.run_at, d.finalized_at) AS run_at,
       coalesce(d.created_at, r.created_at, d.finalized_at) AS created_at,
       d.attempted_at, d.finalized_at,
       coalesce(d.unique_key, r.unique_key) AS unique_key,
       coalesce(d.unique_states, r.unique_states) AS unique_states,
       coalesce(nullif(d.payload, 'null'::jsonb), nullif(r.payload, 'null'::jsonb), '{}'::jsonb) AS payload,
       d.ready_slot, d.ready_generation, d.lane_seq, d.enqueue_shard
FROM ${s}.done_entries d
LEFT JOIN ${s}.ready_entries r
  ON r.ready_slot = d.ready_slot AND r.ready_generation = d.ready_generation
 AND r.queue = d.queue AND r.priority = d.priority
 AND r.enqueue_shard = d.enqueue_shard AND r.lane_seq = d.lane_seq
