"""``+recipe=calibrate``: measure the cost and quality model on the loaded model and this machine.

Costs, per decoder layer and expert count: the MoE block's time on ``prefill_tokens`` rows (per token) and on
a decode batch of each size (per step), timed directly on the layer with random hidden states; the rest of a
step (attention, norms, LM head, the engine's own work) is measured as whole engine decode steps and a whole
prefill at the native count, minus their MoE blocks.

Quality, per layer and expert count: the model with that one layer changed and every other layer at all
experts, against the full model (all experts everywhere), scored over calibration sequences (prompt plus the
full model's greedy continuation): mean KL divergence KL(full || changed) of the next-token distributions and
top-1 agreement. The solvers' quality effect of a choice is its top-1 agreement minus one (the effects add up
over layers). For the embedded demo model it also records exact-match accuracy per configured tier.

The profile (JSON, named by model and machine) is what ``budget.profile`` loads.
"""

from __future__ import annotations

import math
import platform
import re
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from tqdm import tqdm

from litellm_pipeline.errors import ConfigError, section_settings
from litellm_pipeline.registry.types import AttentionMetadata, RoutePlan, SeqAttention
from litellm_pipeline.sampling import SamplingParams

# prompts for a checkpoint that is not the demo model (any text the tokenizer takes)
TEXT_PROMPTS = (
    "The quick brown fox jumps over the lazy dog because",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "In 1905, Albert Einstein published four papers that",
    "Ingredients: two cups of flour, one egg, and",
    "1, 2, 3, 5, 8, 13, 21,",
    "The meeting was moved to Thursday so that",
    "SELECT name, price FROM products WHERE",
    "Once upon a time, in a village by the sea,",
)


class CalibrateSettings(BaseModel):
    """The ``calibrate:`` config section (see recipes/calibrate.yaml)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    batch_sizes: list[int] = Field(default=[1, 4, 16, 64], min_length=1)
    prefill_tokens: int = Field(default=128, ge=1)
    repeats: int = Field(default=5, ge=1)  # timings: the median of this many runs after one warm-up
    # a timing whose runs spread more than this (interquartile range / median) gets `repeats` more runs, up to
    # max_repeats; one still spread then is named in the summary (the machine was noisy while it ran)
    stable_spread: float = Field(default=0.1, gt=0)
    max_repeats: int = Field(default=40, ge=1)
    decode_steps: int = Field(default=8, ge=1)  # engine decode steps timed per batch size
    prompts: int = Field(default=8, ge=1)  # calibration sequences for the quality effects
    continuation: int = Field(default=16, ge=1)  # full-model tokens generated after each prompt
    accuracy_per_task: int = Field(default=20, ge=0)  # demo model: held-out prompts per skill (0: skip)
    # prompts run one at a time (continuation tokens each) in balanced mode with the analytic cost model and with
    # the new profile, to say how far each one's latency predictions err (0: skip)
    check_prompts: int = Field(default=40, ge=0)
    out: str | None = None  # null: <run dir>/cost_profile-<model>-<machine>.json
    progress: bool = True


def calibrate_settings(section: Any) -> CalibrateSettings:
    s = section_settings(CalibrateSettings, section, "calibrate")
    if min(s.batch_sizes) < 1:
        raise ConfigError(f"calibrate.batch_sizes: every batch size must be >= 1 (got {s.batch_sizes})")
    return s


def machine_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} x{torch.get_num_threads()} threads"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()} x{torch.get_num_threads()} threads"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()[:60]


# ---- model-level helpers ----------------------------------------------------------------------------------


@torch.inference_mode()
def sequence_logits(model, ids: list[int], plan, dtype: torch.dtype) -> torch.Tensor:
    """Logits [T, V] (float32) of every position of one sequence, as one prefill into a scratch KV cache."""
    cfg = model.cfg
    dev = model.embed_tokens.device
    t = len(ids)
    slots = torch.arange(t, device=dev)
    caches = [(torch.zeros(t, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=dev),
               torch.zeros(t, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=dev)) for _ in range(cfg.num_layers)]
    meta = AttentionMetadata(slot_mapping=slots, positions=slots.clone(),
                             prefills=[SeqAttention(q_start=0, q_len=t, ctx_len=t, kv_slots=slots)])
    rope = torch.full((t,), t, device=dev) if model.dynamic_rope else None
    hidden = model(torch.tensor(ids, device=dev), meta, caches, plan, rope)
    return model.compute_logits(hidden)


def spread(times: list[float]) -> float:
    """Interquartile range over the median of some timings (0 for fewer than 4)."""
    if len(times) < 4:
        return 0.0
    q = statistics.quantiles(times, n=4)
    return (q[2] - q[0]) / max(statistics.median(times), 1e-12)


class Timings:
    """Medians of timed runs, repeated until their spread is under ``stable_spread`` (or ``max_repeats`` runs);
    what stayed spread is kept to be said."""

    def __init__(self, repeats: int, stable_spread: float = 0.1, max_repeats: int = 40):
        self.repeats, self.tol, self.most = repeats, stable_spread, max(repeats, max_repeats)
        self.unstable: list[dict] = []
        self.measured = 0

    def median_ms(self, fn, what: str) -> float:
        fn()  # warm-up (first calls compile or page in)
        times: list[float] = []
        while True:
            for _ in range(self.repeats):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            # four runs at least: fewer say nothing about their spread
            if (len(times) >= 4 and spread(times) <= self.tol) or len(times) >= self.most:
                break
        self.measured += 1
        if spread(times) > self.tol:
            self.unstable.append({"what": what, "runs": len(times), "spread": round(spread(times), 3)})
        return statistics.median(times)



@torch.inference_mode()
def moe_block_ms(layer, k: int, rows: int, timings: Timings | int, dtype: torch.dtype, what: str = "") -> float:
    """The MoE block of ``layer`` on ``rows`` random hidden states with ``k`` experts per token (``timings``:
    a Timings, or a number of runs)."""
    h = layer.mlp.gate.shape[1]
    g = torch.Generator().manual_seed(rows * 131 + k)
    x = torch.randn(rows, h, generator=g).to(dtype=dtype, device=layer.mlp.gate.device)
    plan = RoutePlan(max_k=k)
    if isinstance(timings, int):
        timings = Timings(timings, math.inf)
    return timings.median_ms(lambda: layer.mlp(x, plan), what)


def _engine_decode_ms(engine, batch: int, steps: int, repeats: int, max_model_len: int) -> float:
    """ms per engine step with ``batch`` requests decoding (native routing), median over ``repeats`` runs."""
    vocab = engine.rt.model_cfg.vocab_size
    prompt_len = max(2, min(8, max_model_len // 4))
    params = SamplingParams(max_tokens=max(2, min(steps * (repeats + 1) + 4, max_model_len - prompt_len - 1)),
                            temperature=0.0, ignore_eos=True)
    native = next((t.name for t in engine.rt.tiers.values() if t.uniform_k == engine.rt.model_cfg.experts_per_token
                   and t.allowed_experts is None), None)
    reqs = [engine.add_request([(7 * i + j) % vocab for j in range(prompt_len)], params, tier=native)
            for i in range(batch)]
    try:
        for _ in range(10 * batch + 10):  # until every request is past its prefill
            engine.step()
            if all(len(r.output_ids) >= 1 for r in reqs):
                break
        per_run = []
        for _ in range(repeats):
            if any(r.finished for r in reqs):
                break
            t0 = time.perf_counter()
            for _ in range(steps):
                engine.step()
            per_run.append((time.perf_counter() - t0) * 1e3 / steps)
        return statistics.median(per_run) if per_run else float("nan")
    finally:
        for r in reqs:
            if r.request_id is not None:
                engine.abort(r.request_id)


def _calibration_sequences(engine, demo: bool, s: CalibrateSettings) -> list[list[int]]:
    """Prompt + the full model's greedy continuation, as token ids."""
    if demo:
        from litellm_pipeline.demo.skills import heldout

        per = max(1, -(-s.prompts // 5))
        prompts = [ex.prompt for ex in heldout(per, seed=4321)][: s.prompts]
    else:
        prompts = [TEXT_PROMPTS[i % len(TEXT_PROMPTS)] for i in range(s.prompts)]
    params = SamplingParams(max_tokens=s.continuation, temperature=0.0, ignore_eos=True)
    top = max(engine.rt.tiers.values(), key=lambda t: sum(t.experts_per_layer))
    outs = []
    for p in prompts:
        (out,) = engine.run([engine.add_request(p, params, tier=top.name)])
        outs.append(list(out.prompt_token_ids) + list(out.token_ids))
    return outs


def _plan(k_per_layer: tuple[int, ...]) -> tuple[RoutePlan, ...]:
    return tuple(RoutePlan(max_k=k) for k in k_per_layer)


def quality_effects(model, seqs: list[list[int]], choices: tuple[int, ...], num_experts: int, dtype, bar):
    """Per layer and count: (mean KL(full || changed), top-1 agreement) with only that layer changed."""
    layers = model.cfg.num_layers
    full = _plan((num_experts,) * layers)
    refs = [sequence_logits(model, ids, full, dtype) for ids in seqs]
    out = []
    for layer in range(layers):
        per_k = {}
        for k in choices:
            ks = tuple(k if i == layer else num_experts for i in range(layers))
            kl, agree, n = 0.0, 0, 0
            for ids, ref in zip(seqs, refs):
                got = sequence_logits(model, ids, _plan(ks), dtype)
                lp_ref, lp = F.log_softmax(ref, -1), F.log_softmax(got, -1)
                kl += float((lp_ref.exp() * (lp_ref - lp)).sum(-1).sum())
                agree += int((ref.argmax(-1) == got.argmax(-1)).sum())
                n += len(ids)
            per_k[k] = (kl / n, agree / n)
            bar.update(1)
        out.append(per_k)
    return out


def calibrate(engine, s: CalibrateSettings, demo: bool, model_name: str) -> dict:
    """Measure everything and return the profile (see the module docstring)."""
    rt = engine.rt
    mc, model = rt.model_cfg, rt.model
    if not mc.is_moe:
        raise ConfigError(f"calibrate: {model_name} is a dense model: there are no expert counts to calibrate")
    dtype = model.embed_tokens.dtype
    choices = rt.cost_model.choices
    native, n_exp = mc.experts_per_token, mc.num_experts
    sparse = mc.moe_layers or (True,) * mc.num_layers
    batches = sorted(set(s.batch_sizes))
    work = mc.num_layers * len(choices) * (1 + len(batches)) + len(batches) + 1 + mc.num_layers * len(choices)
    bar = tqdm(total=work, desc="calibrate", disable=not s.progress, dynamic_ncols=True)
    timings = Timings(s.repeats, s.stable_spread, s.max_repeats)
    layers = []
    for i, layer in enumerate(model.layers):
        pre, dec = {}, {}
        for k in choices:
            if not sparse[i]:
                pre[k], dec[k] = 0.0, dict.fromkeys(batches, 0.0)
                bar.update(1 + len(batches))
                continue
            pre[k] = moe_block_ms(layer, k, s.prefill_tokens, timings, dtype,
                                  f"layer {i} k={k} prefill") / s.prefill_tokens
            bar.update(1)
            dec[k] = {}
            for b in batches:
                dec[k][b] = moe_block_ms(layer, k, b, timings, dtype, f"layer {i} k={k} decode b={b}")
                bar.update(1)
        layers.append({"prefill_ms": pre, "decode_ms": dec})
    fixed_decode = {}
    for b in batches:
        b_eff = min(b, rt.scheduler.max_num_seqs)
        step = _engine_decode_ms(engine, b_eff, s.decode_steps, s.repeats, rt.max_model_len)
        moe = sum(layers[i]["decode_ms"][native][b] for i in range(mc.num_layers) if native in layers[i]["decode_ms"])
        fixed_decode[b] = max(0.0, step - moe)
        bar.update(1)
    p = min(s.prefill_tokens, rt.max_model_len)
    ids = [(3 * j + 1) % mc.vocab_size for j in range(p)]
    whole = timings.median_ms(lambda: sequence_logits(model, ids, None, dtype), "whole prefill")
    moe_pre = sum(layers[i]["prefill_ms"].get(native, 0.0) * p for i in range(mc.num_layers))
    fixed_prefill = max(0.0, whole - moe_pre) / p
    bar.update(1)
    seqs = _calibration_sequences(engine, demo, s)
    effects = quality_effects(model, seqs, choices, n_exp, dtype, bar)
    bar.close()
    for layer, eff in zip(layers, effects):
        layer["kl"] = {k: round(v[0], 6) for k, v in eff.items()}
        layer["top1"] = {k: round(v[1], 6) for k, v in eff.items()}
        layer["quality"] = {k: round(v[1] - 1.0, 6) for k, v in eff.items()}
    profile = {
        "model": model_name,
        "machine": machine_name(),
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "choices": list(choices),
        "base_quality": 1.0,
        "fixed": {"prefill_ms": fixed_prefill, "decode_ms": fixed_decode},
        "layers": layers,
        "calibration": {"sequences": len(seqs), "tokens": sum(len(x) for x in seqs),
                        "quality": "top-1 agreement with the full model, minus 1, with only that layer changed"},
        "timings": {"measured": timings.measured, "stable_spread": s.stable_spread, "unstable": timings.unstable},
    }
    if demo and s.accuracy_per_task:
        from litellm_pipeline.tasks.eval import EvalSettings, evaluate

        acc = evaluate(engine, rt.tiers, EvalSettings(per_task=s.accuracy_per_task, progress=False))
        profile["accuracy"] = {t: a["all"] for t, a in acc["accuracy"].items()}
    return profile


def _errors(pairs: list[tuple[float, float]]) -> dict:
    """(predicted, actual) pairs: the median absolute and the mean signed error of predicted / actual - 1."""
    errs = [p / a - 1.0 for p, a in pairs if a > 0]
    if not errs:
        return {"median_abs": None, "mean": None, "n": 0}
    return {"median_abs": statistics.median(abs(e) for e in errs), "mean": statistics.fmean(errs), "n": len(errs)}


def check_predictions(plain: dict, profile_path: Path, s: CalibrateSettings, demo: bool) -> dict:
    """How far latency predictions err with the analytic cost model and with the profile at ``profile_path``:
    ``check_prompts`` prompts one at a time (``continuation`` tokens each, past any EOS) in ``balanced`` mode;
    per cost model the error of its own prediction, of the prediction the latency tracker corrected (what the
    solver plans with), and of the first request's (nothing measured yet)."""
    import copy

    from litellm_pipeline.config.build import build_engine
    from litellm_pipeline.tasks.budget_load import workload_prompts
    from litellm_pipeline.telemetry import MemorySink, RequestCosted

    prompts = workload_prompts(s.check_prompts, demo, seed=4321)
    params = SamplingParams(max_tokens=s.continuation, temperature=0.0, ignore_eos=True)
    out = {}
    for name, profile in (("analytic", None), ("profile", str(profile_path))):
        cfg = copy.deepcopy(plain)
        cfg.setdefault("pipeline", {}).setdefault("stages", {}).setdefault("select_tier", {}).setdefault(
            "params", {})["mode"] = "balanced"
        cfg.setdefault("budget", {})["profile"] = profile
        engine = build_engine(cfg)
        sink = MemorySink()
        engine.rt.bus.subscribe(sink)
        for p in prompts:
            engine.run([engine.add_request(p, params)])
        costed = sink.of(RequestCosted)
        own = [(e.predicted_latency_ms / e.correction[0], e.latency_ms) for e in costed]
        corrected = [(e.predicted_latency_ms, e.latency_ms) for e in costed]
        out[name] = {"own": _errors(own), "corrected": _errors(corrected), "first": _errors(own[:1])}
        engine.close()
    return out


def _pct(e: dict, key: str) -> str:
    v = e[key]
    return "-" if v is None else f"{v:+.0%}" if key == "mean" else f"{v:.0%}"


def run(cfg) -> dict:
    """The ``calibrate`` task: build the configured engine, measure, print a summary, write the profile."""
    from litellm_pipeline.config.build import build_engine, to_plain
    from litellm_pipeline.tasks import model_name, write_json

    plain = to_plain(cfg)
    s = calibrate_settings(plain.get("calibrate"))
    par = plain.get("parallel") or {}
    if max(par.get("tensor", 1), par.get("expert", 1)) > 1:
        raise ConfigError("calibrate: measures one process's layers on scratch KV caches; run it without "
                          "parallel.tensor / parallel.expert (the profile is per machine, not per split)")
    engine = build_engine(plain)
    name = model_name(plain)
    profile = calibrate(engine, s, plain["model"].get("path") is None, name)
    default = f"cost_profile-{_slug(profile['model'])}-{_slug(profile['machine'])}.json"
    where = write_json(profile, Path(s.out).resolve() if s.out else default)  # calibrate.out: from the launch folder
    print(f"model: {name}; machine: {profile['machine']}; dtype {profile['dtype']}")
    b0 = min(s.batch_sizes)
    print(f"per layer and experts per token k: the MoE block's time per decode step at batch {b0} (ms, median of "
          f"timed runs) and top-1 agreement with the full model with only that layer at k")
    print(f"{'layer':<6}" + "".join(f"{'k=' + str(k):>24}" for k in profile["choices"]))
    for i, layer in enumerate(profile["layers"]):
        cells = [f"{layer['decode_ms'][k][min(layer['decode_ms'][k])]:.3f}ms top1={layer['top1'][k]:.3f}"
                 for k in profile["choices"]]
        print(f"{i:<6}" + "".join(f"{c:>24}" for c in cells))
    fixed = profile["fixed"]
    print(f"outside the MoE blocks: prefill {fixed['prefill_ms']:.4f} ms/token; decode step "
          + ", ".join(f"b={b}: {t:.2f} ms" for b, t in fixed["decode_ms"].items()))
    t = profile["timings"]
    if t["unstable"]:
        worst = max(t["unstable"], key=lambda u: u["spread"])
        print(f"timings NOT stable: {len(t['unstable'])} of {t['measured']} still spread more than "
              f"{t['stable_spread']:.0%} (interquartile range / median) after up to {s.max_repeats} runs, worst "
              f"{worst['what']} ({worst['spread']:.0%}): the machine was busy; rerun on a quiet one")
    else:
        print(f"timings stable: all {t['measured']} within {t['stable_spread']:.0%} (interquartile range / median)")
    if "accuracy" in profile:
        print("demo accuracy by tier: " + ", ".join(f"{t} {a:.3f}" for t, a in profile["accuracy"].items()))
    print(f"wrote {where}  (use it: budget.profile={where})")
    if s.check_prompts:
        engine.close()
        check = check_predictions(plain, Path(where), s, plain["model"].get("path") is None)
        profile["prediction_check"] = check
        print(f"latency predictions, {s.check_prompts} prompts one at a time ({s.continuation} tokens each), balanced "
              "mode: error of predicted / measured end-to-end latency, median of its size and mean with its sign")
        print(f"{'cost model':<12}{'its own prediction':>22}{'corrected by the tracker':>28}{'first request':>16}")
        for name, c in check.items():
            own, cor = c["own"], c["corrected"]
            print(f"{name:<12}{_pct(own, 'median_abs') + ', ' + _pct(own, 'mean'):>22}"
                  f"{_pct(cor, 'median_abs') + ', ' + _pct(cor, 'mean'):>28}{_pct(c['first'], 'mean'):>16}")
        check_path = write_json(check, Path(where).with_name(Path(where).stem + "-prediction_check.json"))
        print(f"wrote {check_path}")
    return profile
