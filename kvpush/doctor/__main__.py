"""``python -m kvpush.doctor``: the same as ``kvpush doctor``."""

import sys

from kvpush.doctor.command import main

sys.exit(main())
