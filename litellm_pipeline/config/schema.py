"""The pydantic schema of the composed config: checked once when the pipeline is built.

A wrong type, an unknown key or a value out of range gives one line per problem naming the key path and
what is allowed (``cache.block_size: must be >= 1 (got 0)``), and nothing is built.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Mapping

import pydantic
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from litellm_pipeline.errors import (
    ConfigError,
    InvalidValueError,
    format_validation_error,
)
from litellm_pipeline.sampling import SamplingParams


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(_Section):
    path: str | None = None
    demo_seed: int = 0
    max_model_len: int | None = Field(default=None, ge=2)


class DeviceSection(_Section):
    type: Literal["auto", "cpu", "cuda"] = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    threads: int | None = Field(default=None, ge=1, le=1024)
    # CUDA devices: replay captured graphs for decode-only steps (litellm_pipeline/model/cuda_graphs.py)
    cuda_graphs: bool = True
    # CPU: the weights in transparent huge pages where the kernel offers them (litellm_pipeline/model/weight_arena.py)
    huge_pages: bool = True
    # opt-in: the model's forward through torch.compile (dynamic shapes; the first steps of each shape compile)
    compile: bool = False
    # the most the model's weights may take on one rank, GiB (null: no limit); past it the build says to split wider
    memory_gb: float | None = Field(default=None, gt=0)


class StageSection(_Section):
    impl: str
    params: dict[str, Any] = {}


class PipelineSection(_Section):
    order: list[str] = Field(min_length=1)
    stages: dict[str, StageSection]

    @model_validator(mode="after")
    def _order_names_declared_stages(self) -> "PipelineSection":
        missing = [s for s in self.order if s not in self.stages]
        if missing:
            raise ValueError(
                f"order lists {missing} but only these stages are declared: {', '.join(self.stages)}"
            )
        unused = [s for s in self.stages if s not in self.order]
        if unused:
            raise ValueError(f"stages {unused} are declared but not in pipeline.order: add them to the order")
        dup = sorted({s for s in self.order if self.order.count(s) > 1})
        if dup:
            raise ValueError(f"order lists {dup} more than once")
        return self


def _valid_count(k: Any) -> bool:
    return (isinstance(k, int) and not isinstance(k, bool) and k >= 1) or k in ("native", "all") or (
        isinstance(k, str) and k.endswith("x") and k[:-1].isdigit() and int(k[:-1]) >= 1
    )


class PriceSection(_Section):
    """Monetary units per 1,000 tokens."""

    prompt_1k: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    output_1k: float = Field(default=0.0, ge=0, allow_inf_nan=False)


class TierSection(_Section):
    # one count for every layer, or a list with one per decoder layer
    experts_per_token: int | str | list[int | str] = "native"
    cost: float = Field(default=1.0, ge=0)
    allowed_experts: list[int] | None = None
    price: PriceSection = PriceSection()

    @model_validator(mode="after")
    def _valid_count(self) -> "TierSection":
        k = self.experts_per_token
        ks = k if isinstance(k, list) else [k]
        bad = [x for x in ks if not _valid_count(x)]
        if bad or not ks:
            raise ValueError(
                f"experts_per_token must be an int >= 1, 'native', '<n>x', 'all' or a per-layer list of those "
                f"(got {k!r})"
            )
        return self


class WeightsSection(_Section):
    quality: float = Field(default=1.0, ge=0, allow_inf_nan=False)
    latency: float = Field(default=0.1, ge=0, allow_inf_nan=False)
    monetary: float = Field(default=0.1, ge=0, allow_inf_nan=False)


class AnalyticSection(_Section):
    flops_per_s: float = Field(default=5e10, gt=0, allow_inf_nan=False)
    bytes_per_s: float = Field(default=1e10, gt=0, allow_inf_nan=False)


_Limit = Field(default=None, gt=0, allow_inf_nan=False)


class BudgetSection(_Section):
    """How budgets are solved (conf/budget), and the budget of requests that bring none."""

    solver: str = "exact"  # registry kind "budget_solver"
    on_infeasible: Literal["reject", "cheapest"] = "reject"
    profile: str | None = None  # a +recipe=calibrate profile; null: the analytic estimate
    choices: list[int] | None = None  # expert counts a layer may take; null: those of the configured tiers
    weights: WeightsSection = WeightsSection()
    analytic: AnalyticSection = AnalyticSection()
    latency_headroom: float = Field(default=0.2, ge=0, lt=1)  # share of a latency budget not planned with
    latency_cost_ms: float | None = _Limit
    latency_per_token_ms: float | None = _Limit
    monetary_cost_units: float | None = _Limit

    @model_validator(mode="after")
    def _positive_choices(self) -> "BudgetSection":
        if self.choices is not None and (not self.choices or min(self.choices) < 1):
            raise ValueError(f"choices must list expert counts >= 1 (got {self.choices})")
        return self


class EngineSection(_Section):
    max_num_seqs: int = Field(default=64, ge=1)
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    scheduler: str = "fcfs"
    preemption: Literal["recompute", "swap"] = "recompute"
    # batch-invariant mode: a request's tokens and logprobs are bit-identical whatever shares its steps
    deterministic: bool = False


class CacheSection(_Section):
    block_size: int = Field(default=16, ge=1, le=1024)
    dtype: str | None = None  # the K/V's dtype (null: device.dtype); float16 / bfloat16 under float32 weights
    num_blocks: int | None = Field(default=None, ge=1)
    memory_gb: float = Field(default=2.0, gt=0)
    enable_prefix_caching: bool = True
    kv_policy: str = "lru"
    warm_blocks: int | None = Field(default=None, ge=0)
    warm_memory_gb: float = Field(default=0.0, ge=0)
    session_ttl_s: float = Field(default=600.0, gt=0)
    max_sessions: int = Field(default=64, ge=0)


class StructuredOutputSection(_Section):
    # conf/structured_output: litellm_pipeline.constraints.ConstraintSettings
    any_whitespace: bool = False
    max_spec_bytes: int = Field(default=65536, ge=64)
    compile_timeout_s: float = Field(default=10.0, gt=0)
    compile_threads: int = Field(default=2, ge=1, le=64)
    cache_entries: int = Field(default=256, ge=1)


class SpeculativeSection(_Section):
    # conf/speculative: litellm_pipeline.speculative.SpeculativeSettings, the proposer's name and arguments
    method: str = "none"  # registry kind "proposer", or none
    k: int = Field(default=4, ge=1, le=16)
    adaptive: bool = True
    disable_by_batch_size: int | None = Field(default=2, ge=1)
    model: str | None = None  # the draft proposer's checkpoint
    params: dict[str, Any] = {}


class ParallelSection(_Section):
    # conf/parallel: tensor / expert parallelism over torch.distributed (litellm_pipeline/parallel)
    tensor: int = Field(default=1, ge=1, le=256)
    expert: int = Field(default=1, ge=1, le=256)
    backend: Literal["auto", "gloo", "nccl"] = "auto"  # auto: nccl on CUDA, gloo on CPU
    master_addr: str = Field(default="127.0.0.1", min_length=1)  # the workers started here: the driver's address
    master_port: int | None = Field(default=None, ge=1, le=65535)  # null: a free port
    timeout_s: float = Field(default=120.0, gt=0)  # a rank that does not answer a collective this long is hung
    start_timeout_s: float = Field(default=600.0, gt=0)  # the workers' start (loading their shards)


class MoESection(_Section):
    # expert offload: experts per MoE layer kept in device memory (null: all); the rest stay in host memory
    hot_experts: int | None = Field(default=None, ge=1)
    # predict the next layer's experts from router scores and copy them while the current layer runs
    prefetch: bool = True


class TelemetrySection(_Section):
    sinks: list[str] = ["none"]  # registry kind "telemetry"
    params: dict[str, dict[str, Any]] = {}  # per sink name: its constructor parameters

    @model_validator(mode="after")
    def _params_name_sinks(self) -> "TelemetrySection":
        extra = [k for k in self.params if k not in self.sinks]
        if extra:
            raise ValueError(f"params given for {extra}, which are not in sinks {self.sinks}")
        return self


class ServerSection(_Section):
    """The HTTP server of ``+recipe=serve`` (conf/server)."""

    host: str = Field(default="127.0.0.1", min_length=1)
    port: int = Field(default=8000, ge=0, le=65535)  # 0: any free port
    served_model_name: str | None = Field(default=None, min_length=1)  # None: the checkpoint folder's name
    owned_by: str = "litellm_pipeline"
    drain_timeout_s: float = Field(default=30.0, ge=0, allow_inf_nan=False)
    max_n: int = Field(default=8, ge=1, le=256)
    max_prompts: int = Field(default=64, ge=1, le=4096)
    max_body_bytes: int = Field(default=1_048_576, ge=1024)
    max_header_bytes: int = Field(default=16_384, ge=1024)
    log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = "info"
    # the interpreter's thread switch interval while serving (sys.setswitchinterval); None: Python's own (5 ms)
    switch_interval_ms: float | None = Field(default=1.0, gt=0, le=100, allow_inf_nan=False)


def _plugin_name(v: str) -> str:
    if not v.strip():
        raise ValueError("must be a plugin name: an entry point or distribution name (wildcards allowed), not blank")
    return v.strip()


_PluginName = Annotated[str, AfterValidator(_plugin_name)]


class PluginsSection(_Section):
    """Which third-party plugins (entry points) may load (conf/plugins; see litellm_pipeline.registry.filter).

    Names: an entry point's name (``example_plugin``; per-kind entries also ``<kind>:<name>``) or a
    distribution's name, with shell-style wildcards. ``allow`` null: every installed plugin; a list: only those.
    ``deny`` wins over ``allow``. Built-ins always load. ``LITELLM_PIPELINE_PLUGINS_ALLOW`` / ``_DENY``
    (comma-separated) narrow this further.
    """

    allow: list[_PluginName] | None = None
    deny: list[_PluginName] = []


_DIGEST = re.compile(r"^[0-9a-f]{64}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _key_digest(v: str) -> str:
    v = v.strip().lower()
    if not _DIGEST.match(v):
        raise ValueError(
            "must be the SHA-256 hex digest of an API key (64 hex digits), e.g. from "
            "python -c \"import hashlib; print(hashlib.sha256(b'KEY').hexdigest())\"")
    return v


def _env_name(v: str | None) -> str | None:
    if v is not None and not _ENV_NAME.match(v):
        raise ValueError("must be an environment variable name (letters, digits and _, not starting with a digit)")
    return v


_Quota = Field(default=None, gt=0, allow_inf_nan=False)


class TenantSection(_Section):
    """One tenant of conf/tenants: its API keys (read by the server), fair-share weight and quotas (null: none)."""

    api_key_sha256: list[Annotated[str, AfterValidator(_key_digest)]] = []  # SHA-256 hex digests of its keys
    api_key_env: Annotated[str | None, AfterValidator(_env_name)] = None  # an env var holding one key
    weight: float = Field(default=1.0, gt=0, allow_inf_nan=False)  # share of batch admissions (fair scheduler)
    requests_per_minute: float | None = _Quota
    tokens_per_minute: float | None = _Quota  # prompt + max_tokens, reserved at admission
    max_concurrent: int | None = Field(default=None, ge=1)  # requests in flight (queued or running)
    max_queued: int | None = Field(default=None, ge=1)  # requests waiting for a batch slot
    max_spend: float | None = _Quota  # monetary units (tier prices) per spend_window_s
    spend_window_s: float = Field(default=3600.0, gt=0, allow_inf_nan=False)
    # shares of the hot KV pool (blocks its running requests hold): at most max_kv_fraction; min_kv_fraction is
    # guaranteed (a tenant within it is never preempted for one above its own, and reclaims blocks to start)
    max_kv_fraction: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    min_kv_fraction: float | None = Field(default=None, ge=0, le=1, allow_inf_nan=False)

    @model_validator(mode="after")
    def _shares(self) -> "TenantSection":
        if self.min_kv_fraction is not None and self.max_kv_fraction is not None \
                and self.min_kv_fraction > self.max_kv_fraction:
            raise ValueError(f"min_kv_fraction ({self.min_kv_fraction}) must not exceed max_kv_fraction "
                             f"({self.max_kv_fraction})")
        return self


def check_tenants(tenants: Mapping[str, TenantSection]) -> None:
    """What one tenant's schema cannot see: names and keys across tenants (ConfigError naming the key path)."""
    if "" in tenants:
        raise ConfigError("invalid config:\ntenants: a tenant name must not be empty ('' is the default tenant)")
    guaranteed = {name: t.min_kv_fraction for name, t in tenants.items() if t.min_kv_fraction}
    if sum(guaranteed.values()) > 1.0 + 1e-9:
        raise ConfigError("invalid config:\ntenants: the min_kv_fraction guarantees add up to more than the whole "
                          f"KV pool ({' + '.join(f'{n} {v}' for n, v in guaranteed.items())} > 1)")
    owner: dict[str, str] = {}
    for name, t in tenants.items():
        for i, digest in enumerate(t.api_key_sha256):
            if digest in owner:
                raise ConfigError(f"invalid config:\ntenants.{name}.api_key_sha256[{i}]: the same key as "
                                  f"{owner[digest]}: a key must name one tenant")
            owner[digest] = f"tenants.{name}.api_key_sha256[{i}]"


class AppConfig(_Section):
    task: str | None = None
    prompt: str | None = None
    chat: bool = False
    seed: int = 0
    model: ModelSection = ModelSection()
    device: DeviceSection = DeviceSection()
    pipeline: PipelineSection
    tiers: dict[str, TierSection] = {}
    sampling: dict[str, Any] = {}
    engine: EngineSection = EngineSection()
    budget: BudgetSection = BudgetSection()
    cache: CacheSection = CacheSection()
    moe: MoESection = MoESection()
    telemetry: TelemetrySection = TelemetrySection()
    server: ServerSection = ServerSection()
    plugins: PluginsSection = PluginsSection()
    structured_output: StructuredOutputSection = StructuredOutputSection()
    speculative: SpeculativeSection = SpeculativeSection()
    parallel: ParallelSection = ParallelSection()
    # conf/tenants: name -> tenant; empty = the open single-tenant mode (no API key, no quota)
    tenants: dict[str, TenantSection] = {}
    # task-specific sections: validated by the task that reads them
    bench: dict[str, Any] | None = None
    train: dict[str, Any] | None = None
    eval: dict[str, Any] | None = None
    faults: dict[str, Any] | None = None
    calibrate: dict[str, Any] | None = None
    sweep: dict[str, Any] | None = None
    report: dict[str, Any] | None = None
    budget_load: dict[str, Any] | None = None
    loadtest: dict[str, Any] | None = None
    plugin: dict[str, Any] | None = None  # +recipe=new_plugin (litellm_pipeline.tasks.new_plugin)

    def sampling_params(self) -> SamplingParams:
        try:
            return SamplingParams(**self.sampling)
        except InvalidValueError as exc:
            raise ConfigError(format_validation_error(exc.validation_error, "sampling")) from exc


def validate_config(cfg: Mapping[str, Any]) -> AppConfig:
    """Validate a composed config (a plain dict: resolve a DictConfig with ``OmegaConf.to_container`` first)."""
    try:
        app = AppConfig.model_validate(dict(cfg))
    except pydantic.ValidationError as exc:
        raise ConfigError("invalid config:\n" + format_validation_error(exc)) from exc
    app.sampling_params()  # fail now, not at the first request
    check_tenants(app.tenants)
    return app
