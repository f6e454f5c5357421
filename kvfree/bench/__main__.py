"""`python -m kvfree.bench <what> [ARGS]`: the same as `kvfree bench`."""

from kvfree.bench.cli import main

raise SystemExit(main())
