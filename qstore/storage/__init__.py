"""`QueueStorage`: the seed's method names as thin methods over the operation families.

Every operation takes a target first — an ``Engine`` (own transaction, committed), a
``Connection`` or an ORM ``Session`` (joins the caller's transaction, never commits) — see
:mod:`qstore.storage._tx`. The seed's ``*_in_tx`` / ``*_tx`` variants are the same methods
(aliases kept so a reader of the seed finds every name).
"""

from __future__ import annotations

from sqlalchemy import Connection

from qstore.config import QueueStorageConfig
from qstore.errors import translate_errors
from qstore.schema import StorageSchema, storage_schema
from qstore.storage import lifecycle
from qstore.storage._tx import Target

__all__ = ["QueueStorage"]


class QueueStorage:
    """Segmented queue storage for one schema (see STORAGE.md for the design)."""

    def __init__(self, config: QueueStorageConfig | None = None) -> None:
        self._config = config or QueueStorageConfig()
        self._schema: StorageSchema = storage_schema(self._config)

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def new(cls, config: QueueStorageConfig) -> QueueStorage:
        return cls(config)

    @classmethod
    def from_existing_schema(cls, schema: str, engine: Target | None = None) -> QueueStorage:
        """Storage for an existing ``schema``. Without ``engine``: default shape, no I/O
        (as the seed). With ``engine``: the shape recorded by the install is read back."""
        if engine is not None:
            return cls(translate_errors(lifecycle.load_config)(engine, schema))
        return cls(QueueStorageConfig(schema=schema))

    # -- naming -----------------------------------------------------------------------
    @property
    def config(self) -> QueueStorageConfig:
        return self._config

    @property
    def tables(self) -> StorageSchema:
        """The declared schema objects of this install (tables, rings, functions)."""
        return self._schema

    def schema(self) -> str:
        return self._config.schema

    def slot_count(self) -> int:
        return self._config.queue_slot_count

    def queue_slot_count(self) -> int:
        return self._config.queue_slot_count

    def lease_slot_count(self) -> int:
        return self._config.lease_slot_count

    def claim_slot_count(self) -> int:
        return self._config.claim_slot_count

    def queue_stripe_count(self) -> int:
        return self._config.queue_stripe_count

    def lease_claim_receipts(self) -> bool:
        return self._config.lease_claim_receipts

    def ready_child_relname(self, slot: int) -> str:
        return self._config.ready_child_relname(slot)

    def done_child_relname(self, slot: int) -> str:
        return self._config.done_child_relname(slot)

    def leases_child_relname(self, slot: int) -> str:
        return self._config.leases_child_relname(slot)

    @staticmethod
    def leases_relname() -> str:
        return "leases"

    @staticmethod
    def lease_claims_relname() -> str:
        return "lease_claims"

    @staticmethod
    def lease_claim_closures_relname() -> str:
        return "lease_claim_closures"

    @staticmethod
    def attempt_state_relname() -> str:
        return "attempt_state"

    # -- lifecycle --------------------------------------------------------------------
    @staticmethod
    @translate_errors
    def active_schema(engine: Target) -> str | None:
        """Schema most recently registered as the active queue-storage backend, or None."""
        return lifecycle.active_schema(engine)

    @staticmethod
    @translate_errors
    def active_schema_in_tx(conn: Connection) -> str | None:
        return lifecycle.active_schema_in_tx(conn)

    @translate_errors
    def prepare_schema(self, engine: Target) -> bool:
        """Idempotently install/upgrade this schema via Alembic (per-schema advisory lock).
        Returns True when this call ran a migration."""
        return lifecycle.prepare_schema(engine, self._config)

    @translate_errors
    def activate_backend(self, engine: Target) -> None:
        lifecycle.activate_backend(engine, self._schema)

    @translate_errors
    def install(self, engine: Target) -> None:
        """``prepare_schema`` then ``activate_backend``."""
        lifecycle.prepare_schema(engine, self._config)
        lifecycle.activate_backend(engine, self._schema)

    @translate_errors
    def reset(self, engine: Target, *, force: bool = False) -> None:
        """Drop this schema entirely. Refuses the default schema unless ``force=True``."""
        lifecycle.reset(engine, self._schema, force=force)

    def __repr__(self) -> str:
        return f"QueueStorage({self._config!r})"



