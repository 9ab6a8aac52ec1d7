"""Structured output in the bench (``bench.structured=true``): what masking costs per generated token at batch 1
and batch N, and what compiling a typical JSON schema costs.

A byte vocabulary would make masking look cheap (xgrammar's work grows with the tokens it must check), so this
section runs the model's shape with a byte-level BPE tokenizer trained here, on the package's own sources and
docs, up to the model's vocabulary size. Each round runs the same prompts twice, once under a JSON schema and
once free with ``max_tokens`` set to each request's constrained length, so both generate the same tokens in the
same batches; rounds alternate which goes first, and the prefix cache is off so neither finds the other's
prompts. The overhead is the constrained run's time over the free run's, median over rounds.
"""

from __future__ import annotations

import gc
import hashlib
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from litellm_pipeline.bench.checkpoints import cache_root, write_random_checkpoint
from litellm_pipeline.sampling import SamplingParams

__all__ = ["SCHEMA", "COMPILE_SCHEMA", "trained_tokenizer", "structured_checkpoint", "measure_structured"]

# the generated shape: four records, each an id, a name, a kind and a flag (about 100 output tokens)
SCHEMA = {"type": "object", "required": ["items"], "properties": {"items": {
    "type": "array", "minItems": 4, "maxItems": 4, "items": {
        "type": "object", "required": ["id", "name", "kind", "ok"], "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 99999},
            "name": {"type": "string", "minLength": 3, "maxLength": 10},
            "kind": {"enum": ["alpha", "beta", "gamma", "delta"]},
            "ok": {"type": "boolean"}}}}}}
# a typical API schema for the compile time: nested objects and arrays, enums, optional fields, a $ref
COMPILE_SCHEMA = {
    "type": "object", "$defs": {"address": {"type": "object", "properties": {
        "street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["street", "city"]}},
    "properties": {
        "id": {"type": "integer"}, "name": {"type": "string", "maxLength": 64}, "email": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150}, "active": {"type": "boolean"},
        "role": {"enum": ["admin", "editor", "viewer"]}, "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "address": {"$ref": "#/$defs/address"},
        "orders": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}, "price": {"type": "number"}},
            "required": ["sku", "qty"]}}},
    "required": ["id", "name", "email", "role"]}
_SPECIALS = ["<s>", "</s>", "<pad>"]


def trained_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer (GPT-2 style) trained on this package's sources and docs, ``vocab_size``
    tokens at most, ``<s>``/``</s>``/``<pad>`` first."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    from litellm_pipeline.text.tokenizer import Tokenizer

    root = Path(__file__).resolve().parents[1]
    files = sorted(str(p) for p in [*root.rglob("*.py"), *root.parent.glob("docs/**/*.md"), *root.parent.glob("*.md")])
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(files, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return Tokenizer.from_tokenizer(tok, eos_token="</s>", bos_token="<s>")


def structured_checkpoint(name: str, cfg: dict, seed: int) -> Path:
    """The model's random checkpoint with a trained BPE vocabulary (written once under the cache root)."""
    digest = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:10]
    target = cache_root() / f"bench-{name}-{digest}-seed{seed}-bpe"
    if (target / "model.safetensors").is_file():
        return target
    return write_random_checkpoint(target, cfg, seed, tokenizer=trained_tokenizer(cfg["vocab_size"]))


def _prompts(n: int, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(len(_SPECIALS), vocab) for _ in range(24)] for _ in range(n)]


def _timed_mask(samples: list[float]) -> Callable:
    """The sample stage's mask_logits, timed."""
    from litellm_pipeline.constraints import masking

    inner = masking.mask_logits

    def mask_logits(logits, constrained):
        t0 = time.perf_counter()
        try:
            return inner(logits, constrained)
        finally:
            samples.append(time.perf_counter() - t0)

    return mask_logits


def _round(engine, prompts: list[list[int]], out_len: int, seed: int, mask_s: list[float],
           constrained_first: bool) -> tuple[float, float, int, int]:
    """(constrained seconds, free seconds, tokens, steps) of one round."""
    import litellm_pipeline.stages.sample as sample_stage

    def run(constraint: Any, lengths: list[int] | None) -> tuple[float, list]:
        t0 = time.perf_counter()
        reqs = [engine.add_request(p, SamplingParams(temperature=0.8, seed=seed + i, ignore_eos=constraint is None,
                                                     max_tokens=lengths[i] if lengths else out_len),
                                   constraint=constraint)
                for i, p in enumerate(prompts)]
        engine.run(reqs)
        return time.perf_counter() - t0, reqs

    original = sample_stage.mask_logits
    sample_stage.mask_logits = _timed_mask(mask_s)
    try:
        if constrained_first:
            t_con, reqs = run({"json_schema": SCHEMA}, None)
            lengths = [len(r.output_ids) for r in reqs]
            t_free, _ = run(None, lengths)
        else:  # the free run needs the constrained lengths: take them from an untimed constrained run first
            _, reqs = run({"json_schema": SCHEMA}, None)
            lengths = [len(r.output_ids) for r in reqs]
            t_free, _ = run(None, lengths)
            t_con, _ = run({"json_schema": SCHEMA}, None)
    finally:
        sample_stage.mask_logits = original
    bad = [r.request_id for r in reqs if r.finish_reason != "stop"]
    if bad:
        raise RuntimeError(f"structured bench: requests {bad} did not finish their JSON within {out_len} tokens")
    return t_con, t_free, sum(lengths), max(lengths)


def measure_structured(engine, batches: list[int], rounds: int, out_len: int, seed: int) -> dict:
    """Masking overhead per batch size, and the compile time of :data:`COMPILE_SCHEMA`."""
    from litellm_pipeline.constraints import ConstraintCompiler, to_constraint

    rt = engine.rt
    t0 = time.perf_counter()
    grammars = rt.constraints.grammars  # the vocabulary's tables, built on first use
    setup_ms = (time.perf_counter() - t0) * 1e3
    cold = []
    for i in range(5):  # a fresh compiler each time: nothing cached
        fresh = ConstraintCompiler(lambda: grammars)
        schema = {**COMPILE_SCHEMA, "title": f"cold-{i}"}
        t0 = time.perf_counter()
        fresh.compile(to_constraint({"json_schema": schema}))
        cold.append((time.perf_counter() - t0) * 1e3)
    spec = to_constraint({"json_schema": COMPILE_SCHEMA})
    rt.constraints.compile(spec)
    t0 = time.perf_counter()
    for _ in range(100):
        rt.constraints.compile(spec)
    hit_us = (time.perf_counter() - t0) * 1e4
    rows = []
    for batch in batches:
        prompts = _prompts(batch, seed + batch, rt.tokenizer.vocab_size)
        con, free, mask_s, tokens = [], [], [], 0
        for r in range(rounds):
            t_con, t_free, tokens, _ = _round(engine, prompts, out_len, seed, mask_s, constrained_first=r % 2 == 0)
            con.append(t_con)
            free.append(t_free)
        t_con, t_free = statistics.median(con), statistics.median(free)
        steps = len(mask_s)
        rows.append({"batch": batch, "tokens": tokens, "free_tok_s": tokens / t_free, "json_tok_s": tokens / t_con,
                     "overhead_pct": 100 * (t_con / t_free - 1),
                     "mask_us_per_step": 1e6 * statistics.median(mask_s) if steps else None,
                     "mask_us_per_row": 1e6 * statistics.median(mask_s) / batch if steps else None})
    gc.collect()
    return {"vocab_size": rt.tokenizer.vocab_size, "vocab_type": grammars.vocab_type, "setup_ms": setup_ms,
            "compile_cold_ms": statistics.median(cold), "compile_hit_us": hit_us, "schema_tokens_max": out_len,
            "rows": rows}
