"""``qstore job show|retry|cancel ID``: one job, seen or acted on by an operator.

``show`` prints the job's newest view (``load_job``; state, kind, queue, attempt, args,
errors, times, and its DLQ reason when it is dead-lettered), ``--json`` the same under the
``JobRow`` field names plus ``dlq``. ``retry`` re-enqueues a failed, cancelled or
waiting_external job (``retry_job``); ``cancel`` cancels a scheduled, available, retryable,
running or waiting_external one (``cancel_job``). When nothing can be done the one line on
stderr says why (unknown id, or the state the job is in) and the exit status is 1.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from datetime import datetime
from typing import Any, TextIO

from sqlalchemy import Engine

from qstore.cli.common import CommandFailed, installed, json_value, positive_int, print_json
from qstore.storage import QueueStorage
from qstore.types import DlqEntry, JobRow, JobState

__all__ = ["cmd_job_cancel", "cmd_job_retry", "cmd_job_show", "job_json", "job_lines", "register"]

RETRYABLE = (JobState.FAILED, JobState.CANCELLED, JobState.WAITING_EXTERNAL)
CANCELLABLE = (JobState.SCHEDULED, JobState.AVAILABLE, JobState.RETRYABLE, JobState.RUNNING,
               JobState.WAITING_EXTERNAL)


def job_json(job: JobRow, dlq: DlqEntry | None = None) -> dict[str, Any]:
    """``job`` as JSON-ready values under its field names, plus ``dlq`` (``reason``,
    ``at``, ``original_run_lease``; null when the job is not dead-lettered)."""
    out: dict[str, Any] = json_value(asdict(job))
    out["dlq"] = None if dlq is None else {"reason": dlq.dlq_reason, "at": json_value(dlq.dlq_at),
                                           "original_run_lease": dlq.original_run_lease}
    return out


def _when(at: datetime | None) -> str | None:
    return None if at is None else at.isoformat(sep=" ", timespec="seconds")


def _compact(value: Any) -> str:
    return json.dumps(json_value(value), separators=(", ", ": "))


def _stamp(at: Any) -> str:
    """An error entry's ISO time as ``_when`` shows times (the text itself if it is not one)."""
    try:
        return _when(datetime.fromisoformat(str(at))) or str(at)
    except ValueError:
        return str(at)


def _error_line(entry: Any) -> str:
    if isinstance(entry, dict) and "error" in entry:
        at = entry.get("at")
        when = f" at {_stamp(at)}" if at else ""
        final = " (terminal)" if entry.get("terminal") else ""
        return f"attempt {entry.get('attempt', '?')}{when}: {entry['error']}{final}"
    return _compact(entry)


def job_lines(job: JobRow, dlq: DlqEntry | None = None) -> list[str]:
    """The readable form of ``job``: ``job ID`` then one ``name  value`` line per field
    that has a value, then its errors, oldest first."""
    state = job.state.value
    if dlq is not None:
        state += f" (dead-lettered {_when(dlq.dlq_at)}: {dlq.dlq_reason})"
    fields: list[tuple[str, Any]] = [
        ("state", state), ("kind", job.kind), ("queue", job.queue), ("priority", job.priority),
        ("attempt", f"{job.attempt}/{job.max_attempts}"), ("run lease", job.run_lease),
        ("args", _compact(job.args)), ("created", _when(job.created_at)), ("run at", _when(job.run_at)),
        ("attempted", _when(job.attempted_at)), ("heartbeat", _when(job.heartbeat_at)),
        ("deadline", _when(job.deadline_at)), ("finalized", _when(job.finalized_at)),
        ("tags", ", ".join(job.tags) or None), ("metadata", _compact(job.metadata) if job.metadata else None),
        ("progress", None if job.progress is None else _compact(job.progress)),
        ("unique key", job.unique_key.hex() if job.unique_key else None),
        ("callback", None if job.callback_id is None else
         f"{job.callback_id} (times out {_when(job.callback_timeout_at)})"),
    ]
    lines = [f"job {job.id}"]
    lines += [f"  {name:<10}  {value}" for name, value in fields if value is not None]
    if job.errors:
        lines.append("  errors:")
        lines += [f"    {_error_line(e)}" for e in job.errors]
    return lines


def _job_id(args: argparse.Namespace) -> int:
    return positive_int(args.job_id, "job id")


def _not_found(job_id: int, storage: QueueStorage) -> CommandFailed:
    return CommandFailed(f"job {job_id} not found in schema {storage.schema()!r} "
                         f"(never enqueued there, or its history was pruned)")


def _explain(engine: Engine, storage: QueueStorage, job_id: int, verb: str,
             states: tuple[JobState, ...]) -> CommandFailed:
    """Why ``verb`` ("retried" / "cancelled") did nothing to ``job_id``, as the refusal."""
    job = storage.load_job(engine, job_id)
    if job is None:
        return _not_found(job_id, storage)
    if verb == "retried":
        if storage.load_dlq_entry(engine, job_id) is not None:
            return CommandFailed(f"job {job_id} is in the dead-letter queue: "
                                 f"retry it with `qstore dlq retry {job_id}`")
        if job.state in (JobState.SCHEDULED, JobState.RETRYABLE):
            return CommandFailed(f"job {job_id} is already waiting to run: it is {job.state.value}, "
                                 f"due {_when(job.run_at)}")
    names = [s.value for s in states]
    adjective = "retryable" if verb == "retried" else "cancellable"
    return CommandFailed(f"job {job_id} is not in a {adjective} state: it is {job.state.value} "
                         f"(only {', '.join(names[:-1])} or {names[-1]} jobs can be {verb})")


def cmd_job_show(args: argparse.Namespace, out: TextIO) -> int:
    job_id = _job_id(args)
    with installed(args, "job show") as (engine, storage):
        job = storage.load_job(engine, job_id)
        if job is None:
            raise _not_found(job_id, storage)
        dlq = storage.load_dlq_entry(engine, job_id) if job.state is JobState.FAILED else None
    if args.json:
        print_json(job_json(job, dlq), out)
    else:
        for line in job_lines(job, dlq):
            print(line, file=out)
    return 0


def cmd_job_retry(args: argparse.Namespace, out: TextIO) -> int:
    job_id = _job_id(args)
    with installed(args, "job retry") as (engine, storage):
        job = storage.retry_job(engine, job_id)
        if job is None:
            raise _explain(engine, storage, job_id, "retried", RETRYABLE)
    print(f"job {job_id} retried: {job.state.value} in queue {job.queue!r} "
          f"(attempt {job.attempt}/{job.max_attempts})", file=out)
    return 0


def cmd_job_cancel(args: argparse.Namespace, out: TextIO) -> int:
    job_id = _job_id(args)
    with installed(args, "job cancel") as (engine, storage):
        before = storage.load_job(engine, job_id)
        job = storage.cancel_job(engine, job_id)
        if job is None:
            raise _explain(engine, storage, job_id, "cancelled", CANCELLABLE)
    was = f" (was {before.state.value})" if before is not None else ""
    print(f"job {job_id} cancelled{was}", file=out)
    return 0


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add ``qstore job show|retry|cancel`` to the subcommands."""
    job = sub.add_parser("job", help="show, retry or cancel one job")
    actions = job.add_subparsers(dest="action", required=True, metavar="{show,retry,cancel}")
    show = actions.add_parser("show", parents=[common], help="the job's state, attempts, args, errors and times")
    show.add_argument("--json", action="store_true", help="print the job as JSON")
    retry = actions.add_parser("retry", parents=[common],
                               help="re-enqueue a failed, cancelled or waiting_external job")
    cancel = actions.add_parser("cancel", parents=[common],
                                help="cancel a scheduled, available, retryable, running or waiting job")
    for parser, func in ((show, cmd_job_show), (retry, cmd_job_retry), (cancel, cmd_job_cancel)):
        parser.add_argument("job_id", metavar="ID", help="the job id")
        parser.set_defaults(func=func)
