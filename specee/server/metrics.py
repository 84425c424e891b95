"""The server's Prometheus metrics, in a registry of its own (one per app, so tests may run
several apps in one process)."""
from __future__ import annotations

import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..drafters.suffix_cache import SuffixCache
from ..engine import Event
from ..prefix_cache import PrefixCache
from .scheduler import Ended, Job, Scheduler

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    def __init__(self, cpu_tier: str | None = None) -> None:
        self.registry = r = CollectorRegistry()
        Info("specee_cpu_kernels", "Which CPU tier specee's kernels run (none: PyTorch's kernels)",
             registry=r).info({"tier": cpu_tier or "none"})
        self.requests = Counter("specee_requests", "HTTP requests by route and status code",
                                ["route", "status"], registry=r)
        self.generations = Counter("specee_generations", "Generations by how they ended "
                                   "(finished, cancelled, timeout, error, shutdown)", ["outcome"], registry=r)
        self.prompt_tokens = Counter("specee_prompt_tokens", "Prompt tokens of generations that ran", registry=r)
        self.generated_tokens = Counter("specee_generation_tokens", "Tokens generated (cancelled runs included)",
                                        registry=r)
        self.steps = Counter("specee_engine_steps", "Engine steps (one target pass each, or the first token)",
                             registry=r)
        self.latency = Histogram("specee_request_latency_seconds", "Submission to last token",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.first_token = Histogram("specee_time_to_first_token_seconds", "Submission to first token",
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.queue_length = Gauge("specee_queue_length", "Requests waiting for the engine", registry=r)
        self.running = Gauge("specee_running_requests", "Requests the engine is working on (active slots)",
                             registry=r)
        self.passes = Counter("specee_shared_passes", "Passes of the model shared by the running requests",
                              registry=r)
        self.pass_rows = Counter("specee_shared_pass_rows", "Rows those passes ran (prefill chunks, dense steps, "
                                 "drafts to verify)", registry=r)
        self.rows_per_pass = Gauge("specee_rows_per_pass", "Rows of the last shared pass", registry=r)
        self.tokens_per_pass = Gauge("specee_tokens_per_pass", "Tokens the requests committed in the round of "
                                     "the last shared pass", registry=r)
        self.target_passes = Counter("specee_target_passes", "Target model passes after prefill", ["mode"], registry=r)
        self.draft_proposed = Counter("specee_draft_tokens_proposed", "Draft tokens proposed", ["mode"], registry=r)
        self.draft_accepted = Counter("specee_draft_tokens_accepted", "Draft tokens accepted", ["mode"], registry=r)
        # Per-position acceptance = accepted / reached, position by position (vLLM's convention).
        self.position_reached = Counter("specee_draft_position_reached", "Passes whose draft position k was "
                                        "drafted and every earlier position accepted", ["mode", "position"], registry=r)
        self.position_accepted = Counter("specee_draft_position_accepted", "Passes whose draft position k "
                                         "was accepted", ["mode", "position"], registry=r)
        self.method_passes = Counter("specee_method_passes", "Target passes by the method that drafted them (none: "
                                     "nothing drafted; auto chooses per pass)", ["mode", "method"], registry=r)
        self.switches = Counter("specee_auto_switches", "Changes of auto's drafting method between passes",
                                ["mode"], registry=r)
        # `auto`'s choices, per drafter (prompt-lookup, ngram, suffix, draft; none: a dense step).
        self.drafter_passes = Counter("specee_auto_drafter_passes", "auto's passes by the drafter it chose "
                                      "(none: nothing drafted)", ["drafter"], registry=r)
        self.drafter_branches = Counter("specee_auto_drafter_branches", "auto's passes where the drafter's chain "
                                        "went beside the chosen one as a second branch", ["drafter"], registry=r)
        self.drafter_drafted = Counter("specee_auto_drafter_drafted_tokens", "Draft tokens auto sent to verification, "
                                       "by drafter (second branches too)", ["drafter"], registry=r)
        self.drafter_accepted = Counter("specee_auto_drafter_accepted_tokens", "Draft tokens verification accepted, "
                                        "by drafter", ["drafter"], registry=r)
        self.exit_layers = Counter("specee_exit_layer_tokens", "Tokens by the layer their pass exited at "
                                   "(early-exit modes)", ["mode", "layer"], registry=r)

    def watch(self, scheduler: Scheduler, prefix_cache: PrefixCache | None = None,
              suffix_cache: SuffixCache | None = None, threads: Callable[[], int] | None = None) -> None:
        self.queue_length.set_function(lambda: scheduler.queued)
        if threads is not None:
            Gauge("specee_pass_threads", "Threads the model's passes run on now (fewer than loaded while "
                  "another process holds a core)", registry=self.registry).set_function(threads)
        self.running.set_function(lambda: scheduler.running)
        if prefix_cache is not None:
            self.registry.register(PrefixCacheCollector(prefix_cache))
        if suffix_cache is not None:
            self.registry.register(SuffixCacheCollector(suffix_cache))

    def record_step(self, event: Event) -> None:
        self.steps.inc()
        self.generated_tokens.inc(len(event.token_ids))

    def record_pass(self, rows: int, tokens: int) -> None:
        self.passes.inc()
        self.pass_rows.inc(rows)
        self.rows_per_pass.set(rows)
        self.tokens_per_pass.set(tokens)

    def record_end(self, job: Job, ended: Ended) -> None:
        """Called by the scheduler when a generation ends, whatever the reason."""
        now = time.monotonic()
        self.generations.labels(ended.outcome).inc()
        if job.first_token_at is not None:
            self.first_token.observe(job.first_token_at - job.submitted)
        if ended.outcome != "finished":
            return
        self.latency.observe(now - job.submitted)
        stats, mode = ended.result.stats, job.generation.strategy.name
        self.prompt_tokens.inc(ended.result.prompt_tokens)
        self.target_passes.labels(mode).inc(stats.target_passes)
        if stats.accept_lengths:
            self.draft_proposed.labels(mode).inc(stats.draft_tokens_proposed)
            self.draft_accepted.labels(mode).inc(stats.draft_tokens_accepted)
        for k, (reached, accepted) in enumerate(zip(stats.position_reached, stats.position_accepted)):
            self.position_reached.labels(mode, str(k)).inc(reached)
            self.position_accepted.labels(mode, str(k)).inc(accepted)
        for method, passes in stats.method_passes.items():
            self.method_passes.labels(mode, method).inc(passes)
        if stats.switches:
            self.switches.labels(mode).inc(stats.switches)
        for drafter, counts in stats.drafters.items():
            if counts["passes"]:
                self.drafter_passes.labels(drafter).inc(counts["passes"])
            if counts["branches"]:
                self.drafter_branches.labels(drafter).inc(counts["branches"])
            self.drafter_drafted.labels(drafter).inc(counts["drafted"])
            self.drafter_accepted.labels(drafter).inc(counts["accepted"])
        for layer in stats.exit_layers:
            self.exit_layers.labels(mode, str(layer)).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class PrefixCacheCollector:
    """The prefix cache's own counts, read when Prometheus scrapes."""

    def __init__(self, cache: PrefixCache) -> None:
        self.cache = cache

    def collect(self):
        stats = self.cache.stats
        for name, text, value in (("lookups", "Prompts looked up in the prefix cache", stats.lookups),
                                  ("hits", "Prompts that found a cached prefix", stats.hits),
                                  ("hit_tokens", "Prompt tokens taken from the cache, not prefilled", stats.hit_tokens),
                                  ("evictions", "Blocks evicted for room", stats.evictions)):
            yield CounterMetricFamily(f"specee_prefix_cache_{name}", text, value=value)
        yield GaugeMetricFamily("specee_prefix_cache_blocks", "Blocks held", value=len(self.cache.blocks))
        yield GaugeMetricFamily("specee_prefix_cache_bytes", "Bytes held (the budget bounds it)", value=self.cache.bytes)


class SuffixCacheCollector:
    """The suffix cache's own counts (earlier requests' text that `auto` drafts from), read when
    Prometheus scrapes."""

    def __init__(self, cache: SuffixCache) -> None:
        self.cache = cache

    def collect(self):
        stats = self.cache.stats
        for name, text, value in (("documents", "Prompts with their answers added", stats.documents),
                                  ("evictions", "Documents evicted for room", stats.evicted),
                                  ("lookups", "Contexts looked up", stats.lookups),
                                  ("hits", "Lookups that found earlier text to continue", stats.hits)):
            yield CounterMetricFamily(f"specee_suffix_cache_{name}", text, value=value)
        yield GaugeMetricFamily("specee_suffix_cache_tokens", "Tokens held (the budget bounds it)", value=self.cache.held)
