"""`python -m kvfree.bench.kernels [--op OP] [ARGS]`: run one op's device check script with the remaining arguments.

No --op runs the Mamba-2 / conv script (mamba2.py); `--op gka` runs kvfree.bench.kernels.gka, and so on. The
scripts are imported only when asked for, so a listed one may be missing until it is written.
"""

from __future__ import annotations

import importlib
import sys

# The ops `--op` accepts, each the module kvfree.bench.kernels.<op>; the first is the default.
OPS = ("mamba2", "gka", "lattice", "ska", "bmojo", "gdn", "attention", "attention_decode", "bmojo_f", "lattice_train")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    op = OPS[0]
    if "--op" in argv:
        at = argv.index("--op")
        op = argv[at + 1] if at + 1 < len(argv) else ""
        argv = argv[:at] + argv[at + 2 :]
    if op not in OPS:
        print(f"--op {op!r}: expected one of {', '.join(OPS)} (default {OPS[0]})", file=sys.stderr)
        return 2
    name = f"{__package__}.{op}"
    try:
        script = importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name:
            raise
        print(f"--op {op}: {name} (kvfree/bench/kernels/{op}.py) does not exist yet", file=sys.stderr)
        return 2
    if op == OPS[0] and ("-h" in argv or "--help" in argv):
        print(f"python -m {__package__} [--op {{{','.join(OPS)}}}]: the options below are {op}'s\n")
    return script.main(argv)


if __name__ == "__main__":
    sys.exit(main())
