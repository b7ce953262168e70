"""The worker: claims jobs of an app's queues and runs their tasks.

The public face of :mod:`qstore.runtime.worker`: :class:`Worker` (threads, a synchronous
``Engine``), :class:`AsyncWorker` (an event loop, an ``AsyncEngine``; from
:mod:`qstore.runtime.aio_worker`, loaded on first use since it needs the ``async`` extra),
:class:`WorkerSettings` and :class:`WorkerStats`. The maintainer a worker runs is
:class:`qstore.Maintainer`.
"""

from typing import TYPE_CHECKING, Any

from qstore.runtime.worker import Worker, WorkerSettings, WorkerStats

if TYPE_CHECKING:
    from qstore.runtime.aio_worker import AsyncWorker

__all__ = ["AsyncWorker", "Worker", "WorkerSettings", "WorkerStats"]


def __getattr__(name: str) -> Any:
    if name == "AsyncWorker":  # imported on first use: it needs the async extra (greenlet)
        from qstore.runtime.aio_worker import AsyncWorker

        return AsyncWorker
    raise AttributeError(f"module 'qstore.worker' has no attribute {name!r}")
