## wheel_bucket: the deferred-wheel bucket a wait until p_run_at is appended to, or NULL
## when it waits in the overflow (deferred_jobs) instead.
##
## The bucket is floor(epoch(run_at) / wheel_seconds) on the server's clock; a run_at
## already past goes to the current bucket, so nothing is appended to a bucket that is over
## (its slot may be truncating). A bucket wheel_span or more buckets ahead of the current
## one is beyond the wheel: the guard_slots slots behind the current bucket then hold only
## past buckets, and the slot of an entry is bucket % wheel_slots.
##
## Template parameters: s (schema), wheel_seconds, wheel_span (wheel slots minus guard slots).
CREATE OR REPLACE FUNCTION ${s}.wheel_bucket(p_run_at timestamp with time zone) RETURNS bigint LANGUAGE sql VOLATILE AS $$
  SELECT CASE WHEN b.due < b.now + ${wheel_span} THEN greatest(b.due, b.now) END
  FROM (SELECT floor(extract(epoch FROM p_run_at) / ${wheel_seconds})::bigint AS due,
               floor(extract(epoch FROM clock_timestamp()) / ${wheel_seconds})::bigint AS now) b
$$
