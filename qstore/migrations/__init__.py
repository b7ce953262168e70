"""Packaged Alembic environment and revisions (branch label ``qstore``)."""
