"""``GET /metrics``: the server's counters in the Prometheus text format (0.0.4).

Request and token counters and the step time come from the engine loop's
:class:`formcast.engine_loop.LoopStats`; queue depth, running requests and KV
blocks are read from the engine when scraped; HTTP responses are counted by
route and status here.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from formcast.engine_loop import EngineLoop

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class HttpCounter:
    """HTTP responses by (route, status code)."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, int]] = Counter()

    def add(self, route: str, status: int) -> None:
        self.counts[(route, status)] += 1


def render(loop: EngineLoop, http: HttpCounter) -> str:
    """The metrics page of one server."""
    s, engine = loop.stats, loop.engine
    blocks = engine.block_manager
    out: list[str] = []

    def metric(name: str, kind: str, help: str, samples: list[tuple[str, Any]]) -> None:
        out.append(f"# HELP formcast_{name} {help}")
        out.append(f"# TYPE formcast_{name} {kind}")
        out.extend(f"formcast_{name}{labels} {value}" for labels, value in samples)

    metric("requests_total", "counter", "Requests handed to the engine, by outcome.",
           [('{outcome="finished"}', s.requests_finished), ('{outcome="failed"}', s.requests_failed),
            ('{outcome="aborted"}', s.requests_aborted),
            ('{outcome="rejected"}', s.requests_rejected)])
    metric("constrained_requests_total", "counter",
           "Requests generated under a constraint.", [("", s.constrained_requests)])
    metric("constrained_share", "gauge", "Share of submitted requests with a constraint.",
           [("", s.constrained_requests / s.requests_submitted if s.requests_submitted else 0.0)])
    metric("prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
           [("", s.prompt_tokens)])
    metric("completion_tokens_total", "counter", "Generated tokens of finished requests.",
           [("", s.completion_tokens)])
    metric("requests_in_flight", "gauge", "Requests submitted and not yet answered.",
           [("", loop.num_in_flight)])
    metric("queue_depth", "gauge", "Requests waiting for a place in the running batch.",
           [("", len(engine.scheduler.waiting))])
    metric("running_requests", "gauge", "Requests in the running batch.",
           [("", len(engine.scheduler.running))])
    metric("kv_blocks_free", "gauge", "Free KV-cache blocks.", [("", blocks.num_free_blocks)])
    metric("kv_blocks_total", "gauge", "KV-cache blocks.", [("", blocks.num_blocks)])
    metric("step_seconds", "summary", "Time spent in engine steps.",
           [("_sum", f"{s.step_seconds:.6f}"), ("_count", s.steps)])
    metric("http_responses_total", "counter", "HTTP responses by route and status.",
           [(f'{{route="{route}",code="{code}"}}', n)
            for (route, code), n in sorted(http.counts.items())])
    return "\n".join(out) + "\n"
