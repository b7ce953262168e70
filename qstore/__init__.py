"""qstore: segmented, vacuum-friendly job-queue storage for PostgreSQL."""

from qstore.config import DEFAULT_SCHEMA, QueueStorageConfig
from qstore.errors import (
    CallbackNotFoundError,
    CallbackWaitEndedError,
    CallerTransactionRefusedError,
    DatabaseError,
    PartialCommitError,
    QueueStorageError,
    SchemaNotInstalledError,
    ShapeMismatchError,
    UniqueConflictError,
    ValidationError,
)
from qstore.runtime.maintainer import Maintainer, MaintenanceSchedule, TaskReport
from qstore.schema import build_metadata
from qstore.status import schema_health, status_report
from qstore.storage import QueueStorage
from qstore.types import (
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

__all__ = [
    "DEFAULT_SCHEMA",
    "BusyCounts",
    "CallbackConfig",
    "CallbackNotFoundError",
    "CallbackPollResult",
    "CallbackWaitEndedError",
    "CallerTransactionRefusedError",
    "ClaimedEntry",
    "ClaimedRuntimeJob",
    "DatabaseError",
    "JobRow",
    "JobState",
    "ListDlqFilter",
    "Maintainer",
    "MaintenanceSchedule",
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
    "TaskReport",
    "TerminalDeltaRollupOutcome",
    "UniqueConflictError",
    "ValidationError",
    "build_metadata",
    "schema_health",
    "status_report",
]
