"""The worker: claims jobs of an app's queues and runs their tasks.

The public face of :mod:`qstore.runtime.worker`: :class:`Worker`, :class:`WorkerSettings`
and :class:`WorkerStats`. The maintainer a worker runs is :class:`qstore.Maintainer`.
"""

from qstore.runtime.worker import Worker, WorkerSettings, WorkerStats

__all__ = ["Worker", "WorkerSettings", "WorkerStats"]
