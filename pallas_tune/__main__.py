"""``python -m pallas_tune``: the same as the ``pallas-tune`` command."""

import sys

from pallas_tune.cli import main

sys.exit(main())
