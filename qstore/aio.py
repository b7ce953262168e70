"""The async face of the storage: :class:`AsyncQueueStorage`.

It reads the same operation list as :class:`~qstore.storage.QueueStorage`
(:class:`~qstore.storage.Operations`): each operation runs its synchronous call in a
greenlet on the async target's synchronous counterpart (``AsyncEngine.sync_engine``,
``AsyncConnection.sync_connection``, ``AsyncSession.sync_session``), so an operation gets
exactly the transaction it gets on the sync face (see :mod:`qstore.storage.targets`) and
the two faces cannot drift apart. Requires the ``async`` extra (``sqlalchemy[asyncio]``)
and an async driver URL such as ``postgresql+psycopg://…`` for ``create_async_engine``.

Without the extra (no ``greenlet`` module), importing this module raises
:class:`AsyncExtraMissingError`, whose one-line message names ``pip install 'qstore[async]'``.
It is both an ``ImportError`` (an optional dependency is missing) and a
:class:`~qstore.errors.QueueStorageError` (every error qstore raises is one); the same
error comes from the async face of a task (``App.async_storage``, ``Task.defer_async``).
"""

from __future__ import annotations

import importlib
from typing import Any

from sqlalchemy.util.concurrency import greenlet_spawn

from qstore.config import QueueStorageConfig
from qstore.errors import QueueStorageError, ValidationError
from qstore.storage import Naming, Operations, QueueStorage
from qstore.storage.operations import AsyncFace, Operation
from qstore.storage.targets import AsyncTarget, sync_target


class AsyncExtraMissingError(QueueStorageError, ImportError):
    """The async face needs the ``async`` extra (``greenlet``), which is not installed. An
    ``ImportError`` and a :class:`~qstore.errors.QueueStorageError`; its message is one line."""


def _require_greenlet() -> None:
    """Raise :class:`AsyncExtraMissingError` when ``greenlet`` (what SQLAlchemy runs the
    async face on) cannot be imported; SQLAlchemy would only fail at the first call, with
    an error naming its own extra."""
    try:
        importlib.import_module("greenlet")
    except ImportError:
        raise AsyncExtraMissingError(
            "qstore.aio needs the 'async' extra (greenlet), which is not installed: "
            "pip install 'qstore[async]'") from None


_require_greenlet()

__all__ = ["AsyncExtraMissingError", "AsyncQueueStorage", "AsyncTarget"]


class AsyncQueueStorage(Operations, Naming, AsyncFace):
    """``await storage.enqueue_params_batch(async_engine, jobs)`` and so on: every operation
    of :class:`~qstore.storage.Operations` as a coroutine over an ``AsyncEngine``,
    ``AsyncConnection`` or ``AsyncSession``. :attr:`sync` is the synchronous face of the
    same install (same routing state)."""

    def __init__(self, config: QueueStorageConfig | QueueStorage | None = None) -> None:
        if config is not None and not isinstance(config, QueueStorageConfig | QueueStorage):
            raise ValidationError("config", config, "expected QueueStorageConfig, QueueStorage or None")
        self.sync = config if isinstance(config, QueueStorage) else QueueStorage(config)
        self._ctx = self.sync._ctx

    def _bind_operation(self, operation: Operation[Any, Any]) -> Any:
        return operation.bind_async(self._ctx)

    @staticmethod
    async def active_schema(target: AsyncTarget) -> str | None:
        """Schema most recently registered as the active queue-storage backend, or None."""
        return await greenlet_spawn(QueueStorage.active_schema, await sync_target(target))

    active_schema_in_tx = active_schema

    def __repr__(self) -> str:
        return f"AsyncQueueStorage({self._ctx.config!r})"
