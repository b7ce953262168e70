"""Frozen SQL of every landed revision, one module per revision that changes DDL.

``rNNNN.upgrade(shape)`` / ``rNNNN.downgrade(shape)`` return the exact statements revision
``NNNN`` runs for an install of that shape (schema name, slot counts, stripe count, receipt
mode). A module here imports only the standard library and other modules of this package,
and is never edited once its revision has landed: changing what the install looks like is
a new revision with a new module. ``tests/test_revision_freeze.py`` renders every revision
for two shapes and compares the text with recorded digests, so an edit cannot slip through.

The schema name is a validated identifier (see :func:`qstore.config.validate_identifier`)
and is the only name interpolated unquoted; slot counts are integers.
"""
