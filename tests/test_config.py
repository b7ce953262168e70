"""QueueStorageConfig validation and the naming part of QueueStorage (no database)."""

from __future__ import annotations

import pytest

from qstore import DEFAULT_SCHEMA, QueueStorage, QueueStorageConfig, ValidationError


def test_defaults_are_schema_qstore_with_16_8_8_slots_one_stripe_and_receipts_on():
    cfg = QueueStorageConfig()
    assert cfg.schema == DEFAULT_SCHEMA == "qstore"
    assert (cfg.queue_slot_count, cfg.lease_slot_count, cfg.claim_slot_count) == (16, 8, 8)
    assert cfg.queue_stripe_count == 1
    assert cfg.lease_claim_receipts is True
    assert cfg.uses_defaults()


def test_storage_accessors_report_the_configured_shape():
    s = QueueStorage.new(QueueStorageConfig(schema="shop", queue_slot_count=5, lease_slot_count=3,
                                            claim_slot_count=2, queue_stripe_count=4,
                                            lease_claim_receipts=False))
    assert s.schema() == "shop"
    assert s.slot_count() == s.queue_slot_count() == 5
    assert s.lease_slot_count() == 3
    assert s.claim_slot_count() == 2
    assert s.queue_stripe_count() == 4
    assert s.lease_claim_receipts() is False


def test_storage_without_config_uses_the_default_schema():
    assert QueueStorage().schema() == "qstore"


@pytest.mark.parametrize("bad", ["Bad", "1x", "a-b", "pg_x", "", "a" * 49, "has space", "ü"])
def test_bad_schema_identifier_raises_validation_error_naming_the_value(bad):
    with pytest.raises(ValidationError) as info:
        QueueStorageConfig(schema=bad)
    assert info.value.field == "schema"
    assert info.value.value == bad
    assert repr(bad) in str(info.value)


def test_schema_of_48_characters_is_accepted():
    assert QueueStorageConfig(schema="a" * 48).schema == "a" * 48


def test_non_string_schema_raises_validation_error():
    with pytest.raises(ValidationError, match="schema"):
        QueueStorageConfig(schema=123)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "below_minimum"),
    [("queue_slot_count", 3), ("lease_slot_count", 1), ("claim_slot_count", 1)],
)
def test_slot_count_below_minimum_raises_validation_error_naming_the_value(field, below_minimum):
    with pytest.raises(ValidationError) as info:
        QueueStorageConfig(schema="custom", **{field: below_minimum})
    assert info.value.field == field
    assert info.value.value == below_minimum
    assert f"{field}={below_minimum!r}" in str(info.value)


@pytest.mark.parametrize(
    ("field", "minimum"),
    [("queue_slot_count", 4), ("lease_slot_count", 2), ("claim_slot_count", 2)],
)
def test_slot_count_at_minimum_is_accepted(field, minimum):
    cfg = QueueStorageConfig(schema="custom", **{field: minimum})
    assert getattr(cfg, field) == minimum


@pytest.mark.parametrize("stripes", [0, -1])
def test_stripe_count_below_one_raises_validation_error(stripes):
    with pytest.raises(ValidationError) as info:
        QueueStorageConfig(schema="custom", queue_stripe_count=stripes)
    assert info.value.field == "queue_stripe_count"
    assert info.value.value == stripes


@pytest.mark.parametrize("value", ["8", 8.0, None, True])
def test_non_integer_slot_count_raises_validation_error(value):
    with pytest.raises(ValidationError) as info:
        QueueStorageConfig(schema="custom", queue_slot_count=value)
    assert info.value.field == "queue_slot_count"
    assert repr(value) in str(info.value)


def test_non_bool_receipt_mode_raises_validation_error():
    with pytest.raises(ValidationError, match="lease_claim_receipts"):
        QueueStorageConfig(schema="custom", lease_claim_receipts="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "shape",
    [{"queue_slot_count": 8}, {"lease_slot_count": 4}, {"claim_slot_count": 4},
     {"queue_stripe_count": 2}, {"lease_claim_receipts": False}],
)
def test_default_schema_with_non_default_shape_is_rejected(shape):
    with pytest.raises(ValidationError) as info:
        QueueStorageConfig(schema="qstore", **shape)
    assert info.value.field == "schema"
    assert "qstore" in str(info.value)


def test_validation_error_is_a_value_error():
    with pytest.raises(ValueError):
        QueueStorageConfig(schema="Bad")


def test_child_relname_helpers_append_the_slot_without_schema_or_range_check():
    s = QueueStorage(QueueStorageConfig(schema="shop", queue_slot_count=4))
    assert s.ready_child_relname(3) == "ready_entries_3"
    assert s.done_child_relname(0) == "done_entries_0"
    assert s.leases_child_relname(1) == "leases_1"
    assert s.ready_child_relname(99) == "ready_entries_99"


def test_parent_relname_helpers_name_the_execution_plane_tables():
    assert QueueStorage.leases_relname() == "leases"
    assert QueueStorage.lease_claims_relname() == "lease_claims"
    assert QueueStorage.lease_claim_closures_relname() == "lease_claim_closures"
    assert QueueStorage.lease_claim_closure_batches_relname() == "lease_claim_closure_batches"
    assert QueueStorage.attempt_state_relname() == "attempt_state"


def test_from_existing_schema_without_engine_uses_default_shape_without_io():
    s = QueueStorage.from_existing_schema("x")  # no engine: must not touch a database
    assert s.schema() == "x"
    assert s.config == QueueStorageConfig(schema="x")


def test_from_existing_schema_with_bad_name_raises_validation_error():
    with pytest.raises(ValidationError):
        QueueStorage.from_existing_schema("Not-A-Schema")


def test_config_is_hashable_and_equal_by_value():
    a = QueueStorageConfig(schema="x", queue_slot_count=5)
    b = QueueStorageConfig(schema="x", queue_slot_count=5)
    assert a == b
    assert hash(a) == hash(b)


def test_notify_channels_include_prefix_schema_and_queue():
    cfg = QueueStorageConfig(schema="shop")
    assert cfg.notify_channel("mail") == "qstore:shop:mail"
    assert cfg.cancel_channel == "qstore:shop:cancel"
