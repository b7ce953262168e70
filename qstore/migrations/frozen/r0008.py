"""Frozen DDL of revision 0008: lanes are created with the schema owner's rights.

``ensure_lane`` creates a lane's two cursor sequences the first time a job is enqueued into
that lane. From this revision it runs ``SECURITY DEFINER`` (as the role that owns the
function, the migration role) with a fixed ``search_path``, so a runtime role that may not
create anything in the schema can still enqueue into a new queue or priority; the new
sequences belong to the owner, and the owner's default privileges
(``qstore install --grant``) give the runtime role their use. The body is revision 0001's,
unchanged. The downgrade restores revision 0001's statement (``SECURITY INVOKER``, no
settings). This module holds both texts whole. Never edited after landing (see
:mod:`qstore.migrations.frozen.r0001`).
"""

from __future__ import annotations

from qstore.migrations.frozen.r0001 import Shape


def ensure_lane(s: str) -> str:
    """``ensure_lane`` as this revision installs it."""
    return f"""CREATE OR REPLACE FUNCTION {s}.ensure_lane(p_queue text, p_logical text, p_priority smallint, p_shard smallint) RETURNS void LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
  v_hash text;
  v_enq text;
  v_claim text;
BEGIN
  IF EXISTS (SELECT 1 FROM {s}.queue_claim_heads h
             WHERE h.queue = p_queue AND h.priority = p_priority AND h.enqueue_shard = p_shard) THEN
    RETURN;
  END IF;
  PERFORM pg_advisory_xact_lock(hashtextextended(
    '{s}:lane:' || p_queue || ':' || p_priority || ':' || p_shard, 0));
  IF EXISTS (SELECT 1 FROM {s}.queue_claim_heads h
             WHERE h.queue = p_queue AND h.priority = p_priority AND h.enqueue_shard = p_shard) THEN
    RETURN;
  END IF;
  v_hash := md5(p_queue || ':' || p_priority || ':' || p_shard);
  v_enq := 'queue_enqueue_seq_' || v_hash;
  v_claim := 'queue_claim_seq_' || v_hash;
  EXECUTE format('CREATE SEQUENCE IF NOT EXISTS %I.%I AS bigint MINVALUE 0 START 1 CACHE 1',
                 '{s}', v_enq);
  EXECUTE format('CREATE SEQUENCE IF NOT EXISTS %I.%I AS bigint MINVALUE 0 START 1 CACHE 1',
                 '{s}', v_claim);
  INSERT INTO {s}.queue_lanes (queue, priority) VALUES (p_queue, p_priority)
    ON CONFLICT DO NOTHING;
  INSERT INTO {s}.queue_enqueue_heads (queue, priority, enqueue_shard, enqueue_seq)
    VALUES (p_queue, p_priority, p_shard, format('%I.%I', '{s}', v_enq)::regclass)
    ON CONFLICT DO NOTHING;
  INSERT INTO {s}.queue_claim_heads
      (queue, priority, enqueue_shard, logical_queue, enqueue_seq, claim_seq)
    VALUES (p_queue, p_priority, p_shard, p_logical,
            format('%I.%I', '{s}', v_enq)::regclass, format('%I.%I', '{s}', v_claim)::regclass)
    ON CONFLICT DO NOTHING;
END
$$"""


def _invoker(s: str) -> str:
    """Revision 0001's ``ensure_lane`` statement (what the downgrade restores)."""
    return f"""CREATE OR REPLACE FUNCTION {s}.ensure_lane(p_queue text, p_logical text, p_priority smallint, p_shard smallint) RETURNS void LANGUAGE plpgsql VOLATILE AS $$
DECLARE
  v_hash text;
  v_enq text;
  v_claim text;
BEGIN
  IF EXISTS (SELECT 1 FROM {s}.queue_claim_heads h
             WHERE h.queue = p_queue AND h.priority = p_priority AND h.enqueue_shard = p_shard) THEN
    RETURN;
  END IF;
  PERFORM pg_advisory_xact_lock(hashtextextended(
    '{s}:lane:' || p_queue || ':' || p_priority || ':' || p_shard, 0));
  IF EXISTS (SELECT 1 FROM {s}.queue_claim_heads h
             WHERE h.queue = p_queue AND h.priority = p_priority AND h.enqueue_shard = p_shard) THEN
    RETURN;
  END IF;
  v_hash := md5(p_queue || ':' || p_priority || ':' || p_shard);
  v_enq := 'queue_enqueue_seq_' || v_hash;
  v_claim := 'queue_claim_seq_' || v_hash;
  EXECUTE format('CREATE SEQUENCE IF NOT EXISTS %I.%I AS bigint MINVALUE 0 START 1 CACHE 1',
                 '{s}', v_enq);
  EXECUTE format('CREATE SEQUENCE IF NOT EXISTS %I.%I AS bigint MINVALUE 0 START 1 CACHE 1',
                 '{s}', v_claim);
  INSERT INTO {s}.queue_lanes (queue, priority) VALUES (p_queue, p_priority)
    ON CONFLICT DO NOTHING;
  INSERT INTO {s}.queue_enqueue_heads (queue, priority, enqueue_shard, enqueue_seq)
    VALUES (p_queue, p_priority, p_shard, format('%I.%I', '{s}', v_enq)::regclass)
    ON CONFLICT DO NOTHING;
  INSERT INTO {s}.queue_claim_heads
      (queue, priority, enqueue_shard, logical_queue, enqueue_seq, claim_seq)
    VALUES (p_queue, p_priority, p_shard, p_logical,
            format('%I.%I', '{s}', v_enq)::regclass, format('%I.%I', '{s}', v_claim)::regclass)
    ON CONFLICT DO NOTHING;
END
$$"""


def upgrade(shape: Shape) -> list[str]:
    return [ensure_lane(shape.schema)]


def downgrade(shape: Shape) -> list[str]:
    return [_invoker(shape.schema)]
