"""device.huge_pages (litellm_pipeline/model/weight_arena.py): the CPU weights move bit for bit into one
huge-page-advised region, the same Parameter objects point at it, and the engine's outputs do not change."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from litellm_pipeline.model import weight_arena
from litellm_pipeline.sampling import SamplingParams
from litellm_pipeline.testing._support import DEMO_PROMPTS, build_llm

needs_thp = pytest.mark.skipif(not weight_arena.huge_pages_available(),
                               reason="this kernel offers no transparent huge pages (THP 'never' or missing)")
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)


def _mapping_flags(addr: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding ``addr``."""
    fields, inside = {}, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


class _Weights(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = nn.Parameter(torch.randn(1024, 768, generator=g), requires_grad=False)  # 3 MiB
        self.b = nn.Parameter(torch.randn(33, 7, generator=g).bfloat16(), requires_grad=False)  # odd size
        self.c = nn.Parameter(torch.randint(-127, 128, (300, 13), generator=g).to(torch.int8), requires_grad=False)


@needs_thp
def test_pack_moves_every_parameter_bit_for_bit_into_huge_pages():
    m = _Weights()
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    objects = {n: p for n, p in m.named_parameters()}
    moved = weight_arena.pack_weights(m)
    assert moved >= sum(p.numel() * p.element_size() for p in m.parameters())
    lo, hi = weight_arena.arena_of(m)
    assert lo % weight_arena.HUGE_PAGE == 0
    for n, p in m.named_parameters():
        assert p is objects[n]  # the modules keep their Parameter objects
        assert torch.equal(p, before[n]) and p.dtype == before[n].dtype and p.shape == before[n].shape
        assert lo <= p.data_ptr() < hi and p.data_ptr() % 64 == 0 and p.is_contiguous()
    assert _mapping_flags(m.a.data_ptr()).get("THPeligible") == "1"
    assert weight_arena.pack_weights(m) == 0  # everything is there already: nothing moves again
    m.a.data = m.a.data.clone()  # a parameter replaced later (e.g. quantized) moves on the next pack
    assert not weight_arena.in_arena(m, m.a)
    assert weight_arena.pack_weights(m) > 0 and weight_arena.in_arena(m, m.a)
    assert torch.equal(m.a, before["a"])


def test_no_huge_pages_no_move(monkeypatch, tmp_path):
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    monkeypatch.setattr(weight_arena, "THP_SETTING", setting)
    m = _Weights()
    ptr = m.a.data_ptr()
    assert not weight_arena.huge_pages_available()
    assert weight_arena.pack_weights(m) == 0 and m.a.data_ptr() == ptr and weight_arena.arena_of(m) is None
    monkeypatch.setattr(weight_arena, "THP_SETTING", tmp_path / "missing")
    assert not weight_arena.huge_pages_available()


def _run(llm):
    outs = llm.generate(list(DEMO_PROMPTS), PARAMS)
    return [(o.token_ids, o.logprobs) for o in outs]


@needs_thp
@pytest.mark.parametrize("extra", [[], ["pipeline.stages.decode.params.layer_ops=cpu_int8",
                                        "pipeline.stages.decode.params.layer_ops_params={lm_head: true}"]])
def test_engine_outputs_do_not_depend_on_huge_pages(extra):
    on = build_llm(extra)
    off = build_llm([*extra, "device.huge_pages=false"])
    model = on.engine.rt.model
    assert on.engine.rt.huge_pages and not off.engine.rt.huge_pages
    assert all(weight_arena.in_arena(model, p) for p in model.parameters())
    assert weight_arena.arena_of(off.engine.rt.model) is None
    # the fused decode path reads the moved weights (its lists hold the same Parameters)
    if model.decode_weights is not None:
        assert weight_arena.in_arena(model, model.decode_weights["qkv_w"][0])
    assert _run(on) == _run(off)
