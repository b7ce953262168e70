"""Frozen DDL of revision 0013: releasing a unique key appends a row, and a heartbeat no
longer writes its receipt.

* ``job_unique_claims`` gets ``claim_id`` (from the new sequence ``job_unique_claim_seq``,
  the default of a new row) and a ``BEFORE UPDATE`` trigger, ``job_unique_claims_renew``
  (function ``unique_claim_renew``), that gives every updated row a new one. The new
  append-only table ``job_unique_releases`` holds one row per released claim (primary key
  ``claim_id``): a key is owned by its claim row's job unless a release names the row's
  ``claim_id``, and a released key is taken over in place.
* ``enqueue_jobs`` takes a released key over (``ON CONFLICT … DO UPDATE … WHERE`` the
  claim's release exists) and reports as a key's owner only a claim not released.
* A heartbeat no longer marks its receipt (``materialized_at``); nothing in the schema
  changes for that: the completion fast path, ``complete_receipts`` of revision 0010, takes
  a heartbeated attempt like any other (a completion clears the attempt's progress on either
  path), and still leaves a materialised receipt (a callback's, or a heartbeat's of the
  previous release) to the general path.

The upgrade keeps every claim row (each live key stays owned: no release row exists yet).
The downgrade deletes the released claims, restores ``enqueue_jobs`` of revision 0011, and
drops the trigger, its function, the release table, the column and the sequence. The texts of the functions are in the ``r0013`` folder
next to this module. Never edited after landing (see :mod:`qstore.migrations.frozen.r0001`).
"""

from __future__ import annotations

from qstore.migrations.frozen import r0010, r0011
from qstore.migrations.frozen.r0001 import Shape

TRIGGER = "job_unique_claims_renew"


def upgrade(shape: Shape) -> list[str]:
    s = shape.schema
    return [
        f"CREATE SEQUENCE {s}.job_unique_claim_seq START WITH 1",
        f"""ALTER TABLE {s}.job_unique_claims
    ADD COLUMN claim_id BIGINT DEFAULT nextval('{s}.job_unique_claim_seq'::regclass) NOT NULL""",
        f"""CREATE TABLE {s}.job_unique_releases (
    claim_id BIGINT NOT NULL,
    unique_key BYTEA NOT NULL,
    job_id BIGINT NOT NULL,
    released_at TIMESTAMP WITH TIME ZONE DEFAULT clock_timestamp() NOT NULL,
    CONSTRAINT job_unique_releases_pkey PRIMARY KEY (claim_id)
)""",
        r0010.render("r0013", "unique_claim_renew", shape),
        f"""CREATE TRIGGER {TRIGGER} BEFORE UPDATE ON {s}.job_unique_claims FOR EACH ROW EXECUTE FUNCTION {s}.unique_claim_renew()""",
        r0010.render("r0013", "enqueue_jobs", shape, **r0011.WHEEL),
    ]


def downgrade(shape: Shape) -> list[str]:
    s = shape.schema
    return [
        r0010.render("r0011", "enqueue_jobs", shape, **r0011.WHEEL),
        # a released key is free: without its release row it must not read as owned
        f"""DELETE FROM {s}.job_unique_claims c
WHERE EXISTS (SELECT 1 FROM {s}.job_unique_releases r WHERE r.claim_id = c.claim_id)""",
        f"DROP TRIGGER {TRIGGER} ON {s}.job_unique_claims",
        f"DROP FUNCTION {s}.unique_claim_renew()",
        f"DROP TABLE {s}.job_unique_releases",
        f"ALTER TABLE {s}.job_unique_claims DROP COLUMN claim_id",
        f"DROP SEQUENCE {s}.job_unique_claim_seq",
    ]
