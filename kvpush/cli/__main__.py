"""``python -m kvpush.cli``: the ``kvpush`` command without its console script."""

import sys

from kvpush.cli import main

sys.exit(main())
