"""`python -m kvfree ...`: the same as the `kvfree` command."""

from kvfree.cli import main

raise SystemExit(main())
