"""Packaged Alembic environment and revisions (branch label ``qstore``).

:data:`REVISIONS` lists the ids of the shipped revisions in order, read from the file names
in ``versions/`` (``qstore_<id>_<slug>.py``, ids are four digits that sort in revision
order); the last one is the head, whose declaration :mod:`qstore.schema` and
:mod:`qstore.sql` hold.
"""

from __future__ import annotations

import re
from importlib import resources

__all__ = ["REVISIONS"]

_REVISION_FILE = re.compile(r"qstore_(\d{4})_\w+\.py")


def _revisions() -> tuple[str, ...]:
    names = (entry.name for entry in resources.files(__package__).joinpath("versions").iterdir())
    return tuple(sorted(m.group(1) for name in names if (m := _REVISION_FILE.fullmatch(name))))


#: Revision ids in order; the last is the head.
REVISIONS = _revisions()
