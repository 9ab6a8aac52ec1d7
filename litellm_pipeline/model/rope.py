"""Rotary position embeddings, numerically identical to ``transformers`` 5.x (Llama-family convention).

The formulas below repeat transformers' ``modeling_rope_utils`` op for op (same dtypes, same order, same
Python-float vs tensor arithmetic) because a last-ulp difference in cos/sin can flip a greedy token.
"""

from __future__ import annotations

import math

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
_DEFAULT_THETA = 10_000.0  # transformers' RotaryEmbeddingConfigMixin.default_theta
_REQUIRED_KEYS = {"linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
                  "llama3": ("factor", "low_freq_factor", "high_freq_factor")}


def _check_rope_type(rope_type: str) -> None:
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


def rope_parameters_from_config(hf_config: dict) -> dict:
    """Normalise a raw ``config.json`` dict into ``{'rope_type', 'rope_theta', 'max_position_embeddings', ...}``.

    Accepts transformers-5 ``rope_parameters`` and the legacy ``rope_theta`` + ``rope_scaling`` keys (whose dict
    may say ``type`` instead of ``rope_type``), with transformers' precedence: ``rope_scaling`` wins over
    ``rope_parameters``; a theta inside the dict wins over the top-level one. For ``llama3``/``yarn`` the result
    carries ``original_max_position_embeddings``: a top-level value wins (transformers re-standardises at RoPE
    init, which lets it override), else it defaults to ``max_position_embeddings``. Unsupported rope types
    (``mrope``, ``longrope``, ...), per-layer rope dicts and partial rotary raise ``ValueError``.
    """
    raw = hf_config.get("rope_scaling") or hf_config.get("rope_parameters") or {}
    if any(isinstance(v, dict) for v in raw.values()):
        raise ValueError(f"per-layer rope_parameters are not supported (keys: {sorted(raw)})")
    rope_type = raw.get("rope_type", raw.get("type", "default"))
    _check_rope_type(rope_type)
    params = {k: v for k, v in raw.items() if k != "type"}
    params["rope_type"] = rope_type
    params["rope_theta"] = float(params.get("rope_theta") or hf_config.get("rope_theta") or _DEFAULT_THETA)
    if "partial_rotary_factor" not in params and hf_config.get("partial_rotary_factor") is not None:
        params["partial_rotary_factor"] = hf_config["partial_rotary_factor"]
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor={params['partial_rotary_factor']} is not supported (only 1.0)")
    missing = [k for k in _REQUIRED_KEYS.get(rope_type, ()) if k not in params]
    if missing:
        raise ValueError(f"rope type {rope_type!r} needs keys {missing} in rope_parameters/rope_scaling")
    if "max_position_embeddings" not in hf_config:
        raise ValueError("config has no max_position_embeddings, which RoPE needs")
    params["max_position_embeddings"] = hf_config["max_position_embeddings"]
    if rope_type in ("llama3", "yarn"):
        if "original_max_position_embeddings" in hf_config:
            params["original_max_position_embeddings"] = hf_config["original_max_position_embeddings"]
        params.setdefault("original_max_position_embeddings", hf_config["max_position_embeddings"])
    return params


def _inv_freq(head_dim: int, params: dict, max_pos: int, device=None, seq_len=None) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2] float32, attention factor), copied op for op from transformers' init functions.

    ``seq_len`` (dynamic only) is an int64 0-dim tensor as in transformers' forward, which makes the NTK base
    float32 tensor arithmetic rather than Python doubles; ``None`` is the init-time (Python float) path.
    """
    rope_type, base, dim = params["rope_type"], params["rope_theta"], head_dim
    if rope_type == "default":  # the model classes' own compute_default_rope_parameters
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
    factor = params.get("factor")
    if rope_type == "linear":
        return 1.0 / (base**exponent) / factor, 1.0
    if rope_type == "dynamic":
        if seq_len is None:
            seq_len = max_pos
        else:
            seq_len = torch.maximum(seq_len, torch.tensor(max_pos, dtype=seq_len.dtype, device=seq_len.device))
        base = base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (base**exponent), 1.0
    old_ctx = params["original_max_position_embeddings"]
    if rope_type == "llama3":
        inv_freq = 1.0 / (base**exponent)
        low, high = params["low_freq_factor"], params["high_freq_factor"]
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        inv_llama = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_llama / factor + smooth * inv_llama
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, inv_llama), 1.0
    # yarn
    if factor is None:  # DeepSeek-style configs: the ratio of context lengths is the factor
        factor = max_pos / old_ctx

    def get_mscale(scale, mscale=1):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(num_rotations):  # Python doubles, as in transformers
        return (dim * math.log(old_ctx / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    extrapolation = 1 - ramp.to(device=device, dtype=torch.float)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention_factor


class RotaryEmbedding:
    """cos/sin per token for one model; tables are built once so a step costs an ``index_select``.

    ``max_position_embeddings`` is ``config.max_position_embeddings`` (the dynamic-NTK threshold, and the table
    length together with the scaled context of linear/yarn). Call :meth:`reserve` to cover longer contexts.
    """

    def __init__(self, head_dim: int, params: dict, max_position_embeddings: int, device=None):
        self.rope_type = params.get("rope_type", "default")
        _check_rope_type(self.rope_type)
        self.head_dim, self.params, self.max_position_embeddings = head_dim, params, max_position_embeddings
        # the tables live where the model is built (the loader builds it under `with torch.device(...)`), so
        # positions on a GPU index tables on that GPU
        self.device = torch.device(device) if device is not None else torch.get_default_device()
        # transformers builds inv_freq at init on the CPU (the config names no device) and only moves it after
        with torch.device("cpu"):
            inv_freq, self.attention_scaling = _inv_freq(head_dim, params, max_position_embeddings)
        self.inv_freq = inv_freq.to(self.device)
        self._cos = self._sin = None  # [N, head_dim // 2] float32, already times attention_scaling
        self._full: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}  # [N, head_dim] per dtype asked for
        if self.rope_type != "dynamic":
            n = max_position_embeddings
            if self.rope_type in ("linear", "yarn") and params.get("factor"):
                orig = params.get("original_max_position_embeddings", max_position_embeddings)
                n = max(n, math.ceil(orig * params["factor"]))
            self.reserve(n)

    def reserve(self, num_positions: int) -> None:
        """Make the cached tables cover positions ``[0, num_positions)`` (no-op for dynamic, which has none)."""
        if self.rope_type == "dynamic" or (self._cos is not None and self._cos.shape[0] >= num_positions):
            return
        positions = torch.arange(num_positions, device=self.device)
        self._cos, self._sin = self._half_cos_sin(positions, self.inv_freq)
        self._full.clear()

    def _half_cos_sin(self, positions: torch.Tensor, inv_freq: torch.Tensor):
        # transformers: cat((freqs, freqs)).cos() * scale; both halves are equal, so the tables keep one
        freqs = positions[:, None].float() * inv_freq.to(dtype=torch.float)
        return freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling

    def cos_sin(self, positions: torch.Tensor, seq_lens: torch.Tensor | None = None, dtype=torch.float32):
        """cos, sin of shape ``[T, head_dim]`` in ``dtype`` for ``positions`` ([T] long), times the attention factor.

        Only ``dynamic`` reads ``seq_lens`` ([T] long): the length transformers would see in that token's forward
        (its sequence's max position in the step + 1; ``None`` means one sequence, ``positions.max() + 1``). It is
        stateless: each token gets the original inv_freq when its length is ``<= max_position_embeddings``, else
        one recomputed for that length; this costs a host sync, the other types never do.
        Positions must be below the table length (see :meth:`reserve`).
        """
        if self.rope_type == "dynamic":
            cos, sin = self._dynamic_half_cos_sin(positions, seq_lens)
            return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((sin, sin), dim=-1).to(dtype)
        full = self.tables(dtype)
        return full[0].index_select(0, positions), full[1].index_select(0, positions)

    def tables(self, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The whole-width cos, sin tables ``[N, head_dim]`` in ``dtype`` (row p: position p), or None for
        ``dynamic``, whose values depend on the sequence length. Rebuilt when :meth:`reserve` grows them."""
        if self.rope_type == "dynamic":
            return None
        # made once per dtype: a decode step then costs two row lookups (the same values: concatenating and
        # rounding commute)
        full = self._full.get(dtype)
        if full is None:
            full = self._full[dtype] = (torch.cat((self._cos, self._cos), dim=-1).to(dtype),
                                        torch.cat((self._sin, self._sin), dim=-1).to(dtype))
        return full

    def _dynamic_half_cos_sin(self, positions: torch.Tensor, seq_lens: torch.Tensor | None):
        if seq_lens is None:
            seq_lens = (positions.max() + 1).expand(positions.shape[0])
        lens, inverse = torch.unique(seq_lens, return_inverse=True)
        rows = []
        for n in lens.tolist():
            if n <= self.max_position_embeddings:
                rows.append(self.inv_freq)
            else:  # transformers recomputes on the activation device from a 0-dim int64 seq_len
                seq_len = torch.tensor(n, dtype=torch.int64, device=self.device)
                inv_freq, _ = _inv_freq(self.head_dim, self.params, self.max_position_embeddings, self.device, seq_len)
                rows.append(inv_freq)
        return self._half_cos_sin(positions, torch.stack(rows)[inverse])


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate ``q`` [T, Hq, D] and ``k`` [T, Hk, D] by ``cos``/``sin`` [T, D] (transformers' rotate_half form).

    transformers does not upcast here: cos/sin arrive in the activation dtype and every product and sum rounds
    in it, so cos/sin are cast to ``q.dtype`` and the expression keeps transformers' order.
    """
    cos = cos.to(q.dtype)[:, None, :]
    sin = sin.to(q.dtype)[:, None, :]
    return (q * cos) + (_rotate_half(q) * sin), (k * cos) + (_rotate_half(k) * sin)
