"""The YAML stage graph is what executes: swapping an implementation is one override, and a stage defined
here, in a test module, can be inserted by config alone."""

from __future__ import annotations

from litellm_pipeline import LLM, SamplingParams
from litellm_pipeline.registry import register
from litellm_pipeline.stages.base import Stage

ORDER = "pipeline.order=[admit,select_tier,route,prefill,decode,sample,{x},emit]"


class ReplaceToken(Stage):
    """Between sample and emit: rewrites one sampled token id into another (and counts its calls)."""

    inputs = ("samples",)
    outputs = ("samples",)
    calls = 0

    def __init__(self, rt, old: int, new: int):
        super().__init__(rt)
        self.old, self.new = old, new

    def __call__(self, ctx) -> None:
        type(self).calls += 1
        ctx.samples = [(r, self.new if t == self.old else t, lp) for r, t, lp in ctx.samples]


register("stage", "test_replace_token")(ReplaceToken)

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


class BiasToken(Stage):
    """Between decode and sample: raises one token's logit in place."""

    inputs = ("logits",)
    outputs = ("logits",)

    def __init__(self, rt, token: int):
        super().__init__(rt)
        self.token = token

    def __call__(self, ctx) -> None:
        if ctx.logits is not None:
            ctx.logits[:, self.token] += 1e4


register("stage", "test_bias_token")(BiasToken)


def _stage(llm, cls_name):
    return next(s for s in llm.engine.step_stages if type(s).__name__ == cls_name)


def test_greedy_decode_steps_take_the_argmax_found_with_the_logits(hf_checkpoint, monkeypatch):
    """With sample right after decode, decode-only steps hand the sampler each row's argmax (found by the fused
    decode as it wrote the logits): the sampler searches the logits only in the prefill step. A stage between
    them that changes the logits in place turns that off, and its change is what gets sampled."""
    from litellm_pipeline.sampling import samplers

    path = str(hf_checkpoint("llama"))
    prompt = [5, 6, 7, 8, 9]
    plain = LLM(model=path)
    assert _stage(plain, "Decode").argmax
    searched = []
    real = samplers._argmax
    monkeypatch.setattr(samplers, "_argmax", lambda x: searched.append(x.shape[0]) or real(x))
    base = plain.generate(prompt, GREEDY)[0].token_ids
    assert searched == [1]  # the prefill step's; the 11 decode steps took the region's
    token = next(t for t in range(50, 500) if t not in base)
    biased = LLM(model=path, overrides=[f"+pipeline.stages.bias={{impl: test_bias_token, params: {{token: {token}}}}}",
                                        "pipeline.order=[admit,select_tier,route,prefill,decode,bias,sample,emit]"])
    assert not _stage(biased, "Decode").argmax
    searched.clear()
    assert biased.generate(prompt, GREEDY)[0].token_ids == [token] * GREEDY.max_tokens
    assert len(searched) == GREEDY.max_tokens


def test_swap_sampler_by_one_override(hf_checkpoint):
    path = str(hf_checkpoint("llama"))
    prompt = [5, 6, 7, 8, 9]
    hot = SamplingParams(max_tokens=12, temperature=1.5, seed=1, ignore_eos=True)
    greedy = LLM(model=path).generate(prompt, GREEDY)[0].token_ids
    sampled = LLM(model=path).generate(prompt, hot)[0].token_ids
    swapped = LLM(model=path, overrides=["pipeline.stages.sample.params.sampler=greedy"]).generate(prompt, hot)[0]
    assert sampled != greedy  # the default sampler really samples at temperature 1.5
    assert swapped.token_ids == greedy


def test_insert_a_stage_from_a_test_module_by_config_alone(hf_checkpoint):
    path = str(hf_checkpoint("mixtral"))
    prompt = [10, 20, 30, 40]
    base = LLM(model=path).generate(prompt, GREEDY)[0].token_ids
    old = base[0]
    overrides = [f"+pipeline.stages.fix={{impl: test_replace_token, params: {{old: {old}, new: 200}}}}", ORDER.format(x="fix")]
    ReplaceToken.calls = 0
    out = LLM(model=path, overrides=overrides).generate(prompt, GREEDY)[0].token_ids
    assert out[0] == 200 and old not in out[:1]
    assert ReplaceToken.calls >= len(out)


def test_insert_by_import_string(hf_checkpoint):
    """A stage can also be named as "module:Class" without registering it."""
    path = str(hf_checkpoint("llama"))
    prompt = [10, 20, 30]
    base = LLM(model=path).generate(prompt, GREEDY)[0].token_ids
    impl = f"{__name__}:ReplaceToken"
    overrides = [f"+pipeline.stages.fix={{impl: '{impl}', params: {{old: {base[0]}, new: 201}}}}", ORDER.format(x="fix")]
    assert LLM(model=path, overrides=overrides).generate(prompt, GREEDY)[0].token_ids[0] == 201


def test_tier_changes_moe_routing_but_not_dense(hf_checkpoint):
    """select_tier's fixed tier is honoured: top-1 routing changes a MoE model's output."""
    prompt = list(range(3, 40))
    moe = str(hf_checkpoint("mixtral"))
    native = LLM(model=moe).generate(prompt, GREEDY)[0]
    fast = LLM(model=moe, tier="fast").generate(prompt, GREEDY)[0]
    assert native.tier == "balanced" and fast.tier == "fast"
    assert native.token_ids != fast.token_ids
    llm = LLM(model=moe)
    per_request = llm.generate(prompt, GREEDY, tier="fast")[0]
    assert per_request.token_ids == fast.token_ids and per_request.tier == "fast"


def test_mixed_tiers_in_one_batch_match_each_alone(hf_checkpoint):
    moe = str(hf_checkpoint("qwen2_moe"))
    llm = LLM(model=moe)
    prompts = [list(range(3, 3 + n)) for n in (9, 21, 33)]
    tiers = ["fast", "balanced", "max"]
    alone = [llm.generate(p, GREEDY, tier=t)[0].token_ids for p, t in zip(prompts, tiers)]
    reqs = [llm.engine.add_request(p, GREEDY, tier=t) for p, t in zip(prompts, tiers)]
    done = {}
    while len(done) < 3:
        for o in llm.engine.step():
            if o.finished:
                done[o.request_id] = o.token_ids
    assert [done[r.request_id] for r in reqs] == alone
    assert len({tuple(a) for a in alone}) > 1  # the tiers really differ


class Upper(Stage):
    """Between sample and emit: a text filter that upper-cases what is not shown yet; ``cut`` misbehaves by cutting
    into text already shown."""

    inputs = ("samples",)
    outputs = ("text_filters",)

    def __init__(self, rt, cut: bool = False):
        super().__init__(rt)
        self.cut, self.hold = cut, 0

    def __call__(self, ctx) -> None:
        ctx.text_filters = (*getattr(ctx, "text_filters", ()), self)

    def filter_text(self, request, text, start):
        if self.cut and start > 0:
            return text[: start - 1], False
        return text[:start] + text[start:].upper(), False


register("stage", "test_upper")(Upper)


def _demo(*overrides):
    return LLM(overrides=["device.threads=1", "device.dtype=float32", *overrides])


def test_a_text_filter_stage_rewrites_what_emit_shows():
    prompt, params = "rev:abcdef=", SamplingParams(max_tokens=12, temperature=0.0)
    plain = _demo().generate(prompt, params)[0]
    llm = _demo("+pipeline.stages.up={impl: test_upper}", ORDER.format(x="up"))
    deltas = [d.text for d in llm.stream(prompt, params)]
    out = llm.generate(prompt, params)[0]
    assert plain.text == "fedcba" and out.text == "".join(deltas) == "FEDCBA"
    assert out.token_ids == plain.token_ids


def test_a_text_filter_after_its_reader_is_a_graph_error():
    import pytest

    from litellm_pipeline.errors import ConfigError

    with pytest.raises(ConfigError, match=r"stage 'up' produces 'text_filters', which stage 'emit' reads before it"):
        _demo("+pipeline.stages.up={impl: test_upper}", "pipeline.order=[admit,select_tier,route,prefill,decode,"
              "sample,emit,up]")


def test_a_filter_that_rewrites_shown_text_fails_only_its_request():
    llm = _demo("+pipeline.stages.up={impl: test_upper, params: {cut: true}}", ORDER.format(x="up"))
    out = llm.generate("rev:abcdef=", SamplingParams(max_tokens=12, temperature=0.0))[0]
    assert out.finish_reason == "error" and "were shown already" in out.error
    assert not llm.engine.requests and llm.engine.rt.pool.num_free == llm.engine.rt.pool.num_blocks
