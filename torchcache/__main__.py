"""``python -m torchcache``: the ``torchcache`` command."""

from .cli.main import main

raise SystemExit(main())
