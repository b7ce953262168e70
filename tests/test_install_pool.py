"""The session's pooled installs (tests/installs.py) hand every test exactly what a brand-new
install would show it: a used install, once reset, has the definitions, rows, sequence
positions and planner size statistics of a fresh install of its shape, and one whose
definitions a test changed is installed again."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone

import installs
import psycopg
import pytest
from installs import (
    BLOAT_PAGES,
    InstallPool,
    Shape,
    catalog_contents,
    catalog_fingerprint,
    catalog_structure,
    install,
    reset_install,
    shape_of,
    unique_schema,
)
from sqlalchemy import Engine, text

from qstore import InsertOpts, InsertParams, QueueStorage, QueueStorageConfig, UniqueOpts

UTC = timezone.utc
SHAPES = {
    "default": {},
    "small rings, leases, stripes": dict(queue_slot_count=4, lease_slot_count=2, claim_slot_count=2,
                                         lease_claim_receipts=False, queue_stripe_count=2),
}


def snapshot(engine: Engine, s: QueueStorage) -> tuple[dict, dict]:
    with engine.connect() as c:
        return catalog_structure(c, s.schema()), catalog_contents(c, s.schema())


def differences(got: dict, want: dict) -> dict:
    """``{kind: {name: (got, want)}}`` for every entry where the two snapshots differ."""
    out: dict = {}
    for kind in got.keys() | want.keys():
        g, w = got.get(kind), want.get(kind)
        if isinstance(g, dict) and isinstance(w, dict):
            diff = {k: (g.get(k), w.get(k)) for k in g.keys() | w.keys() if g.get(k) != w.get(k)}
        else:
            diff = {"*": (g, w)} if g != w else {}
        if diff:
            out[kind] = diff
    return out


def churn(engine: Engine, s: QueueStorage) -> None:
    """Write to every table family, create run-time lane sequences, grow a table past
    BLOAT_PAGES, vacuum the leases, rotate and prune every ring, activate the install."""
    s.install(engine)
    s.set_queue_options(engine, "q", enqueue_shards=2, dlq_enabled=True)
    s.set_queue_options(engine, "paused", paused=True)
    s.enqueue_batch(engine, "bulk", 1, 400)
    later = datetime.now(UTC) + timedelta(hours=1)
    s.enqueue_params_batch(engine, [
        InsertParams("k", {"i": i}, InsertOpts(queue="q", priority=1 + i % 4, max_attempts=1,
                                               metadata={"m": i}, tags=["t"]))
        for i in range(40)
    ] + [
        InsertParams("u", {"u": 1}, InsertOpts(queue="q", unique=UniqueOpts())),
        InsertParams("o", {"o": 1}, InsertOpts(queue="q", ordering_key=b"key")),
        InsertParams("d", {"d": 1}, InsertOpts(queue="q", run_at=later)),
        InsertParams("p", {"p": 1}, InsertOpts(queue="paused")),
    ])
    s.enqueue_params_copy(engine, [InsertParams("c", {"c": i}, InsertOpts(queue="copied"))
                                   for i in range(5)])
    # wide rows: the deferred backlog's heap outgrows BLOAT_PAGES while its indexes do not
    s.enqueue_params_batch(engine, [
        InsertParams("wide", {"pad": uuid.uuid4().hex * 45}, InsertOpts(queue="q", run_at=later))
        for _ in range(60)])
    s.acquire_queue_claimer(engine, "q", uuid.uuid4(), 2, 60, 10)
    got = s.claim_runtime_batch(engine, "q", 30, 60)
    assert len(got) == 30
    s.complete_runtime_batch(engine, got[:10])
    s.heartbeat_batch(engine, [(j.job.id, j.job.run_lease) for j in got[10:14]])
    s.retry_after(engine, got[14].job.id, got[14].job.run_lease, 3600)
    s.snooze(engine, got[15].job.id, got[15].job.run_lease, 3600)
    s.cancel_running(engine, got[16].job.id, got[16].job.run_lease, "stop")
    s.fail_terminal(engine, got[17].job.id, got[17].job.run_lease, "boom")
    s.fail_to_dlq(engine, got[18].job.id, got[18].job.run_lease, "poison", "boom")
    s.fail_retryable(engine, got[19].job.id, got[19].job.run_lease, "boom")
    s.register_callback(engine, got[20].job.id, got[20].job.run_lease, 3600)
    s.cancel_job(engine, s.claim_runtime_batch(engine, "copied", 1)[0].job.id)
    s.claim_runtime_batch(engine, "bulk", 300)
    for _ in range(3):
        for op in (s.rotate, s.prune_oldest, s.rotate_leases, s.prune_oldest_leases,
                   s.rotate_claims, s.prune_oldest_claims):
            op(engine)
        s.rollup_terminal_count_deltas(engine, 4)
    s.vacuum_leases(engine)


@pytest.fixture(scope="module")
def fresh(engine: Engine) -> Iterator[Callable[..., QueueStorage]]:
    """``fresh(**shape)`` → a brand-new install of ``shape`` (made once per module and shape,
    never written to), to compare pooled installs with."""
    made: dict[Shape, QueueStorage] = {}

    def get(**shape: object) -> QueueStorage:
        config = QueueStorageConfig(schema=unique_schema(), **shape)  # type: ignore[arg-type]
        if shape_of(config) not in made:
            with engine.begin() as c:
                install(c, config)
            made[shape_of(config)] = QueueStorage(config)
        return made[shape_of(config)]

    yield get
    with engine.begin() as c:
        for s in made.values():
            c.execute(text(f'DROP SCHEMA "{s.schema()}" CASCADE'))


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_used_install_once_reset_is_indistinguishable_from_a_fresh_install(
        engine: Engine, make_storage: Callable[..., QueueStorage], install_pool: InstallPool,
        fresh: Callable[..., QueueStorage], shape: str) -> None:
    used = make_storage(**SHAPES[shape])
    churn(engine, used)
    structure, contents = snapshot(engine, used)
    want_structure, want_contents = snapshot(engine, fresh(**SHAPES[shape]))
    # the churn left what a reset has to undo: rows, lane sequences, a grown and a vacuumed table
    assert contents["rows"] != want_contents["rows"]
    assert set(contents["sequences"]) > set(want_contents["sequences"])
    with engine.connect() as c:
        assert c.execute(text(
            f"SELECT max(pg_relation_size(c.oid)) FROM pg_class c WHERE c.relnamespace = "
            f"'\"{used.schema()}\"'::regnamespace")).scalar_one() >= BLOAT_PAGES * 8192
    assert contents["planner sizes"] != want_contents["planner sizes"]
    reinstalls = install_pool.held[used.schema()].reinstalls

    install_pool.reset(used.config)

    assert install_pool.held[used.schema()].reinstalls == reinstalls  # reset, not re-made
    structure, contents = snapshot(engine, used)
    assert differences(structure, want_structure) == {}
    assert differences(contents, want_contents) == {}


CHANGES = {
    "table renamed": 'ALTER TABLE "{s}".deferred_jobs RENAME TO deferred_jobs_gone',
    "table created": 'CREATE TABLE "{s}".extra (i int)',
    "index dropped": 'DROP INDEX "{s}".job_unique_claims_job_idx',
    "index added": 'CREATE INDEX extra_ix ON "{s}".deferred_jobs (kind)',
    "column added": 'ALTER TABLE "{s}".queue_meta ADD COLUMN extra int',
    "column added and dropped": 'ALTER TABLE "{s}".queue_meta ADD COLUMN extra int; '
                                'ALTER TABLE "{s}".queue_meta DROP COLUMN extra',
    "default changed": 'ALTER TABLE "{s}".queue_meta ALTER COLUMN enqueue_shards SET DEFAULT 2',
    "constraint added": 'ALTER TABLE "{s}".queue_meta ADD CONSTRAINT extra CHECK (enqueue_shards < 9)',
    "function body changed": 'CREATE OR REPLACE FUNCTION "{s}".backoff_duration(attempt integer, '
                             "max_attempts integer) RETURNS interval LANGUAGE sql "
                             "AS $$ SELECT interval '1 second' $$",
    "function added": 'CREATE FUNCTION "{s}".extra() RETURNS int LANGUAGE sql AS $$ SELECT 1 $$',
    "trigger added": 'CREATE TRIGGER extra BEFORE INSERT ON "{s}".queue_meta '
                     'FOR EACH ROW EXECUTE FUNCTION suppress_redundant_updates_trigger()',
    "sequence added": 'CREATE SEQUENCE "{s}".extra_seq',
    "type added": 'CREATE TYPE "{s}".extra AS ENUM (\'a\')',
    "table analyzed": 'INSERT INTO "{s}".queue_meta (queue) VALUES (\'a\'); ANALYZE "{s}".queue_meta',
    "schema dropped": 'DROP SCHEMA "{s}" CASCADE',
}


@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("known", ["digest only", "fingerprint"])
def test_a_reset_refuses_an_install_whose_definitions_changed(
        engine: Engine, make_storage: Callable[..., QueueStorage], install_pool: InstallPool,
        change: str, known: str) -> None:
    used = make_storage()
    held = install_pool.held[used.schema()]
    fingerprint = held.fingerprint if known == "fingerprint" else None
    with engine.connect() as c, c.begin() as tx:
        assert catalog_fingerprint(c, used.schema()) == held.fingerprint  # as the pool left it
        for statement in CHANGES[change].format(s=used.schema()).split("; "):
            c.execute(text(statement))

        assert reset_install(c, used.config, held.pristine, fingerprint) is None

        tx.rollback()  # the next hand-out finds the install intact: no re-install needed


def test_an_install_whose_definitions_changed_is_installed_again_by_the_next_reset(
        engine: Engine, make_storage: Callable[..., QueueStorage], install_pool: InstallPool,
        fresh: Callable[..., QueueStorage]) -> None:
    used = make_storage()
    with engine.begin() as c:
        c.execute(text(f'ALTER TABLE "{used.schema()}".deferred_jobs RENAME TO deferred_jobs_gone'))
        c.execute(text(f'INSERT INTO "{used.schema()}".queue_meta (queue) VALUES (\'a\')'))

    reinstalls = install_pool.held[used.schema()].reinstalls

    install_pool.reset(used.config)

    assert install_pool.held[used.schema()].reinstalls == reinstalls + 1
    assert differences(snapshot(engine, used)[0], snapshot(engine, fresh())[0]) == {}
    assert differences(snapshot(engine, used)[1], snapshot(engine, fresh())[1]) == {}


def test_releasing_an_install_another_session_still_locks_fails(
        db_url: str, install_pool: InstallPool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(installs, "LEAKED_LOCK_WAIT_S", 0.2)
    config = install_pool.acquire()
    dsn = db_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(dsn) as leaked:
        leaked.execute(f'SELECT count(*) FROM "{config.schema}".deferred_jobs')  # stays open
        with pytest.raises(AssertionError, match="still hold locks"):
            install_pool.release(config)
    assert config.schema in install_pool.retired


def test_an_install_released_for_dropping_is_dropped_and_not_handed_out_again(
        engine: Engine, install_pool: InstallPool) -> None:
    config = install_pool.acquire()

    install_pool.release(config, drop=True)

    with engine.connect() as c:
        assert catalog_structure(c, config.schema) == {}
    again = install_pool.acquire()
    try:
        assert again.schema != config.schema
    finally:
        install_pool.release(again)
