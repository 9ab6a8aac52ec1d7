"""The example plugin (plugins/example_plugin): installed as its own distribution, used by config alone.

CI installs it with ``pip install --no-deps --no-build-isolation -e plugins/example_plugin``; when the
distribution is not installed yet, the fixture below runs that same command first.
"""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from litellm_pipeline import registry
from litellm_pipeline.errors import ConfigError
from litellm_pipeline.llm import LLM
from litellm_pipeline.sampling import SamplingParams

PLUGIN_DIR = Path(__file__).resolve().parents[2] / "plugins" / "example_plugin"
DIST_NAME = "litellm_pipeline_example_plugin"
PIP_INSTALL = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-e", str(PLUGIN_DIR)]

ORDER_WITH_BAN = "pipeline.order=[admit,select_tier,route,prefill,decode,ban,sample,emit]"
PROMPTS = ["Hello world", "The plugin"]
MAX_TOKENS = 12


def ban_overrides(token_ids, order: str = ORDER_WITH_BAN) -> list[str]:
    return [f"+pipeline.stages.ban={{impl: ban_tokens, params: {{token_ids: {sorted(token_ids)}}}}}", order]


@pytest.fixture(scope="module", autouse=True)
def example_plugin():
    """Make sure the example plugin's distribution is installed and its entry points are loaded."""
    try:
        metadata.distribution(DIST_NAME)
    except metadata.PackageNotFoundError:
        proc = subprocess.run(PIP_INSTALL, capture_output=True, text=True, timeout=600)
        if proc.returncode:
            pytest.fail(f"{' '.join(PIP_INSTALL)} failed:\n{proc.stdout}\n{proc.stderr}")
        importlib.invalidate_caches()
        metadata.distribution(DIST_NAME)  # the metadata is visible to this process now
        if importlib.util.find_spec(DIST_NAME) is None:
            # an editable install's .pth is only read at interpreter start-up
            sys.path.insert(0, str(PLUGIN_DIR))
        # this process may have scanned entry points before the install
        registry.load_plugins(force=True)
    yield


@pytest.fixture(scope="module")
def ckpt(hf_checkpoint):
    return str(hf_checkpoint("llama"))


@pytest.fixture(scope="module")
def base_llm(ckpt):
    return LLM(model=ckpt)


@pytest.fixture(scope="module")
def greedy_out(base_llm):
    outs = base_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=20))
    return [(o.token_ids, o.logprobs) for o in outs]


def stage_of(llm: LLM, cls_name: str):
    found = [s for s in llm.engine.step_stages if type(s).__name__ == cls_name]
    assert len(found) == 1, [type(s).__name__ for s in llm.engine.step_stages]
    return found[0]


# -- registration ---------------------------------------------------------------------------------------


def test_distribution_declares_entry_points():
    eps = metadata.distribution(DIST_NAME).entry_points
    assert {(ep.group, ep.name) for ep in eps} >= {
        ("litellm_pipeline.plugins", "example_plugin"),
        ("litellm_pipeline.sampler", "example_argmax"),
    }


def test_plugin_entries_are_registered():
    from litellm_pipeline_example_plugin.ban_tokens import BanTokens
    from litellm_pipeline_example_plugin.sampler import ArgmaxSampler

    assert "ban_tokens" in registry.names("stage")
    assert "example_argmax" in registry.names("sampler")
    assert registry.get("stage", "ban_tokens") is BanTokens
    assert registry.get("sampler", "example_argmax") is ArgmaxSampler
    assert not any(k.startswith("example") for k in registry.broken_plugins())
    assert BanTokens.level == "step"
    assert BanTokens.inputs == ("logits", "sample_requests") and BanTokens.outputs == ("logits",)


def test_register_is_idempotent_but_catches_clashes():
    import litellm_pipeline_example_plugin as plugin

    plugin.register()  # what load_plugins(force=True) does again: no duplicate error
    assert registry.get("stage", "ban_tokens") is plugin.BanTokens

    class OtherStage(plugin.BanTokens):  # someone else's stage under the same name
        pass

    with registry.isolated():
        registry.remove("stage", "ban_tokens")
        registry.add("stage", "ban_tokens", OtherStage)
        with pytest.raises(registry.RegistryError, match="ban_tokens"):
            plugin.register()
    assert registry.get("stage", "ban_tokens") is plugin.BanTokens


# -- ban_tokens -------------------------------------------------------------------------------------------


def test_ban_tokens_by_config_alone(ckpt, greedy_out):
    banned = {t for ids, _ in greedy_out for t in ids}  # everything the unbanned greedy run produced
    llm = LLM(model=ckpt, overrides=ban_overrides(banned))
    assert [type(s).__name__ for s in llm.engine.step_stages][-3:] == ["BanTokens", "Sample", "Emit"]
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    for out, (ids, logprobs) in zip(outs, greedy_out):
        assert len(out.token_ids) == MAX_TOKENS
        assert not banned & set(out.token_ids), (out.token_ids, sorted(banned))
        assert out.token_ids[0] != ids[0]
        # the first token is still the greedy choice among what is left: the best unbanned token
        allowed = {t: lp for t, lp in logprobs[0].items() if t not in banned}
        assert out.token_ids[0] == max(allowed, key=allowed.get)


def test_ban_tokens_with_sampling(ckpt, greedy_out):
    banned = {t for ids, _ in greedy_out for t in ids}
    llm = LLM(model=ckpt, overrides=ban_overrides(banned))
    params = [SamplingParams(temperature=1.5, seed=s, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1) for s in range(4)]
    outs = llm.generate(PROMPTS * 2, params)
    for out in outs:
        assert not banned & set(out.token_ids), (out.token_ids, sorted(banned))
        for step in out.logprobs:  # banned tokens have no probability left
            assert not banned & {t for t, lp in step.items() if lp != float("-inf")}


def test_ban_nothing_changes_nothing(ckpt, greedy_out):
    llm = LLM(model=ckpt, overrides=ban_overrides([]))
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in outs] == [ids for ids, _ in greedy_out]


@pytest.mark.parametrize("bad", ["[384]", "[-1]", "[1.5]", "7"])
def test_ban_tokens_bad_params_are_config_errors(ckpt, bad):
    with pytest.raises(ConfigError, match=r"pipeline\.stages\.ban\.params") as exc:
        LLM(model=ckpt, overrides=[f"+pipeline.stages.ban={{impl: ban_tokens, params: {{token_ids: {bad}}}}}", ORDER_WITH_BAN])
    assert "token_ids" in str(exc.value)


def test_ban_before_decode_is_a_graph_error(ckpt):
    order = "pipeline.order=[admit,select_tier,route,prefill,ban,decode,sample,emit]"
    with pytest.raises(ConfigError, match="logits"):
        LLM(model=ckpt, overrides=ban_overrides([5, 6], order))


# -- example_argmax sampler ------------------------------------------------------------------------------


def test_sampler_swap_by_one_override(ckpt, base_llm, greedy_out):
    from litellm_pipeline_example_plugin.sampler import ArgmaxSampler

    greedy = [ids for ids, _ in greedy_out]
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    # the default sampler really samples at temperature 1 (else the comparison below proves nothing)
    sampled = [o.token_ids for o in base_llm.generate(PROMPTS, params)]
    assert sampled != greedy

    llm = LLM(model=ckpt, overrides=["pipeline.stages.sample.params.sampler=example_argmax"])
    assert isinstance(stage_of(llm, "Sample").sampler, ArgmaxSampler)
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == greedy


def test_example_argmax_rejects_params(ckpt):
    with pytest.raises(ConfigError, match="example_argmax"):
        LLM(model=ckpt, overrides=["pipeline.stages.sample.params.sampler=example_argmax",
                                   "+pipeline.stages.sample.params.foo=1"])
