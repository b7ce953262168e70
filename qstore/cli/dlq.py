"""``qstore dlq list|retry|purge``: the dead-letter queue, for an operator.

* ``list [--queue Q] [--kind K] [--limit N] [--json]``: the newest dead-lettered jobs first
  (``list_dlq``); ``--json`` gives each as ``qstore job show --json`` does.
* ``retry ID`` re-enqueues one job (``retry_from_dlq``); ``retry --all [--queue Q]
  [--kind K]`` every matching one (``bulk_retry_from_dlq``, all or nothing).
* ``purge [--queue Q] [--kind K] --yes`` deletes the matching jobs for good (``purge_dlq``):
  their unique keys are released and ``qstore job show`` no longer finds them. Terminal
  counts do not change: dead-lettered jobs are not terminal history.
"""

from __future__ import annotations

import argparse
from typing import Any, TextIO

from qstore.cli.common import CommandFailed, installed, positive_int, print_json, table_lines
from qstore.cli.job import job_json
from qstore.types import DlqEntry, ListDlqFilter

__all__ = ["DEFAULT_LIMIT", "cmd_dlq_list", "cmd_dlq_purge", "cmd_dlq_retry", "register"]

DEFAULT_LIMIT = 50
_EVERY_ID = 2**63 - 1  # "job_id below the largest bigint": every row, as a bulk-retry criterion


def _last_error(entry: DlqEntry) -> str:
    errors = entry.job.errors or []
    last = errors[-1] if errors else None
    text = str(last.get("error", last) if isinstance(last, dict) else last or "")
    return " ".join(text.split())


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def _which(args: argparse.Namespace) -> str:
    parts = [f"kind {args.kind!r}" if args.kind else "", f"queue {args.queue!r}" if args.queue else ""]
    said = " and ".join(p for p in parts if p)
    return f" of {said}" if said else ""


def cmd_dlq_list(args: argparse.Namespace, out: TextIO) -> int:
    limit = positive_int(args.limit, "--limit") if args.limit is not None else DEFAULT_LIMIT
    with installed(args, "dlq list") as (engine, storage):
        entries = storage.list_dlq(engine, ListDlqFilter(kind=args.kind, queue=args.queue,
                                                         limit=min(limit + 1, 2**31 - 1)))
    more = len(entries) > limit
    entries = entries[:limit]
    if args.json:
        print_json([job_json(e.job, e) for e in entries], out)
        return 0
    if not entries:
        print(f"the dead-letter queue holds no jobs{_which(args)}", file=out)
        return 0
    rows = [(e.job.id, e.job.kind, e.job.queue, f"{e.job.attempt}/{e.job.max_attempts}",
             e.dlq_at.isoformat(sep=" ", timespec="seconds"), _clip(e.dlq_reason, 24),
             _clip(_last_error(e), 40)) for e in entries]
    for line in table_lines(("JOB", "KIND", "QUEUE", "ATTEMPT", "DEAD-LETTERED", "REASON", "LAST ERROR"),
                            rows):
        print(line, file=out)
    if more:
        print(f"(the newest {limit} shown; --limit N shows more)", file=out)
    return 0


def cmd_dlq_retry(args: argparse.Namespace, out: TextIO) -> int:
    if args.all == (args.job_id is not None):
        raise CommandFailed("dlq retry takes either a job id or --all")
    if args.job_id is not None and (args.kind or args.queue):
        raise CommandFailed("dlq retry: --kind and --queue go with --all, not with a job id")
    job_id = positive_int(args.job_id, "job id") if args.job_id is not None else None
    with installed(args, "dlq retry") as (engine, storage):
        if job_id is not None:
            job = storage.retry_from_dlq(engine, job_id)
            if job is None:
                raise CommandFailed(f"job {job_id} is not in the dead-letter queue of schema "
                                    f"{storage.schema()!r}")
            print(f"job {job_id} retried from the dead-letter queue: {job.state.value} in queue "
                  f"{job.queue!r}", file=out)
            return 0
        every = None if args.kind or args.queue else _EVERY_ID
        n = storage.bulk_retry_from_dlq(engine, ListDlqFilter(kind=args.kind, queue=args.queue,
                                                              before_id=every))
    print(f"retried {n} job{'' if n == 1 else 's'}{_which(args)} from the dead-letter queue", file=out)
    return 0


def cmd_dlq_purge(args: argparse.Namespace, out: TextIO) -> int:
    if not args.yes:
        raise CommandFailed(f"dlq purge deletes the dead-lettered jobs{_which(args)} for good: "
                            f"add --yes to go ahead")
    with installed(args, "dlq purge") as (engine, storage):
        n = storage.purge_dlq(engine, args.kind, args.queue)
    print(f"purged {n} job{'' if n == 1 else 's'}{_which(args)} from the dead-letter queue", file=out)
    return 0


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add ``qstore dlq list|retry|purge`` to the subcommands."""
    dlq = sub.add_parser("dlq", help="list, retry or purge dead-lettered jobs")
    actions = dlq.add_subparsers(dest="action", required=True, metavar="{list,retry,purge}")
    listing = actions.add_parser("list", parents=[common], help="the newest dead-lettered jobs first")
    listing.add_argument("--limit", metavar="N", help=f"at most N jobs (default {DEFAULT_LIMIT})")
    listing.add_argument("--json", action="store_true", help="print the jobs as JSON")
    listing.set_defaults(func=cmd_dlq_list)
    retry = actions.add_parser("retry", parents=[common], help="re-enqueue one job, or --all matching ones")
    retry.add_argument("job_id", metavar="ID", nargs="?", help="the job id")
    retry.add_argument("--all", action="store_true", help="every dead-lettered job (of --kind/--queue)")
    retry.set_defaults(func=cmd_dlq_retry)
    purge = actions.add_parser("purge", parents=[common], help="delete dead-lettered jobs for good")
    purge.add_argument("--yes", action="store_true", help="confirm the deletion")
    purge.set_defaults(func=cmd_dlq_purge)
    for parser in (listing, retry, purge):
        parser.add_argument("--kind", metavar="K", help="only jobs of this kind")
        parser.add_argument("--queue", metavar="Q", help="only jobs of this (logical) queue")
