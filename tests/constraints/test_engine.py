"""Constrained requests in the engine: masked exactly where the grammar says, batched with free requests that stay
bit-identical, under preemption, aborts, failing constraints and slow compiles; the KV pool always ends empty."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
import torch
from _constraint_util import pool_empty
from hf_models import EOS_ID, load_hf_model, random_prompts

from litellm_pipeline import SamplingParams, registry
from litellm_pipeline.constraints.grammar import GrammarConstraint
from litellm_pipeline.constraints.kinds import Regex
from litellm_pipeline.errors import InternalError, InvalidRequestError
from litellm_pipeline.request_spec import RequestSpec

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tags": {"type": "array", "items": {"enum": ["x", "yz"]}, "maxItems": 2}},
          "required": ["name", "age", "tags"]}


def test_greedy_constrained_tokens_are_the_argmax_of_the_masked_transformers_logits(tiny, hf_checkpoint):
    """Exactness: at every step the engine's token is transformers' argmax over the tokens the grammar allows."""
    hf = load_hf_model(hf_checkpoint("llama"))
    compiled = tiny.engine.rt.constraints.compile(RequestSpec("x", constraint={"json_schema": PERSON}).constraint)
    for prompt in random_prompts([5, 12], seed=3):
        (out,) = tiny.generate([prompt], SamplingParams(temperature=0, max_tokens=120),
                               constraint={"json_schema": PERSON})
        assert out.finish_reason == "stop" and out.token_ids[-1] == EOS_ID
        jsonschema.validate(json.loads(out.text), PERSON)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1:-1]
        m = compiled.matcher()
        bm = torch.zeros((1, (logits.shape[-1] + 31) // 32), dtype=torch.int32)
        for step, token in enumerate(out.token_ids):
            m.fill_bitmask(bm, 0)
            bits = torch.tensor([(int(bm[0, t // 32]) >> (t % 32)) & 1 for t in range(logits.shape[-1])],
                                dtype=torch.bool)
            assert bits[token], f"step {step}: token {token} is not allowed"
            assert int(logits[step].masked_fill(~bits, float("-inf")).argmax()) == token, f"step {step}"
            assert m.accept(token)
        assert m.is_terminated()


def test_free_requests_are_bit_identical_beside_constrained_ones(tiny):
    prompts = random_prompts([7, 11, 9, 4], seed=5)
    free = SamplingParams(temperature=0.9, seed=11, max_tokens=12, ignore_eos=True, logprobs=2)
    alone = tiny.generate(prompts[:2], free)
    specs = [RequestSpec(prompts[0], free), RequestSpec(prompts[2], SamplingParams(temperature=0, max_tokens=80),
                                                         constraint={"json_schema": PERSON}),
             RequestSpec(prompts[1], free), RequestSpec(prompts[3], SamplingParams(temperature=1.0, seed=3,
                                                                                    max_tokens=20),
                                                         constraint={"regex": "[a-f]{3,9}"})]
    mixed = tiny.generate(specs)
    for a, b in zip(alone, [mixed[0], mixed[2]]):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    jsonschema.validate(json.loads(mixed[1].text), PERSON)
    assert re.fullmatch("[a-f]{3,9}", mixed[3].text)
    pool_empty(tiny)


def test_end_of_sequence_only_where_the_grammar_ends_and_length_mid_structure(tiny):
    p = random_prompts([6], seed=8)[0]
    (out,) = tiny.generate([p], SamplingParams(temperature=1.0, seed=2, max_tokens=30),
                           constraint={"regex": "[0-9]{4}"})
    assert re.fullmatch("[0-9]{4}", out.text) and len(out.token_ids) == 5 and out.token_ids[-1] == EOS_ID
    assert out.finish_reason == "stop"
    (cut,) = tiny.generate([p], SamplingParams(temperature=0, max_tokens=6), constraint={"json_schema": PERSON})
    assert cut.finish_reason == "length" and len(cut.token_ids) == 6 and cut.text == '{"name'
    # ignore_eos: the output still ends where the grammar does (nothing may follow)
    (out,) = tiny.generate([p], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                           constraint={"choice": ["yes", "no"]})
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
    pool_empty(tiny)


def test_streamed_constrained_output_joins_to_valid_json(tiny):
    deltas = [d.text for d in tiny.stream(random_prompts([9], seed=1)[0],
                                                  SamplingParams(temperature=0.7, seed=4, max_tokens=100),
                                                  constraint={"json_schema": PERSON})]
    assert len([d for d in deltas if d]) > 3
    jsonschema.validate(json.loads("".join(deltas)), PERSON)
    pool_empty(tiny)


def test_preempted_constrained_requests_resume_their_grammar(tiny_pool, tiny):
    prompts = random_prompts([10, 14, 12, 9, 11], seed=21)
    specs = [RequestSpec(p, SamplingParams(temperature=0, max_tokens=60), constraint={"json_schema": PERSON})
             for p in prompts]
    small = tiny_pool.generate(specs)
    big = tiny.generate(specs)
    sink = tiny_pool.engine.bus.sink(__import__("litellm_pipeline.telemetry", fromlist=["MemorySink"]).MemorySink)
    if sink is not None:
        assert sink.counts.get("preempted", 0) > 0
    for a, b in zip(small, big):
        assert a.token_ids == b.token_ids  # preemption recomputes the KV; the matcher kept its place
        jsonschema.validate(json.loads(a.text), PERSON)
    pool_empty(tiny_pool)


def test_aborting_a_constrained_request_frees_everything(tiny):
    eng = tiny.engine
    req = eng.add_request(random_prompts([8], seed=2)[0], SamplingParams(temperature=0, max_tokens=50),
                          constraint={"json_schema": PERSON})
    eng.step()
    eng.step()
    out = eng.abort(req.request_id)
    assert out.finish_reason == "abort" and out.text.startswith("{")
    pool_empty(tiny)


def test_compiles_are_cached_by_spec(tiny):
    compiler = tiny.engine.rt.constraints
    schema = {"type": "object", "properties": {"k": {"enum": ["cached"]}}, "required": ["k"]}
    before = compiler.compiles
    for text in (json.dumps(schema), json.dumps(schema, indent=2), schema):
        (out,) = tiny.generate(["a"], SamplingParams(temperature=0, max_tokens=20), constraint={"json_schema": text})
        assert json.loads(out.text) == {"k": "cached"}
    assert compiler.compiles == before + 1


class _Matcher:
    """Allows token ``allow[i]`` at step i, then nothing; ``lie``: allows a token but refuses to accept it."""

    def __init__(self, allow, lie=False):
        self.allow, self.lie, self.n = allow, lie, 0

    def fill_bitmask(self, bitmask, row):
        bitmask[row] = 0
        if self.n < len(self.allow):
            t = self.allow[self.n]
            bitmask[row, t // 32] = 1 << (t % 32) if t % 32 != 31 else -(2**31)

    def accept(self, token):
        if self.lie or self.n >= len(self.allow) or token != self.allow[self.n]:
            return False
        self.n += 1
        return True

    def rollback(self, k):
        self.n -= k

    def is_terminated(self):
        return False


class DeadEnd:
    """A plugin kind: writes the given tokens, then allows nothing (a grammar the vocabulary cannot finish)."""

    def __init__(self, grammars):
        self.grammars = grammars

    def compile(self, value):
        if not isinstance(value, dict) or not isinstance(value.get("tokens"), list):
            raise ValueError("needs {'tokens': [...]} ")
        allow, lie = value["tokens"], bool(value.get("lie"))

        class Compiled:
            def matcher(self):
                return _Matcher(allow, lie)

        return Compiled()


@pytest.fixture
def dead_end():
    registry.add("constraint", "dead_end", DeadEnd)
    yield
    registry.remove("constraint", "dead_end")


def test_a_constraint_that_dead_ends_fails_alone(tiny, dead_end):
    prompts = random_prompts([5, 6], seed=4)
    free = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ref = tiny.generate([prompts[1]], free)[0]
    eng = tiny.engine
    bad = eng.add_request(prompts[0], SamplingParams(temperature=0, max_tokens=10),
                          constraint={"dead_end": {"tokens": [40, 41]}})
    good = eng.add_request(prompts[1], free)
    eng.run([bad, good])
    assert bad.finish_reason == "error" and bad.output_ids == [40, 41]
    assert good.finish_reason == "length" and good.output_ids == ref.token_ids
    with pytest.raises(InvalidRequestError, match="constraint.dead_end: needs"):
        eng.add_request(prompts[0], constraint={"dead_end": 3})
    with pytest.raises(InvalidRequestError, match="allows no token this model's vocabulary can write"):
        eng.add_request(prompts[0], constraint={"dead_end": {"tokens": []}})
    pool_empty(tiny)


def test_a_token_the_constraint_refuses_fails_the_request_not_the_batch(tiny, dead_end):
    prompts = random_prompts([5, 6], seed=6)
    eng = tiny.engine
    bad = eng.add_request(prompts[0], SamplingParams(temperature=0, max_tokens=8),
                          constraint={"dead_end": {"tokens": [50], "lie": True}})
    good = eng.add_request(prompts[1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    finals = {}
    outs = eng.run([bad, good], on_finish=lambda o: finals.setdefault(o.request_id, o))
    assert outs[0].finish_reason == "error" and "does not allow" in finals[bad.request_id].error
    outs[0] = finals[bad.request_id]
    with pytest.raises(InternalError):
        outs[0].raise_error()
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 8
    pool_empty(tiny)


def test_a_slow_compile_does_not_stall_the_step_loop(tiny):
    """A compile runs on the submitting thread, outside the engine lock: others' steps go on meanwhile."""
    release, started = threading.Event(), threading.Event()

    class Slow(Regex):
        def compile(self, value) -> GrammarConstraint:
            started.set()
            assert release.wait(30)
            return super().compile(value)

    registry.add("constraint", "slow_regex_engine", Slow)
    try:
        eng = tiny.engine
        result = {}

        def submit():
            result["req"] = eng.add_request("q", SamplingParams(temperature=0, max_tokens=5),
                                            constraint={"slow_regex_engine": "[a-z]{2}"})

        t = threading.Thread(target=submit)
        t.start()
        assert started.wait(10)
        other = eng.add_request(random_prompts([6], seed=9)[0], SamplingParams(temperature=0, max_tokens=6,
                                                                               ignore_eos=True))
        eng.run([other])  # finishes while the compile is still held
        assert other.finished and t.is_alive()
        release.set()
        t.join(10)
        eng.run([result["req"]])
        assert re.fullmatch("[a-z]{2}", tiny.engine.tokenizer.decode(result["req"].output_ids))
    finally:
        release.set()
        registry.remove("constraint", "slow_regex_engine")
    pool_empty(tiny)
