"""Ring-partitioned tables: a LIST-partitioned parent plus children derived from it.

A ring family is declared once; its children are real :class:`~sqlalchemy.Table` objects
copied from the parent's columns and primary key and rendered as
``CREATE TABLE <child> PARTITION OF <parent> FOR VALUES IN (k)``. Indexes are declared on
the parent only: PostgreSQL creates the matching child indexes itself, and the Alembic glue
(:mod:`qstore.migrate`) ignores those derived child indexes when comparing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Column, MetaData, PrimaryKeyConstraint, Table
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.schema import CreateTable, SchemaItem

__all__ = ["PARTITION_OF", "PARTITION_VALUE", "RingFamily", "child_name", "is_partition_child", "ring_table"]

PARTITION_OF = "qstore_partition_of"
PARTITION_VALUE = "qstore_partition_value"


def child_name(parent: str, slot: int) -> str:
    """The relation name of ring child ``slot`` of ``parent`` (``<parent>_<slot>``)."""
    return f"{parent}_{slot}"


@dataclass(frozen=True)
class RingFamily:
    """A partitioned parent and its slot children, index ``k`` ↔ ``FOR VALUES IN (k)``."""

    parent: Table
    slot_column: str
    children: tuple[Table, ...]

    def child(self, slot: int) -> Table:
        return self.children[slot]

    @property
    def name(self) -> str:
        return self.parent.name


def ring_table(
    metadata: MetaData,
    name: str,
    slot_column: str,
    slot_count: int,
    *items: SchemaItem,
    schema: str,
    child_with: dict[str, Any] | None = None,
    **table_kw: Any,
) -> RingFamily:
    """Declare ``name`` partitioned by LIST(``slot_column``) with ``slot_count`` children.

    ``items`` are the parent's columns, constraints and indexes. Children copy the columns
    and the primary key (PostgreSQL gives them the same ones) and carry ``child_with`` as
    their storage parameters.
    """
    parent = Table(
        name,
        metadata,
        *items,
        schema=schema,
        postgresql_partition_by=f"LIST ({slot_column})",
        **table_kw,
    )
    pk_cols = [c.name for c in parent.primary_key.columns]
    children = []
    for slot in range(slot_count):
        cols: list[SchemaItem] = [
            Column(c.name, c.type, nullable=c.nullable, server_default=c.server_default)
            for c in parent.columns
        ]
        if pk_cols:
            cols.append(PrimaryKeyConstraint(*pk_cols, name=f"{name}_{slot}_pkey"))
        child = Table(
            child_name(name, slot),
            metadata,
            *cols,
            schema=schema,
            info={PARTITION_OF: parent, PARTITION_VALUE: slot},
            postgresql_with=dict(child_with) if child_with else None,
        )
        child.add_is_dependent_on(parent)
        children.append(child)
    return RingFamily(parent=parent, slot_column=slot_column, children=tuple(children))


def is_partition_child(table: Table) -> bool:
    return PARTITION_OF in table.info


@compiles(CreateTable, "postgresql")
def _compile_create_table(element: CreateTable, compiler: Any, **kw: Any) -> str:
    table: Table = element.element
    parent: Table | None = table.info.get(PARTITION_OF)
    if parent is None:
        return compiler.visit_create_table(element, **kw)
    prep = compiler.preparer
    ddl = (
        f"\nCREATE TABLE {prep.format_table(table)} PARTITION OF {prep.format_table(parent)} "
        f"FOR VALUES IN ({int(table.info[PARTITION_VALUE])})"
    )
    with_opts = table.dialect_options["postgresql"]["with"]
    if with_opts:
        ddl += " WITH ({})".format(", ".join(f"{k} = {v}" for k, v in with_opts.items()))
    return ddl + "\n\n"
