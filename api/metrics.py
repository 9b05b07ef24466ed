"""Prometheus metrics, one registry per app so that several apps (tests) never collide."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "mosos_http_requests",
            "HTTP requests answered, by method, route and status code.",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.request_seconds = Histogram(
            "mosos_http_request_seconds",
            "Time to answer an HTTP request, by route.",
            ["route"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=self.registry,
        )
        self.solves = Counter(
            "mosos_solves",
            "Solves finished, by strategy and outcome (feasible, infeasible, failed, cancelled).",
            ["strategy", "outcome"],
            registry=self.registry,
        )
        self.solve_seconds = Histogram(
            "mosos_solve_seconds",
            "Wall time of a solve in its worker process.",
            ["strategy"],
            buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
            registry=self.registry,
        )
        self.cache_hits = Counter(
            "mosos_cache_hits", "Plan requests answered from the store without solving.", registry=self.registry
        )
        self.results_not_stored = Counter(
            "mosos_results_not_stored",
            "Plans that ended in this server but whose row something else had already ended (logged with the id).",
            registry=self.registry,
        )
        self.queue_depth = Gauge("mosos_queue_depth", "Plans waiting for a solve process.", registry=self.registry)
        self.solves_running = Gauge("mosos_solves_running", "Solve processes busy with a plan.", registry=self.registry)
