"""The server's counters, gauges and histograms, rendered in the Prometheus text format
(https://prometheus.io/docs/instrumenting/exposition_formats/) for `GET /metrics`.
"""

from __future__ import annotations

import math
import threading

_HELP = {
    "specedge_requests_total": ("counter", "HTTP requests by route and status code."),
    "specedge_generations_total": ("counter", "Finished generations by finish reason."),
    "specedge_rejected_total": ("counter", "Requests refused because the queue was full."),
    "specedge_prompt_tokens_total": ("counter", "Prompt tokens of finished generations."),
    "specedge_prompt_tokens_cached_total": ("counter", "Prompt tokens a kept prefix held "
                                            "(not prefilled again)."),
    "specedge_completion_tokens_total": ("counter", "Generated tokens."),
    "specedge_draft_tokens_proposed_total": ("counter", "Draft tokens proposed."),
    "specedge_draft_tokens_accepted_total": ("counter", "Draft tokens accepted."),
    "specedge_rounds_total": ("counter", "Speculative rounds, summed over requests."),
    "specedge_acceptance_rate": ("gauge", "Accepted / proposed draft tokens, all requests."),
    "specedge_tokens_per_round": ("gauge", "Generated tokens per round, all requests."),
    "specedge_queue_depth": ("gauge", "Requests waiting for a slot."),
    "specedge_running": ("gauge", "Requests decoding now."),
    "specedge_warmup_seconds": ("gauge", "How long the startup warm-up took (0: none)."),
    "specedge_time_to_first_token_seconds": ("histogram",
                                             "Submission to the first text sent."),
    "specedge_time_per_output_token_seconds": ("histogram",
                                               "Mean time per token after the first, per "
                                               "request."),
    "specedge_request_duration_seconds": ("histogram", "Submission to the end of a request."),
}
_BUCKETS = {
    "specedge_time_to_first_token_seconds": (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10,
                                             30, 60),
    "specedge_time_per_output_token_seconds": (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08,
                                               0.16, 0.32, 0.64, 1.28),
    "specedge_request_duration_seconds": (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120,
                                          300),
}
Labels = tuple[tuple[str, str], ...]


def _labels(labels: Labels, extra: str = "") -> str:
    def esc(v: str) -> str:
        return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    parts = [f'{k}="{esc(v)}"' for k, v in labels] + ([extra] if extra else [])
    return "{" + ",".join(parts) + "}" if parts else ""


def _num(value: float) -> str:
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class Metrics:
    """Thread-safe counters and histograms, rendered in the Prometheus text format."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[tuple[str, Labels], float] = {}
        self._hist: dict[str, tuple[list[int], list[float]]] = {
            name: ([0] * (len(b) + 1), [0.0]) for name, b in _BUCKETS.items()}

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            self._counters[key] = self._counters.get(key, 0.0) + value

    def observe(self, name: str, value: float) -> None:
        counts, total = self._hist[name]
        with self._lock:
            counts[next((i for i, b in enumerate(_BUCKETS[name]) if value <= b),
                        len(_BUCKETS[name]))] += 1
            total[0] += value

    def render(self, gauges: dict[str, float]) -> str:
        """The exposition text; `gauges` are read by the caller at scrape time."""
        with self._lock:
            counters = dict(self._counters)
            hist = {n: (list(c), t[0]) for n, (c, t) in self._hist.items()}
        proposed = counters.get(("specedge_draft_tokens_proposed_total", ()), 0.0)
        rounds = counters.get(("specedge_rounds_total", ()), 0.0)
        gauges = {**gauges, "specedge_acceptance_rate": counters.get(
            ("specedge_draft_tokens_accepted_total", ()), 0.0) / proposed if proposed else 0.0,
            "specedge_tokens_per_round": counters.get(
                ("specedge_completion_tokens_total", ()), 0.0) / rounds if rounds else 0.0}
        lines = []
        for name, (kind, help_text) in _HELP.items():
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
            if kind == "gauge":
                lines.append(f"{name} {_num(gauges.get(name, 0.0))}")
            elif kind == "counter":
                samples = [(lb, v) for (n, lb), v in counters.items() if n == name] or [((), 0)]
                lines += [f"{name}{_labels(lb)} {_num(v)}" for lb, v in sorted(samples)]
            else:
                lines += _histogram_lines(name, *hist[name])
        return "\n".join(lines) + "\n"


def _histogram_lines(name: str, counts: list[int], total: float) -> list[str]:
    lines, running = [], 0
    for bound, count in zip((*_BUCKETS[name], math.inf), counts, strict=True):
        running += count
        le = "+Inf" if bound == math.inf else _num(bound)
        lines.append(f'{name}_bucket{{le="{le}"}} {running}')
    return lines + [f"{name}_sum {_num(total)}", f"{name}_count {running}"]
