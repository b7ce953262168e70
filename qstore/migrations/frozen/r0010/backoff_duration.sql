## backoff_duration: the wait before a failed attempt's job is due again, 2^attempt seconds
## (attempt capped at 17) with up to 25 % jitter, at most 24 hours.
##
## Template parameters: s (schema).
CREATE OR REPLACE FUNCTION ${s}.backoff_duration(attempt integer, max_attempts integer) RETURNS interval LANGUAGE sql VOLATILE AS $$
  SELECT least(
    make_interval(secs => power(2, least(attempt, 17))::double precision
                          * (1 + random() * 0.25)),
    interval '24 hours')
$$
