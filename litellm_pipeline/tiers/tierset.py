"""TierSet, and the configured tiers resolved against a checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

from litellm_pipeline.errors import ConfigError

if TYPE_CHECKING:
    from litellm_pipeline.config_schema import TierSection
    from litellm_pipeline.model.config import ModelConfig


@dataclass(frozen=True)
class TierSet:
    """The compute a request may spend in MoE layers: how many experts per token, and which experts."""

    name: str
    experts_per_token: int
    cost: float = 1.0
    allowed_experts: tuple[int, ...] | None = None


def resolve_tiers(tiers: Mapping[str, TierSection], mc: ModelConfig) -> dict[str, TierSet]:
    """Tiers in terms of this checkpoint; asking for more experts than it has is a config error.

    ``experts_per_token``: an int, ``"native"`` (the checkpoint's own top-k), ``"<m>x"`` (m times the
    native top-k, as far as the model goes) or ``"all"``. A dense model gets every tier with 0 experts.
    """
    out = {}
    for name, t in tiers.items():
        if not mc.is_moe:
            out[name] = TierSet(name, 0, t.cost)
            continue
        n, native, spec = mc.num_experts, mc.experts_per_token, t.experts_per_token
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
                f"tiers.{name}.experts_per_token: {k} exceeds the model's {n} experts "
                f"(allowed 1..{n}, 'native' = the checkpoint's top-{native}, '<m>x', or 'all')"
            )
        allowed = None
        if t.allowed_experts is not None:
            bad = [e for e in t.allowed_experts if not 0 <= e < n]
            if bad or len(set(t.allowed_experts)) < k:
                raise ConfigError(
                    f"tiers.{name}.allowed_experts: must hold at least {k} distinct expert ids in 0..{n - 1} "
                    f"(got {t.allowed_experts})"
                )
            allowed = tuple(sorted(set(t.allowed_experts)))
        out[name] = TierSet(name, k, t.cost, allowed)
    return out
