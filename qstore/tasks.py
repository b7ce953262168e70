"""Tasks: functions registered under a job kind, deferred as jobs and run by a worker.

The public face of :mod:`qstore.runtime.tasks`: :class:`App` (the registry and its
``@app.task`` and ``@app.periodic`` decorators), :class:`Task`, :class:`JobContext` (what a
handler gets), the outcomes a handler returns or raises (:class:`Snooze`,
:class:`RetryAfter`, :class:`Cancel`, :class:`Fail`, :class:`WaitForCallback`) and
:class:`Deferral`; and, from :mod:`qstore.runtime.periodic`, :class:`MissingExtraError`
(``cron=`` without the ``cron`` extra).
"""

from qstore.runtime.periodic import MissingExtraError
from qstore.runtime.tasks import (
    App,
    Cancel,
    Deferral,
    Fail,
    JobContext,
    JobOutcome,
    RetryAfter,
    Snooze,
    Task,
    WaitForCallback,
)

__all__ = [
    "App",
    "Cancel",
    "Deferral",
    "Fail",
    "JobContext",
    "JobOutcome",
    "MissingExtraError",
    "RetryAfter",
    "Snooze",
    "Task",
    "WaitForCallback",
]
