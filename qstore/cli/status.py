"""``qstore status``: what an install holds right now (:mod:`qstore.status`).

Three fixed-width tables — queues, rings, table families — or, with ``--json``, the report's
``as_dict()`` (stable keys: ``schema``, ``exact``, ``counters_trusted``, ``shape``,
``queues``, ``rings``, ``health``, ``handed_back``). Jobs handed back by workers that have no
task for their kind get a table of their own, after the queues, when there are any. ``--fast`` reads the lane heads instead of the exact
counts (see ``QueueStorage.queue_counts_fast`` for its bounds) and skips the per-state scan
of retained terminal rows.
"""

from __future__ import annotations

import argparse
from typing import Any, TextIO

from qstore.cli.common import human_bytes, installed, print_json, table_lines
from qstore.status import StatusReport, status_report

__all__ = ["cmd_status", "register", "report_lines"]


def report_lines(report: StatusReport) -> list[str]:
    """The readable form of ``report``: a heading line, then the queue, ring and family
    tables separated by blank lines."""
    shape = report.shape
    counts = "exact counts" if report.exact else "fast counts (lane heads)"
    trust = "trusted" if report.counters_trusted else "NOT trusted (terminal counts scan done rows)"
    lines = [f"qstore schema {report.schema!r}: queue ring {shape['queue_slot_count']} slots, "
             f"lease ring {shape['lease_slot_count']}, claim ring {shape['claim_slot_count']}; "
             f"{counts}; terminal counters {trust}", ""]
    if report.queues:
        lines += table_lines(
            ("QUEUE", "AVAILABLE", "RUNNING", "CALLBACK", "SCHEDULED", "RETRYABLE", "TERMINAL",
             "COMPLETED", "CANCELLED", "FAILED", "DLQ", "PAUSED", "LANES"),
            [(q.queue, q.available, q.running, q.waiting_external, q.scheduled, q.retryable, q.terminal,
              q.completed, q.cancelled, q.failed, q.dlq, "yes" if q.paused else "no", q.lanes)
             for q in report.queues])
        if report.exact:
            lines.append("(completed/cancelled/failed: terminal rows not yet pruned; "
                         "terminal also counts pruned history)")
        else:
            lines.append("(fast: available is an upper bound, running omits receipt-only attempts, "
                         "terminal counts pruned history only)")
    else:
        lines.append("no queues yet")
    if report.handed_back:
        lines.append("")
        lines += table_lines(
            ("QUEUE", "KIND", "HANDED BACK", "MOST IN A ROW", "LAST"),
            [(h.queue, h.kind, h.jobs, h.most, h.last_at) for h in report.handed_back])
        lines.append("(scheduled jobs whose last attempt a worker gave back: it had no task for "
                     "their kind)")
    lines.append("")
    lines += table_lines(
        ("RING", "CURRENT SLOT", "GENERATION", "SLOTS", "SLOTS WITH DATA", "SIZE"),
        [(r.name, r.current_slot, r.generation, r.slot_count, r.slots_holding_data, human_bytes(r.bytes))
         for r in report.rings])
    lines.append("")
    health = report.health
    rows: list[tuple[Any, ...]] = [
        (f.name, f.tables, f.live_tuples, f.dead_tuples, human_bytes(f.bytes)) for f in health.families]
    rows.append(("total", len(health.tables), health.live_tuples, health.dead_tuples,
                 human_bytes(health.bytes)))
    lines += table_lines(("FAMILY", "TABLES", "LIVE TUPLES", "DEAD TUPLES", "SIZE"), rows)
    return lines


def cmd_status(args: argparse.Namespace, out: TextIO) -> int:
    with installed(args, "status") as (engine, storage):
        report = status_report(engine, storage, exact=not args.fast)
    if args.json:
        print_json(report.as_dict(), out)
    else:
        for line in report_lines(report):
            print(line, file=out)
    return 0


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add ``qstore status`` to the subcommands."""
    status = sub.add_parser("status", parents=[common],
                            help="per-queue counts, ring cursors and dead tuples/bytes per table family")
    status.add_argument("--json", action="store_true", help="print the report as JSON")
    status.add_argument("--fast", action="store_true",
                        help="lane-head counts (bounds, no scans) instead of the exact ones")
    status.set_defaults(func=cmd_status)
