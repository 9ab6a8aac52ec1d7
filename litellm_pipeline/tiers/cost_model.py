"""The cost and quality model budget solvers plan with: what a TierSet costs per layer and what it buys.

Per decoder layer and expert count ``k`` the model holds the prefill cost per prompt token, the decode cost
per step at a few batch sizes (interpolated between them) and a quality effect (0 = as good as the full
model; negative = worse; the effects of the layers add up). Everything outside the MoE blocks is a fixed
part. Monetary prices come from the configured tiers: a tier's price is per 1k tokens at its expert count,
and a per-layer mix pays the mean over its layers of the price at each layer's count.

Two sources: a profile measured on this machine (``+recipe=calibrate`` writes it; :meth:`CostModel.from_profile`
loads it), or, without one, an analytic estimate from FLOPs and bytes (:meth:`CostModel.analytic`), labelled
as such in every cost record.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Sequence

from litellm_pipeline.errors import ConfigError
from litellm_pipeline.tiers.tierset import Price, TierSet

if TYPE_CHECKING:
    from litellm_pipeline.model.config import ModelConfig


def _interp(points: Mapping[int, float], x: float, beyond: str = "proportional") -> float:
    """Piecewise-linear in ``x`` through ``points``; flat below the first point; beyond the last, proportional
    to ``x`` (a cost growing with the batch) or flat (``beyond="flat"``, a price)."""
    xs = sorted(points)
    if x <= xs[0]:
        return points[xs[0]]
    if x >= xs[-1]:
        last = points[xs[-1]]
        grows = beyond == "proportional" and len(xs) > 1 and last > points[xs[0]]
        return last * (x / xs[-1]) if grows else last
    i = bisect.bisect_right(xs, x)
    a, b = xs[i - 1], xs[i]
    return points[a] + (points[b] - points[a]) * (x - a) / (b - a)


@dataclass(frozen=True)
class LayerCosts:
    """One decoder layer's MoE block, per expert count."""

    prefill_ms: Mapping[int, float]  # k -> ms per prompt token
    decode_ms: Mapping[int, Mapping[int, float]]  # k -> {batch size: ms per decode step}
    quality: Mapping[int, float]  # k -> quality effect (<= 0 below the full model)


@dataclass(frozen=True)
class Prediction:
    """What a request is expected to cost at one TierSet."""

    latency_ms: float  # end to end: queue wait + prefill + every output token
    per_token_ms: float  # inter-token
    monetary: float
    quality: float  # predicted relative quality (1 + the summed layer effects of the model's best)


@dataclass(frozen=True)
class CostModel:
    source: str  # "analytic" or the profile's path
    choices: tuple[int, ...]  # expert counts a layer may take
    fixed_prefill_ms: float  # per prompt token, outside the MoE blocks
    fixed_decode_ms: Mapping[int, float]  # batch size -> ms per decode step, outside the MoE blocks
    layers: tuple[LayerCosts, ...]  # one per decoder layer (empty for a dense model)
    prices: Mapping[int, Price]  # expert count -> price per 1k tokens (from the configured tiers)
    base_quality: float = 1.0

    def __post_init__(self) -> None:
        # a request's latency is linear in its prompt and output lengths, so a prediction is two products once
        # the rates are known (predictions are made several times per admitted request, on the engine's thread):
        # per (expert counts, batch) (ms per prompt token, ms per decode step, quality), and per (layer, count,
        # batch) the layer's (ms per prompt token, ms per decode step, price, quality)
        object.__setattr__(self, "_rates", {})
        object.__setattr__(self, "_layer_rates", {})

    # ---- building ---------------------------------------------------------------------------------------
    @staticmethod
    def tier_prices(tiers: Mapping[str, TierSet]) -> dict[int, Price]:
        """Expert count -> price, from the configured uniform tiers (the cheaper one where two share a count)."""
        out: dict[int, Price] = {}
        for t in tiers.values():
            k = t.uniform_k
            if k is None:
                continue
            if k not in out or t.price.output_1k + t.price.prompt_1k < out[k].output_1k + out[k].prompt_1k:
                out[k] = t.price
        return out

    @classmethod
    def analytic(
        cls,
        mc: ModelConfig,
        tiers: Mapping[str, TierSet],
        choices: Sequence[int] | None = None,
        flops_per_s: float = 5e10,
        bytes_per_s: float = 1e10,
        weight_bytes: int = 4,
    ) -> CostModel:
        """An estimate from FLOPs and bytes: compute-bound prefill, decode bound by the larger of its FLOPs
        and the expert weights a batch of that size touches; quality falls by a fixed share per halving of
        the experts below the checkpoint's own top-k and rises slightly above it. No measurement behind it."""
        h, inter = mc.hidden_size, mc.moe_intermediate_size or mc.intermediate_size
        q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
        attn_params = h * (2 * q + 2 * kv)
        head_params = h * mc.vocab_size
        fixed_flops = 2 * (attn_params * mc.num_layers + head_params)
        fixed_prefill = fixed_flops / flops_per_s * 1e3
        batches = (1, 4, 16, 64)
        fixed_decode = {
            b: max(b * fixed_flops / flops_per_s, (attn_params * mc.num_layers + head_params) * weight_bytes / bytes_per_s)
            * 1e3
            for b in batches
        }
        layers: list[LayerCosts] = []
        n, native = mc.num_experts, mc.experts_per_token
        ks = tuple(sorted(set(choices))) if choices else cls._default_choices(tiers, mc)
        if mc.is_moe:
            expert_params = 3 * h * inter
            sparse = mc.moe_layers or (True,) * mc.num_layers
            for layer in range(mc.num_layers):
                if not sparse[layer]:  # a dense MLP layer of a MoE model: the count changes nothing there
                    layers.append(LayerCosts(dict.fromkeys(ks, 0.0), {k: dict.fromkeys(batches, 0.0) for k in ks},
                                             dict.fromkeys(ks, 0.0)))
                    continue
                pre = {k: 2 * expert_params * k / flops_per_s * 1e3 for k in ks}
                dec = {
                    k: {
                        b: max(
                            b * 2 * expert_params * k / flops_per_s,
                            n * (1 - (1 - k / n) ** b) * expert_params * weight_bytes / bytes_per_s,
                        ) * 1e3
                        for b in batches
                    }
                    for k in ks
                }
                qual = {
                    k: (-0.25 * math.log2(native / k) if k < native else 0.01 * math.log2(k / native)) / mc.num_layers
                    for k in ks
                }
                layers.append(LayerCosts(pre, dec, qual))
        return cls("analytic", ks, fixed_prefill, fixed_decode, tuple(layers), cls.tier_prices(tiers), 0.98)

    @staticmethod
    def _default_choices(tiers: Mapping[str, TierSet], mc: ModelConfig) -> tuple[int, ...]:
        ks = {k for t in tiers.values() for k in t.experts_per_layer}
        if not ks and mc.is_moe:
            ks = {mc.experts_per_token}
        return tuple(sorted(ks))

    @classmethod
    def from_profile(cls, path: str | Path, mc: ModelConfig, tiers: Mapping[str, TierSet]) -> CostModel:
        """Load a profile written by ``+recipe=calibrate``; it must describe this checkpoint's layers."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
            layers = tuple(
                LayerCosts(
                    {int(k): float(v) for k, v in layer["prefill_ms"].items()},
                    {int(k): {int(b): float(t) for b, t in v.items()} for k, v in layer["decode_ms"].items()},
                    {int(k): float(v) for k, v in layer["quality"].items()},
                )
                for layer in data["layers"]
            )
            choices = tuple(sorted(int(k) for k in data["choices"]))
            fixed_prefill = float(data["fixed"]["prefill_ms"])
            fixed_decode = {int(b): float(t) for b, t in data["fixed"]["decode_ms"].items()}
            base = float(data.get("base_quality", 1.0))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"budget.profile: cannot read cost profile {path}: {type(exc).__name__}: {exc}") from exc
        expected = mc.num_layers if mc.is_moe else 0
        if len(layers) != expected:
            raise ConfigError(f"budget.profile: {path} describes {len(layers)} MoE layers but the model has {expected}")
        missing = [k for k in choices for layer in layers if k not in layer.prefill_ms or k not in layer.quality]
        if missing:
            raise ConfigError(f"budget.profile: {path} lacks costs for expert count(s) {sorted(set(missing))}")
        return cls(str(path), choices, fixed_prefill, fixed_decode, layers, cls.tier_prices(tiers), base)

    # ---- reading --------------------------------------------------------------------------------------
    def price_at(self, k: int) -> Price:
        """The price per 1k tokens at ``k`` experts in every layer (interpolated between configured tiers)."""
        if not self.prices:
            return Price()
        if k in self.prices:
            return self.prices[k]
        pp = _interp({kk: p.prompt_1k for kk, p in self.prices.items()}, k, beyond="flat")
        po = _interp({kk: p.output_1k for kk, p in self.prices.items()}, k, beyond="flat")
        return Price(pp, po)

    def layer_option(self, layer: int, k: int, prompt_tokens: int, max_tokens: int, batch: int):
        """(end-to-end ms, inter-token ms, money, quality) one layer adds at ``k`` experts."""
        key = (layer, k, batch)
        rates = self._layer_rates.get(key)
        if rates is None:
            lc = self.layers[layer]
            if len(self._layer_rates) >= 4096:  # layers x counts x batch sizes: bounded
                self._layer_rates.clear()
            rates = self._layer_rates[key] = (lc.prefill_ms[k], _interp(lc.decode_ms[k], batch), self.price_at(k),
                                        lc.quality[k])
        pre, dec, price, quality = rates
        money = price.of(prompt_tokens, max_tokens) / len(self.layers)
        return prompt_tokens * pre + max_tokens * dec, dec, money, quality

    def fixed(self, prompt_tokens: int, max_tokens: int, batch: int) -> tuple[float, float]:
        """(end-to-end ms, inter-token ms) of everything outside the MoE blocks."""
        dec = _interp(self.fixed_decode_ms, batch)
        return prompt_tokens * self.fixed_prefill_ms + max_tokens * dec, dec

    def predict(self, ts: TierSet, prompt_tokens: int, max_tokens: int, batch: int = 1, wait_ms: float = 0.0) -> Prediction:
        """Latency, money and quality of a request at ``ts``; a request pays ``ts.price`` (solver-made TierSets
        carry the mean of their layers' prices, see :meth:`mixed_price`)."""
        pre, per_tok, quality = self._rates_at(ts.experts_per_layer, batch)
        lat = prompt_tokens * pre + max_tokens * per_tok
        return Prediction(lat + wait_ms, per_tok, ts.price.of(prompt_tokens, max_tokens), quality)

    def _rates_at(self, ks: tuple[int, ...], batch: int) -> tuple[float, float, float]:
        """(ms per prompt token, ms per decode step, quality) of expert counts ``ks`` at ``batch``, cached."""
        key = (ks, batch)
        got = self._rates.get(key)
        if got is not None:
            return got
        pre, per_tok = self.fixed_prefill_ms, _interp(self.fixed_decode_ms, batch)
        quality = self.base_quality
        if self.layers and ks:
            for lc, k in zip(self.layers, ks):
                k = self._nearest(k)
                pre += lc.prefill_ms[k]
                per_tok += _interp(lc.decode_ms[k], batch)
                quality += lc.quality[k]
        if len(self._rates) >= 4096:  # per-layer mixes x batch sizes: bounded
            self._rates.clear()
        got = self._rates[key] = (pre, per_tok, quality)
        return got

    def prefill_ms_per_token(self, ts: TierSet) -> float:
        ms = self.fixed_prefill_ms
        if self.layers and ts.experts_per_layer:
            ms += sum(layer.prefill_ms[self._nearest(k)] for layer, k in zip(self.layers, ts.experts_per_layer))
        return ms

    def mixed_price(self, experts_per_layer: Sequence[int]) -> Price:
        """The price of a per-layer mix: the mean over its layers of the price at each layer's count."""
        if not experts_per_layer:
            return Price()
        ps = [self.price_at(k) for k in experts_per_layer]
        return Price(sum(p.prompt_1k for p in ps) / len(ps), sum(p.output_1k for p in ps) / len(ps))

    def _nearest(self, k: int) -> int:
        if k in self.choices:
            return k
        return min(self.choices, key=lambda c: (abs(c - k), -c))

