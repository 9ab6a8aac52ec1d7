"""TierSet, and the configured tiers resolved against a checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Mapping, Sequence

from litellm_pipeline.errors import ConfigError

if TYPE_CHECKING:
    from litellm_pipeline.config.schema import TierSection
    from litellm_pipeline.model.config import ModelConfig


@dataclass(frozen=True)
class Price:
    """Monetary units per 1,000 prompt tokens and per 1,000 output tokens."""

    prompt_1k: float = 0.0
    output_1k: float = 0.0

    def of(self, prompt_tokens: int, output_tokens: int) -> float:
        return (prompt_tokens * self.prompt_1k + output_tokens * self.output_1k) / 1000.0


@dataclass(frozen=True)
class TierSet:
    """The compute a request may spend in MoE layers: experts per token in each decoder layer, which experts,
    and what a token costs at this setting.

    ``experts_per_layer`` has one entry per decoder layer (a dense model's tiers have none); ``cost`` is the
    configured relative compute; ``price`` the monetary price per 1k prompt / output tokens."""

    name: str
    experts_per_layer: tuple[int, ...]
    cost: float = 1.0
    allowed_experts: tuple[int, ...] | None = None
    price: Price = Price()

    @cached_property  # read for every request of every step by the router
    def uniform_k(self) -> int | None:
        """The expert count when every layer uses the same one (0 for a dense model), else None."""
        ks = self.experts_per_layer
        if not ks:
            return 0
        return ks[0] if all(k == ks[0] for k in ks) else None

    @property
    def experts_per_token(self) -> int | list[int]:
        """The expert count, or the per-layer list where layers differ."""
        k = self.uniform_k
        return k if k is not None else list(self.experts_per_layer)


def expert_count(spec: int | str, mc: ModelConfig, key: str) -> int:
    """One layer's expert count: an int, ``"native"`` (the checkpoint's own top-k), ``"<m>x"`` (m times the
    native top-k, as far as the model goes) or ``"all"``; more than the model has is a config error."""
    n, native = mc.num_experts, mc.experts_per_token
    if spec == "native":
        k = native
    elif spec == "all":
        k = n
    elif isinstance(spec, str):
        k = min(n, native * int(spec[:-1]))
    else:
        k = spec
    if k > n:
        raise ConfigError(
            f"{key}: {k} exceeds the model's {n} experts "
            f"(allowed 1..{n}, 'native' = the checkpoint's top-{native}, '<m>x', or 'all')"
        )
    return k


def per_layer_counts(spec: int | str | Sequence[int | str], mc: ModelConfig, key: str) -> tuple[int, ...]:
    """``experts_per_token`` of a tier as one count per decoder layer (a list must have one entry per layer)."""
    layers = mc.num_layers
    if isinstance(spec, (list, tuple)):
        if len(spec) != layers:
            raise ConfigError(
                f"{key}: a per-layer list needs one entry per decoder layer: the model has {layers} layers "
                f"(got {len(spec)} entries)"
            )
        return tuple(expert_count(s, mc, f"{key}[{i}]") for i, s in enumerate(spec))
    return (expert_count(spec, mc, key),) * layers


def resolve_tiers(tiers: Mapping[str, TierSection], mc: ModelConfig) -> dict[str, TierSet]:
    """Tiers in terms of this checkpoint; asking for more experts than it has is a config error.

    A dense model gets every tier with no per-layer counts (its prices still apply)."""
    out = {}
    for name, t in tiers.items():
        price = Price(t.price.prompt_1k, t.price.output_1k)
        if not mc.is_moe:
            out[name] = TierSet(name, (), t.cost, None, price)
            continue
        ks = per_layer_counts(t.experts_per_token, mc, f"tiers.{name}.experts_per_token")
        allowed = None
        if t.allowed_experts is not None:
            n = mc.num_experts
            bad = [e for e in t.allowed_experts if not 0 <= e < n]
            if bad or len(set(t.allowed_experts)) < max(ks):
                raise ConfigError(
                    f"tiers.{name}.allowed_experts: must hold at least {max(ks)} distinct expert ids in 0..{n - 1} "
                    f"(got {t.allowed_experts})"
                )
            allowed = tuple(sorted(set(t.allowed_experts)))
        out[name] = TierSet(name, ks, t.cost, allowed, price)
    return out
