"""``python -m qstore``: see :mod:`qstore.cli`."""

from qstore.cli import main

raise SystemExit(main())
