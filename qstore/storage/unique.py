"""Unique-key ownership (``job_unique_claims``): a job holds its key while its state's bit
is set in its ``unique_states`` mask; every transition syncs it."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sqlalchemy import Connection, delete, select, tuple_
from sqlalchemy.dialects.postgresql import insert as pg_insert

from qstore.errors import UniqueConflictError
from qstore.model import JobState
from qstore.schema import StorageSchema
from qstore.storage.jobs import holds_key

__all__ = ["Transition", "acquire", "holds", "release", "sync", "takes_key", "try_acquire"]

holds = holds_key


@dataclass(frozen=True)
class Transition:
    job_id: int
    unique_key: bytes | None
    unique_states: str | None
    old: JobState | None  # None = the job is new
    new: JobState | None  # None = the job is gone (discarded / pruned)


def acquire(conn: Connection, sch: StorageSchema, owners: Sequence[tuple[bytes, int]]) -> None:
    """Take ``(key, job_id)`` ownership; a key owned by another job raises
    :class:`UniqueConflictError` (the caller's transaction must not commit the batch)."""
    if not owners:
        return
    seen: dict[bytes, int] = {}
    for key, job_id in owners:
        if seen.setdefault(key, job_id) != job_id:
            raise UniqueConflictError("job_unique_claims", f"duplicate unique key {key.hex()} in one batch")
    t = sch.unique_claims
    ins = pg_insert(t).values([{"unique_key": k, "job_id": j} for k, j in seen.items()])
    stmt = ins.on_conflict_do_update(
        index_elements=[t.c.unique_key],
        set_={"job_id": ins.excluded.job_id},
        where=t.c.job_id == ins.excluded.job_id,
    ).returning(t.c.unique_key)
    got = set(conn.execute(stmt).scalars())
    missing = [k for k in seen if k not in got]
    if missing:
        owner = conn.execute(select(t.c.job_id).where(t.c.unique_key == missing[0])).scalar()
        raise UniqueConflictError(
            "job_unique_claims", f"unique key {missing[0].hex()} is owned by job {owner}"
        )


def try_acquire(conn: Connection, sch: StorageSchema, owners: Sequence[tuple[bytes, int]]) -> dict[int, int]:
    """Take ``(key, job_id)`` ownership where the key is free (or already the job's); never
    raises for a key owned by another job. Returns ``{job_id: owning job_id}`` for the jobs
    that did not get their key. Within ``owners`` the first job naming a key wins it."""
    lost: dict[int, int] = {}
    first: dict[bytes, int] = {}
    for key, job_id in owners:
        winner = first.setdefault(key, job_id)
        if winner != job_id:
            lost[job_id] = winner
    if not first:
        return lost
    t = sch.unique_claims
    ins = pg_insert(t).values([{"unique_key": k, "job_id": j} for k, j in first.items()])
    stmt = ins.on_conflict_do_update(
        index_elements=[t.c.unique_key],
        set_={"job_id": ins.excluded.job_id},
        where=t.c.job_id == ins.excluded.job_id,
    ).returning(t.c.unique_key)
    got = set(conn.execute(stmt).scalars())
    missing = [k for k in first if k not in got]
    if missing:
        owner = dict(conn.execute(select(t.c.unique_key, t.c.job_id)
                                  .where(t.c.unique_key.in_(missing))).all())
        for key in missing:
            lost[first[key]] = owner.get(key, -1)
    # a job that lost to another job of this batch whose own key went elsewhere still lost
    return lost


def release(conn: Connection, sch: StorageSchema, owners: Iterable[tuple[bytes, int]]) -> None:
    pairs = list(owners)
    if not pairs:
        return
    t = sch.unique_claims
    conn.execute(delete(t).where(tuple_(t.c.unique_key, t.c.job_id).in_(pairs)))


def takes_key(tr: Transition) -> bool:
    """Whether ``tr`` makes its job take its unique key (held in the new state, not the old)."""
    return (tr.unique_key is not None and tr.new is not None and holds_key(tr.unique_states, tr.new)
            and not (tr.old is not None and holds_key(tr.unique_states, tr.old)))


def sync(conn: Connection, sch: StorageSchema, transitions: Iterable[Transition]) -> None:
    """Apply ownership changes implied by state transitions (acquire first, then release)."""
    take: list[tuple[bytes, int]] = []
    drop: list[tuple[bytes, int]] = []
    for tr in transitions:
        if tr.unique_key is None:
            continue
        had = tr.old is not None and holds_key(tr.unique_states, tr.old)
        has = tr.new is not None and holds_key(tr.unique_states, tr.new)
        if has and not had:
            take.append((tr.unique_key, tr.job_id))
        elif had and not has:
            drop.append((tr.unique_key, tr.job_id))
    acquire(conn, sch, take)
    release(conn, sch, drop)


