"""A job's columns, declared once: what SQL stores and hands back for a job and which field of
the public types each column fills.

* :data:`BODY` — a job's durable body, as every table holding a whole job stores it (ready
  rows, deferred and DLQ rows, wide done rows, the ``terminal_jobs`` view):
  :func:`body_job` reads one into a :class:`~qstore.types.JobRow`, :func:`body_values`
  writes a JobRow's back.
* :data:`CLAIMED` — the result of the server function ``claim_ready``, in order: the claim
  statement selects these columns (:func:`qstore.storage.claim.claim_physical`) and
  :func:`claimed` decodes one row of them into a :class:`~qstore.types.ClaimedRuntimeJob`.

``tests/test_job_columns.py`` compares both with the tables and the function as the database
reports them, so the declaration and the schema cannot drift apart.

A job's payload (the ``payload`` column) holds its metadata, tags, errors and progress, each
omitted when empty (:func:`~qstore.storage.jobs.build_payload` writes it, :func:`payload_fields`
reads it back).
"""

from __future__ import annotations

import keyword
from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass, fields
from operator import attrgetter
from typing import Any

from sqlalchemy.types import TypeEngine

from qstore.schema.types import BIGINT, BYTES, INT, JSON, SMALLINT, TEXT, TS
from qstore.storage.jobs import build_payload
from qstore.types import ClaimedEntry, ClaimedRuntimeJob, JobRow, JobState

__all__ = ["BODY", "CLAIMED", "ORIGINAL_PRIORITY_KEY", "PAYLOAD_FIELDS", "JobColumn", "body_job",
           "body_values", "claimed", "evolve", "field_names", "payload_fields"]

#: The metadata key a job claimed at an aged (raised) priority keeps its own priority under.
ORIGINAL_PRIORITY_KEY = "_qstore_original_priority"
#: The :class:`~qstore.types.JobRow` fields a payload holds.
PAYLOAD_FIELDS = ("errors", "metadata", "tags", "progress")


@dataclass(frozen=True)
class JobColumn:
    """One column of a job as SQL returns it: its name and SQL type, the
    :class:`~qstore.types.JobRow` fields it fills as it is (``job``) and the
    :class:`~qstore.types.ClaimedEntry` field it fills (``claim``)."""

    name: str
    type: TypeEngine[Any]
    job: tuple[str, ...] = ()
    claim: str | None = None


#: A job's body: what it was enqueued with and where its attempts stand. ``priority`` is the
#: lane's (the one it was enqueued or moved at); ``payload`` holds :data:`PAYLOAD_FIELDS`.
BODY: tuple[JobColumn, ...] = (
    JobColumn("job_id", BIGINT, job=("id",)),
    JobColumn("kind", TEXT, job=("kind",)),
    JobColumn("queue", TEXT, job=("queue",)),
    JobColumn("args", JSON, job=("args",)),
    JobColumn("priority", SMALLINT, job=("priority",)),
    JobColumn("attempt", SMALLINT, job=("attempt",)),
    JobColumn("run_lease", BIGINT, job=("run_lease",)),
    JobColumn("max_attempts", SMALLINT, job=("max_attempts",)),
    JobColumn("run_at", TS, job=("run_at",)),
    JobColumn("created_at", TS, job=("created_at",)),
    JobColumn("attempted_at", TS, job=("attempted_at",)),
    JobColumn("unique_key", BYTES, job=("unique_key",)),
    JobColumn("unique_states", TEXT, job=("unique_states",)),
    JobColumn("payload", JSON),
)

#: ``claim_ready``'s result: where the claimed attempt lives (ring slots and generations, the
#: lane) and the claimed job. ``priority`` is the lane's, ``effective_priority`` the (aged)
#: one the job was claimed at; ``claimed_at`` is both the attempt's start and its first
#: heartbeat; ``payload`` fills :data:`PAYLOAD_FIELDS`.
CLAIMED: tuple[JobColumn, ...] = (
    JobColumn("claim_slot", INT, claim="claim_slot"),
    JobColumn("lease_slot", INT, claim="lease_slot"),
    JobColumn("lease_generation", BIGINT, claim="lease_generation"),
    JobColumn("ready_slot", INT, claim="ready_slot"),
    JobColumn("ready_generation", BIGINT, claim="ready_generation"),
    JobColumn("queue", TEXT, job=("queue",), claim="queue"),
    JobColumn("priority", SMALLINT, claim="priority"),
    JobColumn("effective_priority", SMALLINT, job=("priority",)),
    JobColumn("enqueue_shard", SMALLINT, claim="enqueue_shard"),
    JobColumn("lane_seq", BIGINT, claim="lane_seq"),
    JobColumn("job_id", BIGINT, job=("id",), claim="job_id"),
    JobColumn("run_lease", BIGINT, job=("run_lease",), claim="run_lease"),
    JobColumn("attempt", SMALLINT, job=("attempt",)),
    JobColumn("max_attempts", SMALLINT, job=("max_attempts",)),
    JobColumn("kind", TEXT, job=("kind",)),
    JobColumn("args", JSON, job=("args",)),
    JobColumn("run_at", TS, job=("run_at",)),
    JobColumn("created_at", TS, job=("created_at",)),
    JobColumn("claimed_at", TS, job=("heartbeat_at", "attempted_at")),
    JobColumn("deadline_at", TS, job=("deadline_at",)),
    JobColumn("unique_key", BYTES, job=("unique_key",)),
    JobColumn("unique_states", TEXT, job=("unique_states",)),
    JobColumn("payload", JSON),
)


def field_names(cls: type) -> frozenset[str]:
    """The field names of a dataclass."""
    return frozenset(f.name for f in fields(cls))


def payload_fields(payload: dict[str, Any] | None) -> dict[str, Any]:
    """The :data:`PAYLOAD_FIELDS` of a stored payload (None: all empty), as a
    :class:`~qstore.types.JobRow` holds them: errors None when there are none, fresh
    metadata and tag containers."""
    p = payload or {}
    return {"errors": p.get("errors") or None, "metadata": dict(p.get("metadata") or {}),
            "tags": list(p.get("tags") or []), "progress": p.get("progress")}


def _fixed_fields(columns: Sequence[JobColumn], **values: Any) -> dict[str, Any]:
    """The JobRow fields ``columns`` and a payload do not fill: ``values``, else the field's
    default (each must have a plain one)."""
    filled = {f for c in columns for f in c.job} | set(PAYLOAD_FIELDS)
    out: dict[str, Any] = {}
    for f in fields(JobRow):
        if f.name in filled:
            continue
        if f.name in values:
            out[f.name] = values[f.name]
        elif f.default is not MISSING:
            out[f.name] = f.default
        else:
            raise TypeError(f"JobRow.{f.name} is filled by no column and has no default")
    return out


def _check_fills(columns: Sequence[JobColumn], fixed: dict[str, Any], receipt_field: str) -> None:
    """The declaration fills every field of JobRow and ClaimedEntry exactly once (run at import:
    the decoder builds both without their ``__init__``)."""
    job = [f for c in columns for f in c.job] + list(PAYLOAD_FIELDS) + list(fixed)
    if sorted(job) != sorted(field_names(JobRow)):
        raise TypeError(f"the columns fill JobRow fields {sorted(job)}, JobRow has {sorted(field_names(JobRow))}")
    entry = [c.claim for c in columns if c.claim] + [receipt_field]
    if sorted(entry) != sorted(field_names(ClaimedEntry)):
        raise TypeError(f"the columns fill ClaimedEntry fields {sorted(entry)}, "
                        f"ClaimedEntry has {sorted(field_names(ClaimedEntry))}")


# -- a job's body as a JobRow ----------------------------------------------------------------
# A body is read into a JobRow and copied a few times on its way to its next state (new
# errors and attempt, a cleared progress, the public row of its new state). Each copy gets its
# __dict__ filled at once instead of running dataclasses.replace (a Python loop over the
# fields) and the frozen __init__ (one object.__setattr__ per field); the copies compare,
# hash and print like instances built normally.
_JOB_FIELDS = field_names(JobRow)
_BODY_FIELDS = tuple(f for c in BODY for f in c.job)
_BODY_READ = attrgetter(*(c.name for c in BODY for _ in c.job))
_BODY_REST = _fixed_fields(BODY, state=None)
if sorted([*_BODY_FIELDS, *PAYLOAD_FIELDS, *_BODY_REST]) != sorted(_JOB_FIELDS):
    raise TypeError(f"BODY fills {sorted(_BODY_FIELDS)}: not JobRow fields, or one twice")
if any(hasattr(cls, "__post_init__") for cls in (JobRow, ClaimedEntry, ClaimedRuntimeJob)):
    raise TypeError("JobRow, ClaimedEntry and ClaimedRuntimeJob are built here without their __init__")
_new = object.__new__
_set = object.__setattr__


def _job(values: dict[str, Any]) -> JobRow:
    """A JobRow holding ``values``, which name every field (and nothing else)."""
    if len(values) != len(_JOB_FIELDS):
        raise TypeError(f"JobRow has no field {sorted(values.keys() - _JOB_FIELDS)}")
    job = _new(JobRow)
    _set(job, "__dict__", values)
    return job


def evolve(job: JobRow, **changes: Any) -> JobRow:
    """``job`` with ``changes`` to its fields (``dataclasses.replace``, faster)."""
    return _job({**vars(job), **changes})


def body_job(row: Any, state: JobState, **fields: Any) -> JobRow:
    """The :class:`~qstore.types.JobRow` of ``row`` (anything with the :data:`BODY` columns as
    attributes) in ``state``, with ``fields`` set over it; every other field is empty."""
    values = dict(_BODY_REST)
    values.update(zip(_BODY_FIELDS, _BODY_READ(row)))  # noqa: B905 - equal lengths by construction
    values.update(payload_fields(row.payload))
    values["state"] = state
    values.update(fields)
    return _job(values)


def body_values(job: JobRow) -> dict[str, Any]:
    """The :data:`BODY` columns of ``job`` as a row stores them (its payload built from its
    metadata, tags, errors and progress: empty members omitted, an empty payload NULL)."""
    values = {c.name: getattr(job, c.job[0]) for c in BODY if c.job}
    values["payload"] = build_payload(job.metadata, job.tags, job.errors, job.progress)
    return values


# -- decoding a claimed row -------------------------------------------------------------------
# The decoder runs once per claimed job. It is generated from CLAIMED, as dataclasses generate
# their __init__: one positional unpacking of the row and a dict display per object, set as
# the object's __dict__ instead of running its frozen __init__ (one object.__setattr__ per
# field), is the fastest way CPython has to build them, and generating it keeps CLAIMED the
# only place the column order is written. The objects compare, hash, pickle and print like
# instances built normally. Only the payload and the priority stamp are written by hand.
_DECODER = """\
def claimed(row, receipts):
    {columns}, = row
    if payload:
        metadata = dict(payload.get("metadata") or {{}})
        errors = payload.get("errors") or None
        tags = list(payload.get("tags") or [])
        progress = payload.get("progress")
    else:
        metadata, errors, tags, progress = {{}}, None, [], None
    if effective_priority != priority:
        metadata.setdefault(ORIGINAL_PRIORITY_KEY, priority)
    entry = new(ClaimedEntry)
    set_attr(entry, "__dict__", {{{entry}, "lease_claim_receipt": receipts}})
    job = new(JobRow)
    set_attr(job, "__dict__", {{{job}, **RUNNING, "errors": errors, "metadata": metadata, "tags": tags,
                               "progress": progress}})
    out = new(ClaimedRuntimeJob)
    set_attr(out, "__dict__", {{"claim": entry, "job": job, "unique_states": unique_states}})
    return out
"""
#: Names the decoder's own code uses: no column may be called so.
_DECODER_NAMES = frozenset({"row", "receipts", "metadata", "errors", "tags", "progress", "entry", "job", "out",
                            "new", "set_attr", "dict", "list", "None", "ClaimedEntry", "JobRow",
                            "ClaimedRuntimeJob", "RUNNING", "ORIGINAL_PRIORITY_KEY"})
#: Columns the hand-written part of the decoder reads by name.
_DECODER_READS = ("payload", "priority", "effective_priority", "unique_states")


def _claimed_decoder() -> Callable[[Sequence[Any], bool], ClaimedRuntimeJob]:
    """The decoder of a :data:`CLAIMED` row, generated from the declaration (checked first:
    it must fill every field of the built types once and name its columns as Python can)."""
    names = [c.name for c in CLAIMED]
    bad = [n for n in names if not n.isidentifier() or keyword.iskeyword(n) or n in _DECODER_NAMES]
    missing = [n for n in _DECODER_READS if n not in names]
    if bad or missing or len(set(names)) != len(names):
        raise TypeError(f"CLAIMED cannot be decoded: bad names {bad}, missing {missing}, or a repeated name")
    running = _fixed_fields(CLAIMED, state=JobState.RUNNING)
    _check_fills(CLAIMED, running, "lease_claim_receipt")
    if field_names(ClaimedRuntimeJob) != {"claim", "job", "unique_states"}:
        raise TypeError("ClaimedRuntimeJob has fields the claim decoder does not fill")
    source = _DECODER.format(
        columns=", ".join(names),
        entry=", ".join(f"{c.claim!r}: {c.name}" for c in CLAIMED if c.claim),
        job=", ".join(f"{f!r}: {c.name}" for c in CLAIMED for f in c.job),
    )
    namespace: dict[str, Any] = {
        "new": object.__new__, "set_attr": object.__setattr__, "ClaimedEntry": ClaimedEntry, "JobRow": JobRow,
        "ClaimedRuntimeJob": ClaimedRuntimeJob, "RUNNING": running, "ORIGINAL_PRIORITY_KEY": ORIGINAL_PRIORITY_KEY,
    }
    exec(compile(source, f"<{__name__}: claimed>", "exec"), namespace)
    decoder: Callable[[Sequence[Any], bool], ClaimedRuntimeJob] = namespace["claimed"]
    decoder.__module__ = __name__
    decoder.__doc__ = """The claimed attempt of one ``claim_ready`` row (the columns of :data:`CLAIMED`, in
    order): its :class:`~qstore.types.ClaimedEntry` (``lease_claim_receipt`` = ``receipts``)
    and its running :class:`~qstore.types.JobRow`, whose priority is the one it was claimed
    at; a job claimed above its lane's priority keeps the lane's under
    :data:`ORIGINAL_PRIORITY_KEY` in its metadata (unless the metadata has that key)."""
    return decoder


claimed = _claimed_decoder()
