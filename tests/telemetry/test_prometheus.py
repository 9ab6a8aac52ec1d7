"""The ``prometheus`` telemetry sink without the server: config-selected, one registry per engine, values that
follow the requests, bounded labels, and ``+recipe=generate telemetry=prometheus`` writing the text format."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families

from litellm_pipeline import LLM, SamplingParams
from litellm_pipeline.telemetry import events as ev
from litellm_pipeline.telemetry.prometheus import PrometheusSink

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def samples(text: str) -> dict[tuple, float]:
    return {(s.name.removeprefix("litellm_pipeline:"), tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(overrides=["telemetry=prometheus"], threads=1)


def test_sink_counts_what_the_engine_did(llm):
    sink = llm.engine.bus.sink(PrometheusSink)
    assert isinstance(sink, PrometheusSink)
    outs = llm.generate(["12+345=", "rev:abc="], GREEDY, tenant="acme")
    got = samples(sink.render().decode())
    tt = (("tenant", "acme"), ("tier", "balanced"))
    assert got[("prompt_tokens_total", tt)] == sum(len(o.prompt_token_ids) for o in outs)
    assert got[("generation_tokens_total", tt)] == 8
    assert got[("request_success_total", (("finish_reason", "length"), *tt))] == 2
    assert got[("time_to_first_token_seconds_count", tt)] == 2
    assert got[("time_per_output_token_seconds_count", tt)] == 2
    # one inter-token gap per token after each request's first (3 + 3), the last ones included although
    # their requests finished in that same step
    assert got[("inter_token_latency_seconds_count", tt)] == 6
    assert got[("inter_token_latency_seconds_sum", tt)] > 0
    assert got[("tier_selections_total", (("mode", "fixed"), ("tier", "balanced")))] == 2
    assert got[("num_requests_running", ())] == 0 and got[("kv_blocks_used", (("pool", "hot"),))] == 0


def test_blocks_the_prefix_cache_keeps_are_counted(llm):
    """A finished request's prompt blocks stay cached for the next one: no request holds them (kv_blocks_used 0)
    but the cache does, and kv_blocks_cached shows them; a second identical prompt hits them."""
    sink = llm.engine.bus.sink(PrometheusSink)
    prompt = "copy:abcdefghijklmnopqrstuvwxyz0123456789="  # 2 full 16-token blocks
    first = llm.generate(prompt, GREEDY)[0]
    got = samples(sink.render().decode())
    assert got[("kv_blocks_used", (("pool", "hot"),))] == 0
    cached = got[("kv_blocks_cached", (("pool", "hot"),))]
    assert cached >= len(first.prompt_token_ids) // 16 and cached == llm.engine.rt.pool.num_idle_cached
    assert got[("kv_blocks_cached", (("pool", "warm"),))] == 0
    assert llm.generate(prompt, GREEDY)[0].num_cached_tokens >= 16


def test_gauges_follow_an_abort_with_no_step_after_it(llm):
    sink = llm.engine.bus.sink(PrometheusSink)
    stream = llm.stream("copy:abcdef=", SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    next(stream)
    during = samples(sink.render().decode())
    assert during[("num_requests_running", ())] == 1 and during[("kv_blocks_used", (("pool", "hot"),))] >= 1
    stream.close()  # aborts; no engine step follows
    after = samples(sink.render().decode())
    assert after[("num_requests_running", ())] == 0 and after[("kv_blocks_used", (("pool", "hot"),))] == 0
    tt = (("tenant", "default"), ("tier", "balanced"))
    assert after[("request_success_total", (("finish_reason", "abort"), *tt))] == 1


def test_kv_blocks_and_preemptions_per_tenant():
    """tenant_kv_blocks_used follows each tenant's running requests (back to 0 when they end), and preemptions
    carry the tenant preempted."""
    llm = LLM(overrides=["telemetry=prometheus", "cache.block_size=4", "cache.num_blocks=12",
                         "cache.enable_prefix_caching=false"], threads=1)
    sink = llm.engine.bus.sink(PrometheusSink)
    eng = llm.engine
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    eng.add_request("copy:abcdefgh=", params, tenant="acme", request_id="a")
    eng.add_request("rev:abcdefgh=", params, tenant="beta", request_id="b")
    eng.step()
    during = samples(sink.render().decode())
    held = {t: sum(len(r.block_ids) for r in eng.rt.scheduler.running if r.tenant == t) for t in ("acme", "beta")}
    assert held["acme"] > 0 and held["beta"] > 0
    for t in ("acme", "beta"):
        assert during[("tenant_kv_blocks_used", (("tenant", t),))] == held[t]
    while eng.has_unfinished():  # 2 x 44 tokens do not fit 48 slots: one of them is preempted
        eng.step()
    after = samples(sink.render().decode())
    assert after[("tenant_kv_blocks_used", (("tenant", "acme"),))] == 0
    assert after[("tenant_kv_blocks_used", (("tenant", "beta"),))] == 0
    preempted = {dict(k[1])["tenant"]: v for k, v in after.items() if k[0] == "num_preemptions_total"}
    assert sum(preempted.values()) >= 1 and set(preempted) <= {"acme", "beta"}


def test_each_engine_has_its_own_registry(llm):
    other = LLM(overrides=["telemetry=prometheus"], threads=1)
    mine, theirs = llm.engine.bus.sink(PrometheusSink), other.engine.bus.sink(PrometheusSink)
    assert mine.registry is not theirs.registry
    before = samples(mine.render().decode())
    other.generate("1+2=", GREEDY)
    assert samples(mine.render().decode()) == before
    assert samples(theirs.render().decode())[("generation_tokens_total", (("tenant", "default"),
                                                                           ("tier", "balanced")))] == 4


def test_labels_stay_bounded():
    sink = PrometheusSink(max_tenants=2, max_tiers=3)
    for i, (tenant, tier) in enumerate([("a", "fast"), ("b", "auto:1-2-2-1"), ("c", "auto:2-2-1-1"), ("", "max"),
                                        ("d", "deep"), ("a", None)]):
        rid = f"r{i}"
        sink.publish(ev.RequestAdmitted(rid, tenant, tier, 3))
        sink.publish(ev.RequestFinished(rid, tenant, "stop", 3, 2, 0, tier, 0.1))
    got = samples(sink.render().decode())
    labels = {dict(k[1])["tenant"] + "/" + dict(k[1])["tier"] for k in got if k[0] == "request_success_total"}
    # tenants a, b keep their names, later ones ("" = default too) fold; auto:* is one tier label, so fast, auto
    # and max fill the cap of 3 and deep (and no tier at all) fold
    assert labels == {"a/fast", "b/auto", "other/auto", "other/max", "other/other", "a/other"}
    fixed = PrometheusSink(tenants=["x"])
    fixed.publish(ev.RequestRejected(None, "x", "InvalidRequestError", "bad"))
    fixed.publish(ev.RequestRejected(None, "y", "RateLimitedError", "quota"))
    got = samples(fixed.render().decode())
    assert got[("request_rejected_total", (("reason", "InvalidRequestError"), ("tenant", "x")))] == 1
    assert got[("request_rejected_total", (("reason", "RateLimitedError"), ("tenant", "other")))] == 1


def test_budget_violations_and_infeasible_selections():
    sink = PrometheusSink()
    sink.publish(ev.TierSelected("r", "", "fast", (1, 1), "balanced", False, 5.0, 0.01))
    sink.publish(ev.RequestCosted("r", "fast", 1, 5.0, 1.0, 9.0, 2.0, ("latency_cost_ms",)))
    got = samples(sink.render().decode())
    assert got[("budget_infeasible_total", (("tier", "fast"),))] == 1
    assert got[("budget_violations_total", (("limit", "latency_cost_ms"), ("tier", "fast")))] == 1


def test_bad_sink_params_are_a_config_error():
    from litellm_pipeline.errors import ConfigError

    with pytest.raises(ConfigError, match="max_tenants"):
        LLM(overrides=["telemetry=prometheus", "telemetry.params.prometheus.max_tenants=0"])


def test_generate_with_telemetry_prometheus_writes_the_text_format(tmp_path):
    cmd = [sys.executable, "-m", "litellm_pipeline", "+recipe=generate", "telemetry=prometheus",
           "sampling.max_tokens=4", "sampling.ignore_eos=true", "device.threads=1", f"hydra.run.dir={tmp_path}/run"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**os.environ})
    assert proc.returncode == 0, proc.stderr
    (path,) = re.findall(r"metrics \(Prometheus text format\): (\S+)", proc.stdout)
    assert path == f"{tmp_path}/run/metrics.prom"
    got = samples(open(path).read())
    tt = (("tenant", "default"), ("tier", "balanced"))
    assert got[("generation_tokens_total", tt)] == 20  # the five demo prompts, 4 tokens each
    assert got[("request_success_total", (("finish_reason", "length"), *tt))] == 5
