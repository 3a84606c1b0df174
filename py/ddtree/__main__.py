"""`python -m ddtree` is `ddtree-run`."""

import sys

from ddtree.cli import main

sys.exit(main())
