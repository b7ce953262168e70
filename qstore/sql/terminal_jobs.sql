## terminal_jobs: every finished job still retained in the queue ring, with the fields a
## narrow done row leaves out read from its ready row (a JSON null payload, as an older
## release's general terminal path wrote it, reads as the ready row's payload).
##
## Three branches, one per kind of terminal fact, so that a filter on job_id finds its rows
## by index: a narrow done row (a claimed attempt's) has no job_id index entry of its own and
## is reached through its ready row's (the join names the job id on both sides, so the filter
## applies to the ready rows); a wide done row through done_entries_wide_job_id_idx; a member
## of a batch done row (done_batches: completed attempts of the completion fast path) through
## its ready row's job_id index and then done_batches_lane_idx on the row's lane and block of
## positions. A narrow row and a batch member always have their ready row: they carry its
## lane key in the same ring slot, and a slot is truncated as a whole. A wide row has none.
##
## Template parameters: s (schema), done_block.
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
JOIN ${s}.ready_entries r
  ON r.ready_slot = d.ready_slot AND r.ready_generation = d.ready_generation
 AND r.queue = d.queue AND r.priority = d.priority
 AND r.enqueue_shard = d.enqueue_shard AND r.lane_seq = d.lane_seq
 AND r.job_id = d.job_id
WHERE d.created_at IS NULL
UNION ALL
SELECT d.job_id, d.kind, d.queue, d.state, d.priority, d.attempt, d.run_lease,
       coalesce(d.args, '{}'::jsonb),
       coalesce(d.max_attempts, 25::smallint),
       coalesce(d.run_at, d.finalized_at),
       d.created_at,
       d.attempted_at, d.finalized_at,
       d.unique_key,
       d.unique_states,
       coalesce(nullif(d.payload, 'null'::jsonb), '{}'::jsonb),
       d.ready_slot, d.ready_generation, d.lane_seq, d.enqueue_shard
FROM ${s}.done_entries d
WHERE d.created_at IS NOT NULL
UNION ALL
SELECT m.job_id, r.kind, b.queue, 'completed'::${s}.job_state, b.priority, m.attempt, m.run_lease,
       coalesce(r.args, '{}'::jsonb),
       coalesce(r.max_attempts, 25::smallint),
       coalesce(r.run_at, b.finalized_at),
       coalesce(r.created_at, b.finalized_at),
       m.attempted_at, b.finalized_at,
       r.unique_key,
       r.unique_states,
       coalesce(nullif(r.payload, 'null'::jsonb), '{}'::jsonb),
       b.ready_slot, b.ready_generation, m.lane_seq, b.enqueue_shard
FROM ${s}.done_batches b
CROSS JOIN LATERAL unnest(b.lane_seqs, b.job_ids, b.run_leases, b.attempts, b.attempted_ats)
     AS m(lane_seq, job_id, run_lease, attempt, attempted_at)
JOIN ${s}.ready_entries r
  ON r.ready_slot = b.ready_slot AND r.ready_generation = b.ready_generation
 AND r.queue = b.queue AND r.priority = b.priority AND r.enqueue_shard = b.enqueue_shard
 AND b.lane_block = r.lane_seq / ${done_block} AND r.lane_seq = m.lane_seq
 AND r.job_id = m.job_id
