"""Load a local Hugging Face checkpoint (config.json + one or sharded *.safetensors) into a CausalLM.

Checkpoint tensors are streamed straight into the model's stacked parameters (q/k/v into one qkv matrix,
gate/up into one matrix, experts into ``[E, ...]`` stacks), so peak memory stays near one copy of the model.
Every failure names the file or the tensor at fault.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from litellm_pipeline.model.config import CheckpointError, ModelConfig, read_json
from litellm_pipeline.model.decoder import CausalLM
from litellm_pipeline.parallel.comm import Collectives
from litellm_pipeline.parallel.shard import Shard, slice_rows

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def load_model_config(path: str | Path) -> ModelConfig:
    """Parse config.json only (cheap), so config errors surface before any weight is read."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {path}")
    return ModelConfig.from_dict(read_json(path / "config.json"), source=str(path / "config.json"))


def safetensors_files(path: Path) -> list[Path]:
    if (path / _INDEX).is_file():
        index = read_json(path / _INDEX)
        try:
            names = sorted(set(index["weight_map"].values()))
        except (KeyError, AttributeError) as exc:
            raise CheckpointError(f"corrupt index {path / _INDEX}: no 'weight_map'") from exc
        files = [path / n for n in names]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"checkpoint shard missing: {f} (listed in {path / _INDEX})")
        return files
    if (path / _SINGLE).is_file():
        return [path / _SINGLE]
    found = sorted(path.glob("*.safetensors"))
    if not found:
        raise CheckpointError(f"no weights in {path}: expected {_SINGLE} or {_INDEX} with its shards")
    return found


class _Filler:
    """Maps checkpoint tensor names onto slices of the model's parameters and tracks what was filled. Under tensor /
    expert parallelism (``model.shard``) each checkpoint tensor is first cut to this rank's part (its heads, its
    slice of an intermediate dimension or of the vocabulary, its experts)."""

    def __init__(self, model: CausalLM):
        self.params = dict(model.named_parameters())
        self.filled = {n: 0 for n in self.params}
        cfg = model.cfg
        self.shard = sh = model.shard
        d = cfg.head_dim
        (q0, q1), (k0, k1) = sh.q_heads(cfg), sh.kv_heads(cfg)
        q, kv = (q1 - q0) * d, (k1 - k0) * d
        self.qkv = {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}
        self.heads = {"q": (q0 * d, q1 * d), "k": (k0 * d, k1 * d), "v": (k0 * d, k1 * d)}
        self.experts = sh.experts(cfg) if cfg.is_moe else (0, 0)
        self.vocab = sh.vocab(cfg.vocab_size)
        self.tied = cfg.tie_word_embeddings

    def _put(self, pname: str, tensor: torch.Tensor, index: tuple = ()) -> None:
        if pname not in self.params:
            raise KeyError(pname)
        dst = self.params[pname].data[index] if index else self.params[pname].data
        if tuple(dst.shape) != tuple(tensor.shape):
            raise CheckpointError(
                f"tensor shape mismatch for {pname}{list(index) if index else ''}: checkpoint has "
                f"{tuple(tensor.shape)}, config.json implies {tuple(dst.shape)}"
            )
        dst.copy_(tensor)
        self.filled[pname] += tensor.numel()

    def _half(self, pname: str, tensor: torch.Tensor, which: int, expert: int | None = None) -> None:
        """Fill the gate (0) or up (1) half of a stacked gate/up matrix (this rank's rows of it)."""
        a, b = self.shard.expert_split(tensor.shape[0]) if expert is not None else self.shard.split(tensor.shape[0])
        tensor = slice_rows(tensor, a, b)
        n = tensor.shape[0]
        rows = slice(which * n, (which + 1) * n)
        self._put(pname, tensor, (expert, rows) if expert is not None else (rows,))

    def _expert(self, e: int) -> int | None:
        """The local index of expert ``e``, or None where another rank holds it."""
        first, last = self.experts
        return e - first if first <= e < last else None

    def _cols(self, tensor: torch.Tensor, expert: bool = False) -> torch.Tensor:
        """A row-parallel weight ([out, in]): this rank's slice of the input columns."""
        a, b = (self.shard.expert_split if expert else self.shard.split)(tensor.shape[-1])
        return slice_rows(tensor, a, b, dim=tensor.dim() - 1)

    def _fused_experts(self, tensor: torch.Tensor, gate_up: bool) -> torch.Tensor:
        """A transformers-5 fused expert stack ([E, 2I, H] gate/up or [E, H, I] down): this rank's experts, and
        under tensor parallelism its slice of each expert's intermediate dimension."""
        tensor = slice_rows(tensor, *self.experts)
        if not gate_up:
            return self._cols(tensor, expert=True)
        half = tensor.shape[1] // 2
        a, b = self.shard.expert_split(half)
        if (a, b) == (0, half):
            return tensor
        return torch.cat([tensor[:, a:b], tensor[:, half + a : half + b]], dim=1)

    def add(self, name: str, tensor: torch.Tensor) -> bool:
        """Route one checkpoint tensor; returns False for a name the model has no place for."""
        name = name.removeprefix("model.")
        if name == "lm_head.weight" and self.tied:
            return True
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
        if m is None:
            if name in ("embed_tokens.weight", "lm_head.weight"):
                tensor = slice_rows(tensor, *self.vocab)
            return self._try(name, tensor)
        i, rest = m.group(1), m.group(2)
        p = f"layers.{i}."
        rest = rest.replace("block_sparse_moe.", "mlp.")
        if mm := re.fullmatch(r"self_attn\.([qkv])_proj\.(weight|bias)", rest):
            a, b = self.qkv[mm.group(1)]
            target = p + ("self_attn.qkv_proj" if mm.group(2) == "weight" else "self_attn.qkv_bias")
            self._put(target, slice_rows(tensor, *self.heads[mm.group(1)]), (slice(a, b),))
            return True
        if mm := re.fullmatch(r"mlp\.(shared_expert\.)?(gate|up)_proj\.weight", rest):
            self._half(p + f"mlp.{mm.group(1) or ''}gate_up_proj", tensor, 0 if mm.group(2) == "gate" else 1)
            return True
        if mm := re.fullmatch(r"mlp\.experts\.(\d+)\.(w1|w3|gate_proj|up_proj)\.weight", rest):
            e = self._expert(int(mm.group(1)))
            if e is not None:
                self._half(p + "mlp.w13", tensor, 0 if mm.group(2) in ("w1", "gate_proj") else 1, e)
            return True
        if mm := re.fullmatch(r"mlp\.experts\.(\d+)\.(w2|down_proj)\.weight", rest):
            e = self._expert(int(mm.group(1)))
            if e is not None:
                self._put(p + "mlp.w2", self._cols(tensor, expert=True), (e,))
            return True
        if rest in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
            tensor = self._fused_experts(tensor, rest.endswith("gate_up_proj"))
        elif rest in ("self_attn.o_proj.weight", "mlp.down_proj.weight", "mlp.shared_expert.down_proj.weight"):
            tensor = self._cols(tensor)
        rest = {
            "mlp.gate.weight": "mlp.gate",
            "mlp.experts.gate_up_proj": "mlp.w13",  # transformers-5 fused expert layout
            "mlp.experts.down_proj": "mlp.w2",
            "mlp.shared_expert_gate.weight": "mlp.shared_expert_gate",
            "mlp.down_proj.weight": "mlp.down_proj",
            "mlp.shared_expert.down_proj.weight": "mlp.shared_expert.down_proj",
            "self_attn.o_proj.weight": "self_attn.o_proj",
            "self_attn.o_proj.bias": "self_attn.o_bias",
        }.get(rest, rest)
        return self._try(p + rest, tensor)

    def _try(self, pname: str, tensor: torch.Tensor) -> bool:
        pname = {"embed_tokens.weight": "embed_tokens", "lm_head.weight": "lm_head"}.get(pname, pname)
        if pname not in self.params:
            return False
        self._put(pname, tensor)
        return True

    def missing(self) -> list[str]:
        return [n for n, p in self.params.items() if self.filled[n] != p.numel()]


def load_model(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_fn: Callable,
    dispatch_fn: Callable,
    cfg: ModelConfig | None = None,
    expert_device: str | torch.device | None = None,
    shard: Shard | None = None,
    comm: Collectives | None = None,
) -> CausalLM:
    """Build the model for ``path`` and fill it from its safetensors files; MoE expert weights are allocated on
    ``expert_device`` when given (host memory for expert offload: they never take device memory). ``shard``: only
    this rank's part under tensor / expert parallelism, its collectives over ``comm``."""
    path = Path(path)
    cfg = cfg or load_model_config(path)
    files = safetensors_files(path)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = CausalLM(cfg, attn_fn, dispatch_fn, expert_device=expert_device, shard=shard, comm=comm)
    finally:
        torch.set_default_dtype(prev)
    filler = _Filler(model)
    unexpected: list[str] = []
    for f in files:
        try:
            handle = safe_open(str(f), framework="pt", device="cpu")
        except Exception as exc:
            raise CheckpointError(f"corrupt safetensors file {f}: {exc}") from exc
        with handle:
            for name in handle.keys():
                try:
                    tensor = handle.get_tensor(name)
                except Exception as exc:
                    raise CheckpointError(f"corrupt safetensors file {f}: tensor {name!r}: {exc}") from exc
                with torch.no_grad():
                    if not filler.add(name, tensor):
                        unexpected.append(name)
    missing = filler.missing()
    if missing:
        raise CheckpointError(
            f"checkpoint {path} lacks weights for {len(missing)} parameters, e.g. {', '.join(missing[:5])}"
        )
    unexpected = [u for u in unexpected if not u.endswith("rotary_emb.inv_freq")]
    if unexpected:
        raise CheckpointError(f"checkpoint {path} has tensors this model does not use: {', '.join(unexpected[:5])}")
    model.eval()
    return model
