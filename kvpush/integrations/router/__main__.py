"""``python -m kvpush.integrations.router``: the same as ``kvpush router``."""

from kvpush.integrations.router.cli import main

raise SystemExit(main())
