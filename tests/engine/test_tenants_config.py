"""conf/tenants: the open default, the shipped keys example, and every bad value refused with its key path
before anything is loaded."""

from __future__ import annotations

import pytest

from litellm_pipeline.config.build import build_engine, to_plain
from litellm_pipeline.config.compose import compose
from litellm_pipeline.config.schema import validate_config
from litellm_pipeline.engine.fair_scheduler import FairScheduler
from litellm_pipeline.errors import ConfigError
from litellm_pipeline.server.auth import ApiKeys, digest

DIGEST = digest("sk-test")


@pytest.mark.parametrize(
    "overrides, expect",
    [
        (["tenants.acme.weight=0"], "tenants.acme.weight: must be > 0 (got 0)"),
        (["tenants.beta.requests_per_minute=-5"], "tenants.beta.requests_per_minute: must be > 0 (got -5)"),
        (["tenants.beta.max_concurrent=0"], "tenants.beta.max_concurrent: must be >= 1 (got 0)"),
        (["tenants.beta.max_queued=0"], "tenants.beta.max_queued: must be >= 1 (got 0)"),
        (["tenants.acme.spend_window_s=0"], "tenants.acme.spend_window_s: must be > 0 (got 0)"),
        (["+tenants.acme.api_key_sha256=[abc]"],
         "tenants.acme.api_key_sha256[0]: must be the SHA-256 hex digest of an API key (64 hex digits)"),
        (["tenants.acme.api_key_env='9LIVES'"], "tenants.acme.api_key_env: must be an environment variable name"),
        (["+tenants.acme.rpm=3"], "tenants.acme.rpm: unknown key"),
        ([f"+tenants.acme.api_key_sha256=['{DIGEST}']", f"+tenants.beta.api_key_sha256=['{DIGEST.upper()}']"],
         "tenants.beta.api_key_sha256[0]: the same key as tenants.acme.api_key_sha256[0]: a key must name one tenant"),
    ],
)
def test_bad_tenant_values_name_the_key(overrides, expect, tmp_path, monkeypatch):
    def must_not_load(*a, **k):
        raise AssertionError("the checkpoint was read before the config was checked")

    monkeypatch.setattr("litellm_pipeline.config.build.load_model_config", must_not_load)
    with pytest.raises(ConfigError) as err:
        build_engine(compose(["tenants=keys", f"model.path={tmp_path}", *overrides]))
    assert expect in str(err.value), str(err.value)


def test_an_empty_tenant_name_is_refused():
    cfg = to_plain(compose([]))
    cfg["tenants"] = {"": {"weight": 1}}
    with pytest.raises(ConfigError, match="tenants: a tenant name must not be empty"):
        validate_config(cfg)


def test_open_is_the_default_and_has_no_quota():
    cfg = compose(["+recipe=generate"])
    assert dict(cfg.tenants) == {}
    engine = build_engine(cfg)
    assert engine.rt.tenants is None


def test_the_keys_example_builds_quotas_and_fair_weights():
    engine = build_engine(compose(["+recipe=generate", "tenants=keys", "engine.scheduler=fair"]))
    ledger = engine.rt.tenants
    assert ledger is not None and ledger.weights == {"acme": 2.0, "beta": 1.0}
    assert ledger.level("beta", "requests_per_minute") == 60 and ledger.level("beta", "max_spend") == 1.0
    sched = engine.rt.scheduler
    assert isinstance(sched, FairScheduler) and sched.waiting.weight("acme") == 2.0
    assert sched.waiting.weight("someone-else") == 1.0


def test_serving_the_keys_example_needs_its_key_variables(monkeypatch):
    from litellm_pipeline.server.serve import serve

    app = validate_config(to_plain(compose(["+recipe=serve", "tenants=keys"])))
    monkeypatch.delenv("LITELLM_PIPELINE_KEY_ACME", raising=False)
    monkeypatch.setattr("litellm_pipeline.config.build.build_from_app", lambda *a: pytest.fail("the engine was built"))
    with pytest.raises(ConfigError, match="tenants.acme.api_key_env: the environment variable "
                                          "LITELLM_PIPELINE_KEY_ACME is not set"):
        serve(app)
    keys = ApiKeys.from_config(app.tenants, environ={"LITELLM_PIPELINE_KEY_ACME": "a-key",
                                                     "LITELLM_PIPELINE_KEY_BETA": "b-key"})
    assert (keys.tenant("a-key"), keys.tenant("b-key"), keys.tenant("c-key")) == ("acme", "beta", None)
