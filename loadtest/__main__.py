"""`python -m kvfree.loadtest ...`: the same as `kvfree loadtest ...`."""

import sys

from kvfree.loadtest.cli import main

sys.exit(main())
