"""Frozen DDL of revision 0011: the deferred wheel.

A job waiting for its ``run_at`` (scheduled, retryable, snoozed) is appended to
``deferred_wheel``, LIST-partitioned by ``wheel_slot`` = bucket % 32 with buckets of 30
seconds, and resolved (promoted, cancelled, moved) by appending a row to
``deferred_wheel_marks``, partitioned the same way and unique per entry; upkeep truncates a
slot once its buckets are past and every entry in it is marked. ``deferred_jobs`` stays as the
overflow for waits due beyond the wheel's span (28 buckets ahead of the current one).

The upgrade creates the wheel, the ``wheel_bucket`` routing function and the new
``enqueue_jobs`` (texts in the ``r0011`` folder next to this module), then moves every
overflow row due within the span into the wheel. The downgrade moves every unresolved wheel
entry back into ``deferred_jobs``, restores the ``enqueue_jobs`` of revision 0010 and drops
the wheel. Never edited after landing (see :mod:`qstore.migrations.frozen.r0001`).
"""

from __future__ import annotations

from qstore.migrations.frozen import r0010
from qstore.migrations.frozen.r0001 import Shape

WHEEL = {"wheel_seconds": 30, "wheel_slots": 32, "wheel_span": 28}
_SNAPSHOT = ("job_id, kind, queue, args, state, priority, attempt, run_lease, max_attempts, run_at, "
             "attempted_at, finalized_at, created_at, unique_key, unique_states, payload")


def _tables(s: str) -> list[str]:
    slots = WHEEL["wheel_slots"]
    return [
        f"""CREATE SEQUENCE {s}.deferred_wheel_entry_seq START WITH 1""",
        f"""CREATE TABLE {s}.deferred_wheel (
    wheel_slot SMALLINT NOT NULL,
    bucket BIGINT NOT NULL,
    entry_id BIGINT DEFAULT nextval('{s}.deferred_wheel_entry_seq'::regclass) NOT NULL,
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
    CONSTRAINT deferred_wheel_pkey PRIMARY KEY (entry_id, wheel_slot),
    CONSTRAINT deferred_wheel_state CHECK (state IN ('scheduled', 'retryable'))
)
 PARTITION BY LIST (wheel_slot)""",
        *(f"CREATE TABLE {s}.deferred_wheel_{k} PARTITION OF {s}.deferred_wheel FOR VALUES IN ({k})"
          for k in range(slots)),
        f"CREATE INDEX deferred_wheel_due_idx ON {s}.deferred_wheel (state, run_at, priority, job_id)",
        f"CREATE INDEX deferred_wheel_job_id_idx ON {s}.deferred_wheel (job_id)",
        f"""CREATE TABLE {s}.deferred_wheel_marks (
    wheel_slot SMALLINT NOT NULL,
    entry_id BIGINT NOT NULL,
    job_id BIGINT NOT NULL,
    resolution TEXT NOT NULL,
    marked_at TIMESTAMP WITH TIME ZONE DEFAULT clock_timestamp() NOT NULL,
    CONSTRAINT deferred_wheel_marks_pkey PRIMARY KEY (entry_id, wheel_slot),
    CONSTRAINT deferred_wheel_marks_resolution CHECK (resolution IN ('promoted', 'cancelled', 'moved'))
)
 PARTITION BY LIST (wheel_slot)""",
        *(f"CREATE TABLE {s}.deferred_wheel_marks_{k} PARTITION OF {s}.deferred_wheel_marks FOR VALUES IN ({k})"
          for k in range(slots)),
    ]


def upgrade(shape: Shape) -> list[str]:
    s = shape.schema
    return [
        *_tables(s),
        r0010.render("r0011", "wheel_bucket", shape, **WHEEL),
        r0010.render("r0011", "enqueue_jobs", shape, **WHEEL),
        # the overflow rows due within the span move into the wheel
        f"""WITH moved AS (
    DELETE FROM {s}.deferred_jobs d WHERE {s}.wheel_bucket(d.run_at) IS NOT NULL
    RETURNING d.*)
INSERT INTO {s}.deferred_wheel (wheel_slot, bucket, {_SNAPSHOT})
SELECT (m.bucket % {WHEEL["wheel_slots"]})::smallint, m.bucket, {_SNAPSHOT}
FROM (SELECT moved.*, {s}.wheel_bucket(moved.run_at) AS bucket FROM moved) m""",
    ]


def downgrade(shape: Shape) -> list[str]:
    s = shape.schema
    return [
        r0010.render("r0010", "enqueue_jobs", shape),
        f"DROP FUNCTION {s}.wheel_bucket(p_run_at timestamp with time zone)",
        # every unresolved wheel entry back into deferred_jobs
        f"""INSERT INTO {s}.deferred_jobs ({_SNAPSHOT})
SELECT {_SNAPSHOT} FROM {s}.deferred_wheel w
WHERE NOT EXISTS (SELECT 1 FROM {s}.deferred_wheel_marks m
                  WHERE m.entry_id = w.entry_id AND m.wheel_slot = w.wheel_slot)""",
        f"DROP TABLE {s}.deferred_wheel_marks",
        f"DROP TABLE {s}.deferred_wheel",
        f"DROP SEQUENCE {s}.deferred_wheel_entry_seq",
    ]
