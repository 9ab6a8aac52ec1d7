"""The ``prometheus`` telemetry sink: the event bus as Prometheus metrics (registry kind ``telemetry``).

Every sink owns its own ``CollectorRegistry`` (never prometheus-client's global one), so two engines in one
process — or a test building many — never share or collide on series. :meth:`PrometheusSink.render` gives the
text exposition format (the server's ``GET /metrics``; ``+recipe=generate`` writes it to a file).

Names follow vLLM's style with a ``litellm_pipeline:`` prefix. Labels are bounded so a client cannot grow the
number of series: tenants beyond ``tenants`` (or past the first ``max_tenants`` seen) fold into ``other``; tier
names the budget solvers make up (``auto:2-2-1-1``) fold into ``auto``, and past ``max_tiers`` into ``other``.

It runs inside the engine step under the engine lock (publishers hold it), so it keeps no lock of its own;
prometheus-client's metrics are thread-safe for the scrape that reads them from another thread.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from litellm_pipeline.registry import register
from litellm_pipeline.telemetry import events as ev

__all__ = ["PrometheusSink", "CONTENT_TYPE_LATEST", "PREFIX"]

# no `_created` series: a timestamp per counter and histogram doubles the exposition and no dashboard reads it
# (vLLM drops them too); prometheus-client's switch is per process
disable_created_metrics()

PREFIX = "litellm_pipeline:"
OTHER = "other"
# vLLM's buckets: sub-millisecond steps of a small model up to minutes of a long generation
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0)


class _Folder:
    """Maps raw label values to a bounded set: known values (or the first ``limit`` seen) keep their name."""

    def __init__(self, known: Sequence[str] | None, limit: int, normalise: Callable[[str], str]):
        self._fixed = known is not None
        self._seen: set[str] = {normalise(k) for k in known} if known is not None else set()
        self._limit = limit
        self._normalise = normalise

    def __call__(self, value: str | None) -> str:
        v = self._normalise(value)
        if v in self._seen:
            return v
        if self._fixed or len(self._seen) >= self._limit:
            return OTHER
        self._seen.add(v)
        return v


def _tenant_name(t: str | None) -> str:
    return t or "default"


def _tier_name(t: str | None) -> str:
    if not t:
        return "none"
    return t.split(":", 1)[0] if ":" in t else t  # auto:2-2-1-1 -> auto


@register("telemetry", "prometheus")
class PrometheusSink:
    """Counters, gauges and histograms of the request lifecycle, the scheduler and the KV cache.

    ``tenants``: the tenant names that get their own label (others fold into ``other``); None: the first
    ``max_tenants`` seen. ``max_tiers``: distinct tier labels before folding into ``other``.
    """

    def __init__(self, tenants: Sequence[str] | None = None, max_tenants: int = 32, max_tiers: int = 32):
        if max_tenants < 1 or max_tiers < 1:
            raise ValueError(f"max_tenants and max_tiers: must be >= 1 (got {max_tenants}, {max_tiers})")
        self.registry = CollectorRegistry()
        self._tenant = _Folder(tenants, max_tenants, _tenant_name)
        self._tier = _Folder(None, max_tiers, _tier_name)
        # request id -> [tenant label, tier label, prompt tokens, ttft or None, queue time observed]; set at
        # admission, dropped at finish/abort: FirstToken and RequestScheduled carry no tenant or tier
        self._live: dict[str, list[Any]] = {}
        tt = ("tenant", "tier")
        r = self.registry

        def hist(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(PREFIX + name, doc, tt, buckets=buckets, registry=r)

        self.ttft = hist("time_to_first_token_seconds", "Arrival to first generated token.", _TTFT_BUCKETS)
        self.tpot = hist("time_per_output_token_seconds",
                         "Per request: mean time between output tokens, (e2e - ttft) / (output tokens - 1).",
                         _TPOT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive output tokens of a request.",
                        _TPOT_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish of a finished request.", _E2E_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled.", _TTFT_BUCKETS)
        self.running = Gauge(PREFIX + "num_requests_running", "Requests running after the last step.", registry=r)
        self.waiting = Gauge(PREFIX + "num_requests_waiting", "Requests waiting after the last step.", registry=r)
        self.blocks_used = Gauge(PREFIX + "kv_blocks_used",
                                 "KV blocks held by requests: hot (device) and warm (host, swapped out).",
                                 ("pool",), registry=r)
        self.blocks_cached = Gauge(PREFIX + "kv_blocks_cached",
                                   "KV blocks the prefix cache keeps that no request holds (evictable): hot and warm.",
                                   ("pool",), registry=r)
        self.kv_usage = Gauge(PREFIX + "kv_cache_usage_perc",
                              "Fraction of the hot KV blocks held by requests (1 = full).", registry=r)
        self.prefix_queries = Counter(PREFIX + "prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.", registry=r)
        self.prefix_hits = Counter(PREFIX + "prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                   registry=r)
        self.preemptions = Counter(PREFIX + "num_preemptions", "Requests preempted.", ("mode", "tenant"), registry=r)
        self.tenant_blocks = Gauge(PREFIX + "tenant_kv_blocks_used",
                                   "Hot KV blocks a tenant's running requests hold after the last step.", ("tenant",),
                                   registry=r)
        self._tenants_holding: set[str] = set()
        self.evicted = Counter(PREFIX + "kv_blocks_evicted", "Cached hot KV blocks evicted.", registry=r)
        self.demoted = Counter(PREFIX + "kv_blocks_demoted", "Evicted hot KV blocks kept in the warm tier.",
                               registry=r)
        self.promoted = Counter(PREFIX + "kv_blocks_promoted", "Warm KV blocks copied back by a prefix hit.",
                                registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of ended requests.", tt, registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated by ended requests.", tt,
                                         registry=r)
        self.success = Counter(PREFIX + "request_success",
                               "Ended requests by finish_reason (stop, length, budget, error, abort).",
                               ("finish_reason", *tt), registry=r)
        self.rejected = Counter(PREFIX + "request_rejected",
                                "Requests refused before queueing, by the tenant quota they broke or else the "
                                "error class.", ("reason", "tenant"), registry=r)
        self.tier_selections = Counter(PREFIX + "tier_selections", "TierSets chosen by select_tier.",
                                       ("tier", "mode"), registry=r)
        self.budget_infeasible = Counter(PREFIX + "budget_infeasible",
                                         "Requests no TierSet could keep within budget (the cheapest ran).",
                                         ("tier",), registry=r)
        self.budget_violations = Counter(PREFIX + "budget_violations",
                                         "Finished requests whose actual cost broke a budget limit.",
                                         ("limit", "tier"), registry=r)
        # speculative decoding, as vLLM names it
        self.spec_drafts = Counter(PREFIX + "spec_decode_num_drafts", "Drafts verified (one per request and step).",
                                   registry=r)
        self.spec_draft_tokens = Counter(PREFIX + "spec_decode_num_draft_tokens", "Tokens drafted.", registry=r)
        self.spec_accepted = Counter(PREFIX + "spec_decode_num_accepted_tokens", "Drafted tokens verification kept.",
                                     registry=r)
        self.spec_accepted_pos = Counter(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                         "Drafted tokens kept, by their position in the draft (0 = first).",
                                         ("position",), registry=r)
        self._handlers: dict[type, Callable[[Any], None]] = {
            ev.RequestAdmitted: self._admitted,
            ev.RequestRejected: self._rejected,
            ev.TierSelected: self._tier_selected,
            ev.RequestScheduled: self._scheduled,
            ev.FirstToken: self._first_token,
            ev.TokensGenerated: self._tokens,
            ev.RequestFinished: self._finished,
            ev.RequestAborted: self._aborted,
            ev.RequestCosted: self._costed,
            ev.RequestPreempted: lambda e: self.preemptions.labels(e.mode, self._tenant(e.tenant)).inc(),
            ev.PrefixLookup: self._prefix,
            ev.BlocksEvicted: lambda e: self.evicted.inc(e.num_blocks),
            ev.BlocksDemoted: lambda e: self.demoted.inc(e.num_blocks),
            ev.BlocksPromoted: lambda e: self.promoted.inc(e.num_blocks),
            ev.StepFinished: self._state,
            ev.SpeculationVerified: self._speculation,
        }

    def publish(self, event: ev.Event) -> None:
        handler = self._handlers.get(type(event))
        if handler is not None:
            handler(event)

    def render(self) -> bytes:
        """The metrics in the Prometheus text exposition format."""
        return generate_latest(self.registry)

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_bytes(self.render())
        return path

    # ---- handlers -----------------------------------------------------------------------------------
    def _labels(self, rid: str) -> list[Any]:
        return self._live.get(rid) or ["default", "none", 0, None, True]

    def _admitted(self, e: ev.RequestAdmitted) -> None:
        self._live[e.request_id] = [self._tenant(e.tenant), self._tier(e.tier), e.prompt_tokens, None, False]

    def _rejected(self, e: ev.RequestRejected) -> None:
        # a tenant quota names itself (requests_per_minute, ..., max_queued); anything else, its error class
        self.rejected.labels(e.quota or e.error, self._tenant(e.tenant)).inc()

    def _tier_selected(self, e: ev.TierSelected) -> None:
        tier = self._tier(e.tier)
        self.tier_selections.labels(tier, e.mode).inc()
        if not e.feasible:
            self.budget_infeasible.labels(tier).inc()

    def _scheduled(self, e: ev.RequestScheduled) -> None:
        live = self._live.get(e.request_id)
        if live is not None and not live[4]:  # a preempted request is scheduled again: count the first wait
            live[4] = True
            self.queue.labels(live[0], live[1]).observe(e.queue_time_s)

    def _first_token(self, e: ev.FirstToken) -> None:
        live = self._labels(e.request_id)
        live[3] = e.ttft_s
        self.ttft.labels(live[0], live[1]).observe(e.ttft_s)

    def _tokens(self, e: ev.TokensGenerated) -> None:
        for gap, tenant, tier in zip(e.gaps_s, e.tenants, e.tiers):
            self.itl.labels(self._tenant(tenant), self._tier(tier)).observe(gap)

    def _finished(self, e: ev.RequestFinished) -> None:
        tenant, tier, _, ttft, _ = self._live.pop(e.request_id, None) or self._labels(e.request_id)
        self.e2e.labels(tenant, tier).observe(e.latency_s)
        if ttft is not None and e.output_tokens > 1:
            self.tpot.labels(tenant, tier).observe(max(0.0, e.latency_s - ttft) / (e.output_tokens - 1))
        self.prompt_tokens.labels(tenant, tier).inc(e.prompt_tokens)
        self.generation_tokens.labels(tenant, tier).inc(e.output_tokens)
        self.success.labels(e.reason, tenant, tier).inc()

    def _aborted(self, e: ev.RequestAborted) -> None:
        tenant, tier, prompt_tokens, _, _ = self._live.pop(e.request_id, None) or self._labels(e.request_id)
        self.prompt_tokens.labels(tenant, tier).inc(prompt_tokens)
        self.generation_tokens.labels(tenant, tier).inc(e.output_tokens)
        self.success.labels("abort", tenant, tier).inc()
        self._state(e)

    def _costed(self, e: ev.RequestCosted) -> None:
        for limit in e.budget_missed:
            self.budget_violations.labels(limit, self._tier(e.tier)).inc()

    def _speculation(self, e: ev.SpeculationVerified) -> None:
        self.spec_drafts.inc(e.num_drafts)
        self.spec_draft_tokens.inc(e.num_draft_tokens)
        self.spec_accepted.inc(e.num_accepted_tokens)
        for pos, n in enumerate(e.accepted_per_position):
            if n:
                self.spec_accepted_pos.labels(str(pos)).inc(n)

    def _prefix(self, e: ev.PrefixLookup) -> None:
        self.prefix_queries.inc(e.hit_tokens + e.miss_tokens)
        self.prefix_hits.inc(e.hit_tokens)

    def _state(self, e: ev.StepFinished | ev.RequestAborted) -> None:
        self.running.set(e.num_running)
        self.waiting.set(e.num_waiting)
        self.blocks_used.labels("hot").set(e.used_blocks)
        self.blocks_used.labels("warm").set(e.warm_used_blocks)
        self.blocks_cached.labels("hot").set(e.cached_blocks)
        self.blocks_cached.labels("warm").set(e.warm_cached_blocks)
        held: dict[str, int] = {}
        for tenant, n in e.tenant_blocks:
            label = self._tenant(tenant)
            held[label] = held.get(label, 0) + n
        for label in self._tenants_holding - held.keys():  # none running now: it holds nothing
            self.tenant_blocks.labels(label).set(0)
        for label, n in held.items():
            self.tenant_blocks.labels(label).set(n)
        self._tenants_holding = set(held)
        if e.total_blocks:
            self.kv_usage.set(e.used_blocks / e.total_blocks)
