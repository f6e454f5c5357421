"""The report's PNG plots (matplotlib, Agg backend: no display needed), the server and the baseline on each.

- memory_vs_context.png: bytes per session against context length, measured points and the fitted line;
- sessions_vs_context.png: sessions that fit in the device memory against context length (hollow markers:
  extrapolated);
- latency_vs_concurrency.png: TTFT and ITL p50/p90/p99 against the number of concurrent clients;
- throughput_vs_concurrency.png: output tokens/s and requests/s against the number of concurrent clients.

A plot with no data (its scenario did not run) is not written.
"""

from __future__ import annotations

from pathlib import Path

from kvfree.loadtest.runner import LoadTestReport, ServerReport

MEMORY_PNG = "memory_vs_context.png"
SESSIONS_PNG = "sessions_vs_context.png"
LATENCY_PNG = "latency_vs_concurrency.png"
THROUGHPUT_PNG = "throughput_vs_concurrency.png"

_COLORS = {"server": "tab:blue", "baseline": "tab:orange"}
_PERCENTILE_STYLES = (("p50", "-"), ("p90", "--"), ("p99", ":"))


def _label(server: ServerReport) -> str:
    return f"{server.role}: {server.model or server.url}"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; also safe where no display exists
    import matplotlib.pyplot as plt

    return plt


def _tokens(x: float, _pos: object = None) -> str:
    """Axis label of a token count: 64, 1K, 128K, 1M."""
    for unit, size in (("M", 2**20), ("K", 2**10)):
        if x >= size and x % size == 0:
            return f"{x / size:g}{unit}"
    return f"{x:g}"


def _log2_axis(ax, label: str, token_labels: bool) -> None:
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(LogLocator(base=2))
    ax.xaxis.set_major_formatter(FuncFormatter(_tokens if token_labels else lambda x, _pos: f"{x:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel(label)


def _byte_unit(largest: float) -> tuple[str, float]:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if largest >= 4 * size:
            return unit, size
    return "KiB" if largest >= 2**10 else "bytes", 2**10 if largest >= 2**10 else 1


def _memory_plot(plt, servers: list[ServerReport], path: Path) -> bool:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = [(s, [p for p in s.context.points if p.ok and p.state_bytes is not None]) for s in servers]
    series = [(s, points) for s, points in series if points]
    if not series:
        plt.close(fig)
        return False
    unit, size = _byte_unit(max(p.state_bytes for _, points in series for p in points))
    for s, points in series:
        color = _COLORS.get(s.role)
        xs = [p.num_tokens for p in points]
        ax.plot(xs, [p.state_bytes / size for p in points], "o", color=color, label=f"{_label(s)}: state_bytes")
        deltas = [(p.num_tokens, p.in_use_delta / size) for p in points if p.in_use_delta is not None]
        if deltas:
            ax.plot(*zip(*deltas, strict=True), "x", color=color, ms=9, label=f"{s.role}: Δ /metrics in-use")
        fit = s.context.slope
        if fit is not None:
            # A straight line is a curve on the log2 axis: draw it through many points.
            lo, hi = min(xs), max(xs)
            grid = [lo * (hi / lo) ** (i / 63) for i in range(64)] if hi > lo else [lo]
            ax.plot(
                grid,
                [fit.predict(x) / size for x in grid],
                "-",
                color=color,
                alpha=0.6,
                label=f"{s.role} fit: {fit.slope:,.1f} B/token",
            )
    _log2_axis(ax, "context length (tokens, log scale)", token_labels=True)
    ax.set_ylabel(f"state per session ({unit})")
    ax.set_ylim(bottom=0)
    ax.set_title("Session memory against context length")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _sessions_plot(plt, servers: list[ServerReport], path: Path, device_memory_gib: float) -> bool:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    drawn = False
    for s in servers:
        rows = [r for r in s.capacity.rows if r.sessions]
        if not rows:
            continue
        color = _COLORS.get(s.role)
        ax.plot([r.context for r in rows], [r.sessions for r in rows], "-", color=color, alpha=0.5)
        measured = [r for r in rows if r.source == "measured"]
        extrapolated = [r for r in rows if r.source == "extrapolated"]
        if measured:
            ax.plot(
                [r.context for r in measured],
                [r.sessions for r in measured],
                "o",
                color=color,
                label=f"{_label(s)} (measured)",
            )
        if extrapolated:
            ax.plot(
                [r.context for r in extrapolated],
                [r.sessions for r in extrapolated],
                "o",
                color=color,
                markerfacecolor="none",
                label=f"{s.role} (extrapolated)",
            )
        drawn = True
    if drawn:
        _log2_axis(ax, "context length (tokens, log scale)", token_labels=True)
        ax.set_yscale("log")
        ax.set_ylabel("sessions")
        ax.set_title(f"Sessions that fit in {device_memory_gib:g} GiB")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    plt.close(fig)
    return drawn


def _latency_plot(plt, servers: list[ServerReport], path: Path) -> bool:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    drawn = False
    for s in servers:
        levels = [lv for lv in s.concurrency if lv.summary.ok]
        if not levels:
            continue
        color = _COLORS.get(s.role)
        xs = [lv.concurrency for lv in levels]
        for ax, metric in zip(axes, ("ttft", "itl"), strict=True):
            for key, style in _PERCENTILE_STYLES:
                ys = [getattr(getattr(lv.summary, metric), key) for lv in levels]
                ax.plot(
                    xs,
                    [1e3 * y if y is not None else float("nan") for y in ys],
                    style,
                    marker="o",
                    color=color,
                    label=f"{s.role} {key}",
                )
        drawn = True
    if drawn:
        for ax, title in zip(axes, ("time to first token", "inter-token latency"), strict=True):
            _log2_axis(ax, "concurrent clients", token_labels=False)
            ax.set_ylabel("ms")
            ax.set_title(title)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    plt.close(fig)
    return drawn


def _throughput_plot(plt, servers: list[ServerReport], path: Path) -> bool:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    drawn = False
    for s in servers:
        levels = s.concurrency
        if not any(lv.summary.ok for lv in levels):
            continue
        color = _COLORS.get(s.role)
        xs = [lv.concurrency for lv in levels]
        axes[0].plot(xs, [lv.output_tokens_per_s for lv in levels], "-o", color=color, label=_label(s))
        axes[1].plot(xs, [lv.requests_per_s for lv in levels], "-o", color=color, label=_label(s))
        drawn = True
    if drawn:
        for ax, unit in zip(axes, ("output tokens/s", "requests/s"), strict=True):
            _log2_axis(ax, "concurrent clients", token_labels=False)
            ax.set_ylabel(unit)
            ax.set_title(f"{unit} against concurrency")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    plt.close(fig)
    return drawn


def write_plots(report: LoadTestReport, out_dir: Path) -> list[Path]:
    """Write every plot that has data into `out_dir`; returns the files written.

    Raises:
        ImportError: matplotlib is not installed.
    """
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    with_context = [s for s in report.servers if s.context is not None]
    if with_context and _memory_plot(plt, with_context, out_dir / MEMORY_PNG):
        written.append(out_dir / MEMORY_PNG)
    with_capacity = [s for s in report.servers if s.capacity is not None]
    device_memory = float(report.config.get("device_memory_gib") or 0)
    if with_capacity and _sessions_plot(plt, with_capacity, out_dir / SESSIONS_PNG, device_memory):
        written.append(out_dir / SESSIONS_PNG)
    with_levels = [s for s in report.servers if s.concurrency]
    if with_levels and _latency_plot(plt, with_levels, out_dir / LATENCY_PNG):
        written.append(out_dir / LATENCY_PNG)
    if with_levels and _throughput_plot(plt, with_levels, out_dir / THROUGHPUT_PNG):
        written.append(out_dir / THROUGHPUT_PNG)
    return written
