"""Column types and storage-parameter presets shared by the table declarations."""

from __future__ import annotations

from typing import Any

from sqlalchemy import BigInteger, Enum, Integer, SmallInteger, Text, text
from sqlalchemy.dialects.postgresql import ARRAY, BYTEA, JSONB, REGCLASS, TIMESTAMP, UUID

from qstore.types import JobState

__all__ = [
    "BIGINT",
    "BIGINTS",
    "BYTES",
    "INT",
    "JOB_STATES",
    "JSON",
    "NOW",
    "REGCLASS",
    "SMALLINT",
    "SMALLINTS",
    "TEXT",
    "TS",
    "TSS",
    "UUIDT",
    "WARM",
    "job_state_enum",
]

BIGINT = BigInteger()
INT = Integer()
SMALLINT = SmallInteger()
TEXT = Text()
JSON = JSONB()
#: Optional JSON whose absence is SQL NULL (Python ``None`` binds as NULL, not JSON null):
#: a narrow done row's NULL ``payload`` means "the ready row's", so it must stay NULL.
OPTIONAL_JSON = JSONB(none_as_null=True)
BYTES = BYTEA()
TS = TIMESTAMP(timezone=True)
BIGINTS = ARRAY(BigInteger())
SMALLINTS = ARRAY(SmallInteger())
TSS = ARRAY(TIMESTAMP(timezone=True))
UUIDT = UUID(as_uuid=True)
NOW = text("clock_timestamp()")

#: The ``job_state`` enum's labels, in :class:`~qstore.types.JobState`'s declaration order.
JOB_STATES = tuple(state.value for state in JobState)


def job_state_enum(schema: str) -> Enum:
    """The per-schema ``job_state`` enum (created with the metadata, dropped with it)."""
    return Enum(*JOB_STATES, name="job_state", schema=schema, metadata=None, create_type=True)


def warm(fillfactor: int, threshold: int = 50) -> dict[str, Any]:
    """Storage parameters for warm hot-spot tables: HOT-friendly fill, eager autovacuum."""
    return {
        "fillfactor": fillfactor,
        "autovacuum_vacuum_scale_factor": 0,
        "autovacuum_vacuum_threshold": threshold,
        "autovacuum_vacuum_cost_limit": 2000,
        "autovacuum_vacuum_cost_delay": 2,
    }


WARM = warm
