"""`kvfree loadtest`: the command line of the load generator (also `python -m kvfree.loadtest`).

Exit status: 0 when the run completed and the soak (if run) verified every turn; 1 when the soak found replies
that differ from their reference (including one corrupted on purpose by `--inject-mismatch`) or could verify
none; 2 for bad arguments or a server that does not answer. The report is written in every case but the last.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from kvfree.loadtest.config import SCENARIOS, LoadTestConfig, profile_config
from kvfree.loadtest.target import DEFAULT_URL, TargetError, is_loopback, parse_target_url
from kvfree.loadtest.workload import LengthDistribution, WorkloadSpec

if TYPE_CHECKING:
    from kvfree.loadtest.runner import LoadTestReport

DESCRIPTION = """\
Load-test kvfree (or any OpenAI-compatible) servers over HTTP: memory against context length, latency and
throughput against concurrency, and a soak of more sessions than the pool holds with every turn verified against
the same conversation sent without its session. Writes report.json, report.md and PNG plots to --out."""

EPILOG = """\
profiles:
  --quick  (default) contexts 64..1024, 1/2/4 clients, ~20 s soak: under 2 minutes on a CPU with the tiny
           checkpoints. Serve the attention baseline with --max-context >= 1100.
  --gpu    contexts 1K..128K, 1/16/64/256 clients, 45 s soak, ~7 minutes (loadtest/gpu_run.sh). Serve with
           --max-prompt-tokens >= 131200, and the attention baseline with --max-context >= 131200.

lists take comma-separated integers, with K for 1024: --contexts 1K,4K,16K --concurrency 1,16,64,256

exit status: 0 ok; 1 the soak found mismatches other than near-tie flips (or verified nothing); 2 bad arguments or
unreachable server.

example:
  kvfree serve ./tiny --port 8000 &  kvfree serve ./tiny-attention --port 8001 --max-context 2048 &
  kvfree loadtest --url http://127.0.0.1:8000 --baseline-url http://127.0.0.1:8001 --quick --out report/
"""


def _url(raw: str) -> str:
    try:
        return parse_target_url(raw)
    except TargetError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _int_list(raw: str) -> list[int]:
    """ "1K,4K,16" -> [1024, 4096, 16]: positive integers, K meaning 1024, in the order given, no repeats."""
    out: list[int] = []
    for item in raw.split(","):
        item = item.strip()
        scale = 1
        if item[-1:] in ("k", "K"):
            item, scale = item[:-1], 1024
        try:
            value = int(item) * scale
        except ValueError:
            raise argparse.ArgumentTypeError(f"{raw!r}: {item!r} is not an integer (e.g. 64,128 or 1K,4K)") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{raw!r}: values must be positive")
        if value not in out:
            out.append(value)
    return out


def positive(kind: type[int] | type[float]) -> Callable[[str], int | float]:
    """An argparse type: a number of `kind` above zero."""

    def parse(raw: str) -> int | float:
        try:
            value = kind(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{raw!r} is not a {kind.__name__}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{raw!r} must be positive")
        return value

    parse.__name__ = f"positive {kind.__name__}"
    return parse


def _scenarios(raw: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(s.strip() for s in raw.split(",") if s.strip()))
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{raw!r}: choose among {', '.join(SCENARIOS)} (comma-separated)")
    return names


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvfree loadtest",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--url", type=_url, metavar="URL", default=DEFAULT_URL, help=f"the server under test (default {DEFAULT_URL})"
    )
    p.add_argument(
        "--baseline-url",
        type=_url,
        metavar="URL",
        default=None,
        help="a second server measured the same way, e.g. the attention "
        "baseline of equal width/depth; both appear on every plot",
    )
    p.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        default=Path("loadtest-report"),
        help="report directory (default: %(default)s)",
    )
    profile = p.add_mutually_exclusive_group()
    profile.add_argument("--quick", dest="profile", action="store_const", const="quick", help="CPU profile (default)")
    profile.add_argument("--gpu", dest="profile", action="store_const", const="gpu", help="full device profile")
    p.add_argument(
        "--scenarios",
        type=_scenarios,
        metavar="LIST",
        default=SCENARIOS,
        help=f"which to run (default: {','.join(SCENARIOS)})",
    )
    p.add_argument(
        "--model", default=None, metavar="ID", help="model id to send (default: the server's first in /v1/models)"
    )
    p.add_argument(
        "--baseline-model", default=None, metavar="ID", help="model id for the baseline (default: its first)"
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("KVFREE_API_KEY"),
        metavar="KEY",
        help="bearer key (default: $KVFREE_API_KEY)",
    )
    p.add_argument(
        "--baseline-api-key", default=None, metavar="KEY", help="bearer key of the baseline (default: --api-key)"
    )
    p.add_argument("--seed", type=int, default=0, metavar="N", help="seed of every random draw (prompts, lengths)")
    p.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send ignore_eos (kvfree/vLLM extension) so outputs have the lengths asked for; --no-ignore-eos for "
        "servers that refuse unknown fields",
    )

    g = p.add_argument_group("context sweep")
    g.add_argument("--contexts", type=_int_list, metavar="LIST", help="context lengths to measure (tokens)")
    g.add_argument("--decode-tokens", type=positive(int), metavar="N", help="tokens decoded at each length")
    g.add_argument(
        "--capacity-contexts",
        type=_int_list,
        metavar="LIST",
        help="more lengths for the sessions-that-fit table (extrapolated)",
    )
    g.add_argument(
        "--device-memory-gib",
        type=positive(float),
        metavar="GIB",
        help="device memory for the sessions-that-fit table (default 80)",
    )

    g = p.add_argument_group("concurrency sweep")
    g.add_argument(
        "--concurrency", type=_int_list, metavar="LIST", help="concurrent clients per level, e.g. 1,16,64,256"
    )
    g.add_argument(
        "--requests-per-worker", type=positive(int), metavar="N", help="requests each client sends per level"
    )
    g.add_argument(
        "--min-requests", type=positive(int), metavar="N", dest="min_requests_per_level", help="per level, at least"
    )
    g.add_argument("--level-seconds", type=positive(float), metavar="S", help="time bound of one level")
    g.add_argument(
        "--temperature", type=float, metavar="T", help="sampling temperature of the chat requests (default 0.7)"
    )
    g.add_argument(
        "--prompt-median", type=positive(int), metavar="N", help="median prompt length (characters; lognormal)"
    )
    g.add_argument("--prompt-sigma", type=float, metavar="X", help="sigma of log prompt length")
    g.add_argument("--prompt-max", type=positive(int), metavar="N", help="longest prompt (characters)")
    g.add_argument("--output-median", type=positive(int), metavar="N", help="median max_tokens (lognormal)")
    g.add_argument("--output-sigma", type=float, metavar="X", help="sigma of log max_tokens")
    g.add_argument("--output-max", type=positive(int), metavar="N", help="largest max_tokens")

    g = p.add_argument_group("session soak")
    g.add_argument("--soak-seconds", type=positive(float), metavar="S", help="time bound of the soak")
    g.add_argument(
        "--soak-sessions", type=positive(int), metavar="N", help="sessions (default: twice the server's pool slots)"
    )
    g.add_argument("--soak-turns", type=positive(int), metavar="N", help="most turns per session")
    g.add_argument("--soak-max-tokens", type=positive(int), metavar="N", help="tokens per reply")
    g.add_argument(
        "--soak-concurrency", type=positive(int), metavar="N", help="turns in flight at once (default: pool slots)"
    )
    g.add_argument(
        "--inject-mismatch",
        action="store_true",
        help="corrupt one reference reply: the soak must report a mismatch (and the exit status is 1)",
    )

    g = p.add_argument_group("bounds and output")
    g.add_argument("--request-timeout", type=positive(float), metavar="S", help="seconds one request may take")
    g.add_argument(
        "--time-limit", type=positive(float), metavar="S", help="seconds the whole run may take (quick: 110)"
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bars (they are off when not a TTY)")
    g.add_argument("--no-plots", action="store_true", help="skip the PNG plots (no matplotlib needed)")
    return p


def _length(
    dist: LengthDistribution, median: int | None, sigma: float | None, high: int | None, flag: str
) -> LengthDistribution:
    """`dist` with the flags that were given: --FLAG-median, --FLAG-sigma, --FLAG-max."""
    median = median or dist.median
    high = high or max(dist.high, median)
    sigma = dist.sigma if sigma is None else sigma
    if sigma < 0:
        raise ValueError(f"--{flag}-sigma {sigma} must be >= 0")
    if median > high:
        raise ValueError(f"--{flag}-median {median} is above --{flag}-max {high}")
    return LengthDistribution(median=median, sigma=sigma, low=min(dist.low, median), high=high)


def config_from_args(args: argparse.Namespace) -> LoadTestConfig:
    """The profile's config with every flag that was given applied."""
    names = [
        "baseline_url", "model", "baseline_model", "api_key", "baseline_api_key", "seed", "ignore_eos", "contexts",
        "decode_tokens", "capacity_contexts", "device_memory_gib", "concurrency", "requests_per_worker",
        "min_requests_per_level", "level_seconds", "temperature", "soak_seconds", "soak_sessions", "soak_turns",
        "soak_max_tokens", "soak_concurrency", "request_timeout", "time_limit",
    ]  # fmt: skip
    overrides = {name: getattr(args, name) for name in names}
    config = profile_config(
        args.profile or "quick",
        args.url,
        args.out,
        scenarios=args.scenarios,
        inject_mismatch=args.inject_mismatch,
        **overrides,
    )
    if args.temperature is not None and not 0 <= args.temperature <= 2:
        raise ValueError(f"--temperature {args.temperature} must be in [0, 2]")
    workload = WorkloadSpec(
        prompt=_length(config.workload.prompt, args.prompt_median, args.prompt_sigma, args.prompt_max, "prompt"),
        output=_length(config.workload.output, args.output_median, args.output_sigma, args.output_max, "output"),
    )
    config = replace(config, workload=workload)
    if config.out.exists() and not config.out.is_dir():
        raise ValueError(f"--out {config.out} exists and is not a directory")
    return config


def _summary(report: LoadTestReport, json_path: Path, md_path: Path, plots: list[Path]) -> str:
    lines = [f"kvfree loadtest: {'PASS' if report.passed else 'FAIL'} in {report.seconds:.1f}s"]
    for server in report.servers:
        if server.context is not None and server.context.slope is not None:
            lines.append(f"  {server.role}: memory slope {server.context.slope.slope:,.2f} bytes/token")
        if server.soak is not None:
            soak = server.soak
            ties = f" ({soak.near_ties} near-tie flips)" if soak.near_ties else ""
            lines.append(f"  {server.role}: soak {soak.compared} turns verified, {soak.mismatches} mismatches{ties}")
    lines += [f"  failure: {f}" for f in report.failures]
    lines.append(f"  report: {md_path} ({json_path.name}, {len(plots)} plots)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse `argv`, run, write the report; returns the exit status (module doc). Bad arguments exit 2 here."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    # Imported only now: --help and argument errors stay instant and need neither httpx nor numpy.
    try:
        from kvfree.loadtest.runner import TargetUnreachable, run_loadtest
    except ImportError as exc:
        print(f"kvfree loadtest: error: {exc}; it needs httpx and numpy (pip install httpx)", file=sys.stderr)
        return 2
    from kvfree.loadtest.plots import write_plots
    from kvfree.loadtest.progress import Progress
    from kvfree.loadtest.report import write_report

    for url in filter(None, (config.url, config.baseline_url)):
        if not is_loopback(url):
            print(f"kvfree loadtest: note: {url} is not this machine; sending load there as asked", file=sys.stderr)
    progress = Progress(False if args.no_progress else None)
    try:
        report = asyncio.run(run_loadtest(config, progress))
    except TargetUnreachable as exc:
        print(f"kvfree loadtest: error: {exc}", file=sys.stderr)
        return 2
    plots: list[Path] = []
    plot_error = None
    if not args.no_plots:
        try:
            plots = write_plots(report, config.out)
        except ImportError as exc:  # matplotlib is optional: the numbers are in the report either way
            plot_error = f"plots skipped: {exc} (pip install matplotlib)"
            print(f"kvfree loadtest: warning: {plot_error}", file=sys.stderr)
    json_path, md_path = write_report(report, config.out, [str(p) for p in plots], plot_error)
    print(_summary(report, json_path, md_path, plots))
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
