"""`python -m loadtest ...`: the same as `kvfree loadtest ...`."""

import sys

from loadtest.cli import main

sys.exit(main())
