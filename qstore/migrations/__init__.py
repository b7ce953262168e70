"""Packaged Alembic environment, revisions (branch label ``qstore``) and the frozen SQL each
revision installs. :data:`qstore.migrate.REVISIONS` lists the revisions in order."""
