"""The worker's decisions, shared by the thread worker and the asyncio worker (sans IO).

Nothing here touches the database, a thread or an event loop. Both workers
(:class:`qstore.runtime.worker.Worker`, :class:`qstore.aio.AsyncWorker`) hold what they
claimed as :class:`Attempt`s and ask this module what to do with them.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from qstore.runtime.tasks import JobOutcome
from qstore.status import UNHANDLED_KEY
from qstore.types import JobRow

__all__ = [
    "HAND_BACK_CAP",
    "HAND_BACK_FIRST",
    "UNHANDLED_KEY",
    "Unhandled",
    "unhandled",
]

#: Delay of the n-th hand-back of one job for lack of a task: ``HAND_BACK_FIRST`` seconds
#: doubled for each earlier hand-back the job's progress records, at most ``HAND_BACK_CAP``.
HAND_BACK_FIRST, HAND_BACK_CAP = 1.0, 60.0


class Unhandled(JobOutcome):
    """What a worker does with an attempt of a kind it has no task for: give it back
    (``snooze`` for ``seconds``: the attempt does not count) with ``progress`` (the job's
    progress plus the hand-back's record, or None to keep the job's own)."""

    def __init__(self, seconds: float, progress: Any, count: int) -> None:
        self.seconds = seconds
        self.progress = progress
        self.count = count
        super().__init__(f"no task for this kind: handed back for {seconds:g}s")


def unhandled(job: JobRow, now: datetime) -> Unhandled:
    """The hand-back of ``job``'s attempt for lack of a task: the n-th of this job (counted
    in its progress) waits ``HAND_BACK_FIRST * 2**(n-1)`` seconds, at most ``HAND_BACK_CAP``.
    The record goes into the progress when it is empty or a JSON object (the object's other
    keys kept); a progress of another shape is kept as it is, unrecorded."""
    prev = job.progress
    mark = prev.get(UNHANDLED_KEY) if isinstance(prev, dict) else None
    before = mark.get("count") if isinstance(mark, dict) else None
    count = (before if isinstance(before, int) and not isinstance(before, bool) and before > 0 else 0) + 1
    seconds = min(HAND_BACK_FIRST * 2 ** min(count - 1, 32), HAND_BACK_CAP)
    progress: Any = None
    if prev is None or isinstance(prev, dict):
        progress = {**(prev or {}), UNHANDLED_KEY: {"count": count, "run_lease": job.run_lease,
                                                    "at": now.isoformat()}}
    return Unhandled(seconds, progress, count)
