"""qstore: segmented, vacuum-friendly job-queue storage for PostgreSQL."""

from qstore.config import DEFAULT_SCHEMA, QueueStorageConfig
from qstore.errors import (
    CallbackNotFoundError,
    CallbackWaitEndedError,
    DatabaseError,
    PartialCommitError,
    QueueStorageError,
    SchemaNotInstalledError,
    ShapeMismatchError,
    UniqueConflictError,
    ValidationError,
)
from qstore.model import (
    BusyCounts,
    CallbackConfig,
    CallbackPollResult,
    ClaimedEntry,
    ClaimedRuntimeJob,
    JobRow,
    JobState,
    ListDlqFilter,
    PruneOutcome,
    QueueClaimerLease,
    QueueCounts,
    RetryFromDlqOpts,
    RotateOutcome,
    SkipReason,
    TerminalDeltaRollupOutcome,
)
from qstore.schema import build_metadata
from qstore.storage import QueueStorage

__all__ = [
    "DEFAULT_SCHEMA",
    "BusyCounts",
    "CallbackConfig",
    "CallbackNotFoundError",
    "CallbackPollResult",
    "CallbackWaitEndedError",
    "ClaimedEntry",
    "ClaimedRuntimeJob",
    "DatabaseError",
    "JobRow",
    "JobState",
    "ListDlqFilter",
    "PartialCommitError",
    "PruneOutcome",
    "QueueClaimerLease",
    "QueueCounts",
    "QueueStorage",
    "QueueStorageConfig",
    "QueueStorageError",
    "RetryFromDlqOpts",
    "RotateOutcome",
    "SchemaNotInstalledError",
    "ShapeMismatchError",
    "SkipReason",
    "TerminalDeltaRollupOutcome",
    "UniqueConflictError",
    "ValidationError",
    "build_metadata",
]
