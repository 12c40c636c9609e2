"""One PNG per serving benchmark: TTFT, ITL and E2E distributions, and latency over the run."""

from __future__ import annotations

from pathlib import Path

from pagedkv.entrypoints.bench.results import RequestResult


def plot_results(results: list[RequestResult], summary: dict, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.ok]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    series = (
        ("Time to first token", [r.ttft for r in ok if r.ttft is not None]),
        ("Inter-token latency", [t for r in ok for t in r.itl]),
        ("End-to-end latency", [r.e2e for r in ok if r.e2e is not None]),
    )
    for ax, (title, values) in zip(axes.flat, series):
        ax.hist([v * 1000 for v in values], bins=40, color="tab:blue", alpha=0.8)
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.set_ylabel("count")
    over_time = axes.flat[3]
    over_time.scatter([r.start_time for r in ok], [r.e2e * 1000 for r in ok], s=8, label="E2E")
    over_time.scatter([r.start_time for r in ok], [r.ttft * 1000 for r in ok], s=8, label="TTFT")
    failed = [r.start_time for r in results if not r.ok]
    if failed:
        over_time.scatter(failed, [0] * len(failed), marker="x", color="red", label="failed")
    over_time.set_title("Latency by request start time")
    over_time.set_xlabel("request sent at (s)")
    over_time.set_ylabel("ms")
    over_time.legend()
    fig.suptitle(
        f"{summary['completed']} ok / {summary['failed']} failed, "
        f"{summary['request_throughput']:.2f} req/s, "
        f"{summary['output_throughput']:.1f} output tok/s"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
