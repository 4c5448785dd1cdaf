"""``python -m tokenq.worker`` is ``tokenq worker``."""

import sys

from tokenq.worker.cli import main

sys.exit(main())
