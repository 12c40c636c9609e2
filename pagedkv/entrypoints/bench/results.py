"""Per-request results of a serving benchmark and their summary (latency percentiles, rates)."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    """One request of a load run. ``ok`` means it was answered exactly once, completely: HTTP
    200, one stream whose chunks all carry this request's id, exactly one finish reason, a
    usage chunk and one ``[DONE]``. Times are seconds; ``start_time`` counts from the run's
    start."""

    index: int
    request_id: str
    start_time: float
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float | None = None
    prompt_tokens: int = 0
    #: Prompt tokens the server did not compute: its prefix-cache hits and, on a D instance,
    #: the KV a P instance sent (``usage.prompt_tokens_details.cached_tokens``, as in vLLM).
    cached_tokens: int = 0
    output_tokens: int = 0
    finish_reason: str | None = None


def _stats_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ms = np.asarray(values) * 1000
    stats = {"mean_ms": float(ms.mean())}
    stats.update({f"p{p}_ms": float(np.percentile(ms, p)) for p in PERCENTILES})
    return stats


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    num_input = sum(r.prompt_tokens for r in ok)
    num_output = sum(r.output_tokens for r in ok)
    errors = Counter(r.error for r in results if not r.ok)
    return {
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": dict(errors.most_common(5)),
        "duration_s": duration,
        "total_input_tokens": num_input,
        "total_cached_tokens": sum(r.cached_tokens for r in ok),
        "total_output_tokens": num_output,
        "request_throughput": len(ok) / duration,
        "output_throughput": num_output / duration,
        "total_token_throughput": (num_input + num_output) / duration,
        "ttft": _stats_ms([r.ttft for r in ok if r.ttft is not None]),
        "itl": _stats_ms([t for r in ok for t in r.itl]),
        "e2e": _stats_ms([r.e2e for r in ok if r.e2e is not None]),
    }


def format_summary(summary: dict) -> str:
    lines = [
        "{:=^56}".format(" Serving Benchmark Result "),
        f"{'Successful requests:':<40}{summary['completed']:>16}",
        f"{'Failed requests:':<40}{summary['failed']:>16}",
        f"{'Benchmark duration (s):':<40}{summary['duration_s']:>16.2f}",
        f"{'Total input tokens:':<40}{summary['total_input_tokens']:>16}",
        f"{'  of which cached (prefix hit or P KV):':<40}{summary['total_cached_tokens']:>16}",
        f"{'Total generated tokens:':<40}{summary['total_output_tokens']:>16}",
        f"{'Request throughput (req/s):':<40}{summary['request_throughput']:>16.2f}",
        f"{'Output token throughput (tok/s):':<40}{summary['output_throughput']:>16.2f}",
        f"{'Total token throughput (tok/s):':<40}{summary['total_token_throughput']:>16.2f}",
    ]
    titles = {"ttft": "Time to First Token", "itl": "Inter-token Latency"}
    titles["e2e"] = "End-to-end Latency"
    for key, title in titles.items():
        lines.append("{:-^56}".format(f" {title} "))
        for stat, value in summary[key].items():
            label = stat.removesuffix("_ms").replace("p", "P", 1).replace("mean", "Mean")
            lines.append(f"{f'{label} {key.upper()} (ms):':<40}{value:>16.2f}")
    for error, count in summary["errors"].items():
        lines.append(f"error x{count}: {error}")
    lines.append("=" * 56)
    return "\n".join(lines)


def save_json(path: str | Path, config: dict, summary: dict, results: list[RequestResult]) -> None:
    payload = {
        "config": config,
        "summary": summary,
        "requests": [dataclasses.asdict(r) for r in results],
    }
    Path(path).write_text(json.dumps(payload, indent=2))
