"""``python -m torchcache``: the ``torchcache`` command."""

from .cli import main

raise SystemExit(main())
