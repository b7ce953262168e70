"""The async face of :class:`~qstore.storage.QueueStorage`: same statements, same code.

Every storage method is reached through ``run_sync`` on an ``AsyncConnection`` /
``AsyncSession``, so sync and async behaviour cannot drift. Targets follow the same
contract: an ``AsyncEngine`` runs the operation in its own transaction and commits; an
``AsyncConnection`` or ``AsyncSession`` joins the caller's transaction and never commits.
Requires the ``async`` extra (``sqlalchemy[asyncio]``) and an async driver URL such as
``postgresql+psycopg://…`` passed to ``create_async_engine``.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any, TypeAlias

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession

from qstore.config import QueueStorageConfig
from qstore.errors import ValidationError
from qstore.storage import QueueStorage

__all__ = ["AsyncQueueStorage", "AsyncTarget"]

AsyncTarget: TypeAlias = AsyncEngine | AsyncConnection | AsyncSession

#: QueueStorage attributes that are not operations on a target.
_NOT_OPS = frozenset({
    "new", "from_existing_schema", "config", "tables", "schema", "slot_count", "queue_slot_count",
    "lease_slot_count", "claim_slot_count", "queue_stripe_count", "lease_claim_receipts",
    "ready_child_relname", "done_child_relname", "leases_child_relname", "leases_relname",
    "lease_claims_relname", "lease_claim_closures_relname", "attempt_state_relname",
})


async def run_on(target: AsyncTarget, fn: Callable[..., Any]) -> Any:
    """Run ``fn(sync_target)`` on ``target`` following the transaction contract."""
    if isinstance(target, AsyncEngine):
        async with target.begin() as conn:
            return await conn.run_sync(fn)
    if isinstance(target, AsyncConnection | AsyncSession):
        return await target.run_sync(fn)
    raise ValidationError("target", type(target).__name__,
                          "expected an AsyncEngine, AsyncConnection or AsyncSession")


class AsyncQueueStorage:
    """``await storage.enqueue_params_batch(async_engine, jobs)`` etc.: every method of
    :class:`QueueStorage` that takes a target, as a coroutine."""

    def __init__(self, config: QueueStorageConfig | QueueStorage | None = None) -> None:
        self.sync = config if isinstance(config, QueueStorage) else QueueStorage(config)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.sync, name)
        if name.startswith("_") or name in _NOT_OPS or not callable(attr):
            return attr

        @functools.wraps(attr)
        def op(target: AsyncTarget, *args: Any, **kwargs: Any) -> Awaitable[Any]:
            return run_on(target, lambda sync_target: attr(sync_target, *args, **kwargs))

        return op

    async def prepare_schema(self, engine: AsyncEngine) -> bool:
        """Install/upgrade through Alembic on one async connection (advisory-locked)."""
        return bool(await run_on(engine, self.sync.prepare_schema))

    @staticmethod
    async def active_schema(target: AsyncTarget) -> str | None:
        return await run_on(target, QueueStorage.active_schema_in_tx)
