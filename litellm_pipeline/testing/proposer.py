"""check_proposer: a ``proposer`` (speculative decoding) in the demo engine.

The contract (:class:`litellm_pipeline.registry.interfaces.Proposer`): built as ``cls(rt, **params)``; once per step
``propose(requests, ks)`` returns one draft per request, at most ``ks[i]`` token ids of the vocabulary, and leaves
the requests as they were. What must hold, whatever it proposes (the engine verifies every token):

* greedy output is token for token the output without speculation, batched and alone, on a roomy pool and on a
  tiny one that preempts (recompute and swap);
* a seeded sampled request gives the same tokens twice;
* every KV block comes back, and ``release`` (when it has one) is called for every request that ends.
"""

from __future__ import annotations

from typing import Any

from litellm_pipeline.testing._support import assert_drained, build_llm, config_name, describe, resolve

PROMPTS = ["copy:abc12x=", "rev:hello=", "sort:39174=", "12+345=", "a3,b7,c1;b", "copy:zz9y8x7w="]


def check_proposer(impl: str | type, **params: Any) -> None:
    """Check a ``proposer`` class (a registry name or the class) built with ``params`` on the demo model at tier
    ``max``. Raises ``AssertionError`` naming the case."""
    from litellm_pipeline.sampling import SamplingParams

    cls = resolve("proposer", impl)
    name = impl if isinstance(impl, str) else describe(impl)
    greedy = SamplingParams(temperature=0, max_tokens=16)
    ref = [o.token_ids for o in build_llm(tier="max").generate(PROMPTS, greedy)]
    with config_name("proposer", cls) as reg_name:
        extra = [f"++speculative.params.{k}={v!r}" if isinstance(v, str) else f"++speculative.params.{k}={v}"
                 for k, v in params.items()]
        for what, overrides in [
            ("roomy pool", []),
            ("tiny pool, recompute", ["cache.block_size=4", "cache.num_blocks=12"]),
            ("tiny pool, swap", ["cache.block_size=4", "cache.num_blocks=12", "engine.preemption=swap",
                                 "cache.warm_blocks=64"]),
        ]:
            llm = build_llm([f"speculative.method={reg_name}", "speculative.disable_by_batch_size=null",
                             "speculative.adaptive=false", *extra,
                             *overrides], tier="max")
            opened = _watch(llm.engine.speculator, name, llm.engine.rt.model_cfg.vocab_size)
            outs = llm.generate(PROMPTS, greedy)
            got = [o.token_ids for o in outs]
            assert got == ref, f"proposer {name} ({what}): greedy output changed under speculation\n{got}\n{ref}"
            alone = [llm.generate(p, greedy)[0].token_ids for p in PROMPTS]
            assert alone == ref, f"proposer {name} ({what}): greedy output of requests alone changed"
            seeded = SamplingParams(temperature=0.9, max_tokens=16, seed=11)
            a = [o.token_ids for o in llm.generate(PROMPTS[:3], seeded)]
            b = [o.token_ids for o in llm.generate(PROMPTS[:3], seeded)]
            assert a == b, f"proposer {name} ({what}): a seeded request gave different tokens on a second run"
            assert_drained(llm, f"proposer {name} ({what})")
            assert opened is None or not opened, (
                f"proposer {name} ({what}): release was not called for {len(opened)} ended requests")


def _watch(speculator: Any, name: str, vocab: int) -> set[int] | None:
    """Wrap the proposer's ``propose`` to check each call's drafts; with ``release``, the requests not yet released."""
    proposer = speculator.proposer
    original = proposer.propose
    opened: set[int] = set()

    def propose(reqs, ks):
        before = [(len(r.output_ids), list(r.draft)) for r in reqs]
        drafts = original(reqs, ks)
        assert len(drafts) == len(reqs), f"proposer {name}: {len(drafts)} drafts for {len(reqs)} requests"
        for r, k, d, (n_out, draft) in zip(reqs, ks, drafts, before):
            assert len(d) <= k, f"proposer {name}: a draft of {len(d)} tokens where at most {k} were asked"
            assert all(isinstance(t, int) and 0 <= t < vocab for t in d), (
                f"proposer {name}: draft {list(d)} holds something that is not a token id below {vocab}")
            assert (len(r.output_ids), list(r.draft)) == (n_out, draft), f"proposer {name}: propose changed a request"
            opened.add(id(r))
        return drafts

    proposer.propose = propose
    release = speculator._releases
    if release is None:
        return None

    def released(req):
        opened.discard(id(req))
        release(req)

    speculator._releases = released
    return opened
