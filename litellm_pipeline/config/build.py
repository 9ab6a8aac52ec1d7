"""Builder: composed config -> validated schema -> plain objects -> Engine. Config stops here.

Everything that can be checked without weights (schema, stage names, stage parameters, the stage graph's
data flow, tiers against the checkpoint's config.json) is checked before a single weight is read.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
from typing import Any, Mapping

import torch
from omegaconf import DictConfig, OmegaConf

from litellm_pipeline import registry
from litellm_pipeline.budget import BudgetSpec
from litellm_pipeline.budget.selector import BudgetPolicy, Weights
from litellm_pipeline.config.schema import AppConfig, PipelineSection, validate_config
from litellm_pipeline.constraints import ConstraintCompiler, ConstraintSettings
from litellm_pipeline.constraints.grammar import Grammars
from litellm_pipeline.demo import demo_checkpoint
from litellm_pipeline.engine.block_pool import BlockPool
from litellm_pipeline.engine.engine import Engine
from litellm_pipeline.engine.kv_cache_manager import KVCacheManager, WarmPool
from litellm_pipeline.engine.runtime import (
    Runtime,
    allocate_kv_cache,
    kv_bytes_per_block,
)
from litellm_pipeline.engine.tenants import TenantLedger, TenantPolicy
from litellm_pipeline.errors import ConfigError
from litellm_pipeline.model.attention import kv_cache_supported
from litellm_pipeline.model.config import ModelConfig
from litellm_pipeline.model.expert_offload import ExpertOffload
from litellm_pipeline.model.decoder import CausalLM
from litellm_pipeline.model.loader import load_model, load_model_config
from litellm_pipeline.parallel.workers import Member, local_world, start_driver, threads_per_rank
from litellm_pipeline.speculative import SpeculativeSettings, Speculator
from litellm_pipeline.telemetry import build_bus
from litellm_pipeline.text.tokenizer import Tokenizer
from litellm_pipeline.tiers import resolve_tiers
from litellm_pipeline.tiers.cost_model import CostModel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# what the engine provides before any stage runs, per level, and what it reads after the step stages
REQUEST_SEED = ("request",)
STEP_SEED = ("schedule", "kv_layout")
STEP_RESULT = "samples"


def to_plain(cfg: DictConfig | Mapping[str, Any]) -> dict:
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    return dict(cfg)


def resolve_device(kind: str) -> torch.device:
    if kind == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device.type: 'cuda' was asked for but no CUDA device is available (allowed: auto, cpu)")
    return torch.device(kind)


def resolve_max_model_len(mc: ModelConfig, asked: int | None) -> int:
    """The context the engine serves: the checkpoint's, stretched by linear/dynamic RoPE scaling."""
    limit = mc.max_position_embeddings
    if mc.rope.get("rope_type") in ("linear", "dynamic"):
        limit = int(limit * float(mc.rope.get("factor", 1.0)))
    if asked is None:
        return limit
    if asked > limit:
        raise ConfigError(
            f"model.max_model_len: {asked} exceeds the checkpoint's context of {limit} tokens "
            f"(max_position_embeddings {mc.max_position_embeddings}, rope {mc.rope.get('rope_type')})"
        )
    return asked


def free_memory_bytes(device: torch.device) -> int | None:
    """Memory an allocation can still get on ``device`` (None where it cannot be read)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_fits(key: str, num_blocks: int, block_bytes: int, device: torch.device) -> None:
    """Refuse a KV cache larger than the free memory of its device, before trying to allocate it."""
    need = num_blocks * block_bytes
    free = free_memory_bytes(device)
    if free is not None and need > free:
        raise ConfigError(
            f"{key}: {num_blocks} blocks of {block_bytes / 2**20:.2f} MiB need {need / 2**30:.1f} GiB but "
            f"{device.type} memory has {free / 2**30:.1f} GiB free; lower {key} (or leave it null and set "
            "cache.memory_gb)"
        )


def stage_classes(pipeline: PipelineSection) -> list[tuple[str, type, dict]]:
    """Look up every stage implementation, check its parameters and the graph's data flow."""
    found = []
    for name in pipeline.order:
        spec = pipeline.stages[name]
        try:
            cls = registry.get("stage", spec.impl)
        except registry.RegistryError as exc:
            raise ConfigError(f"pipeline.stages.{name}.impl: {exc}") from exc
        try:
            inspect.signature(cls).bind(None, **spec.params)
        except TypeError as exc:
            raise ConfigError(f"pipeline.stages.{name}.params: {exc} (got {spec.params})") from exc
        found.append((name, cls, spec.params))
    check_graph([(n, c) for n, c, _ in found])
    return found


def check_graph(stages: list[tuple[str, type]]) -> None:
    """Request-level stages come first; every stage's inputs are produced upstream of it."""
    produced = set(REQUEST_SEED)
    seen_step = False
    for name, cls in stages:
        level = getattr(cls, "level", None)
        if level not in ("request", "step"):
            raise ConfigError(f"pipeline stage {name!r}: level must be 'request' or 'step' (got {level!r})")
        if level == "step" and not seen_step:
            seen_step = True
            produced |= set(STEP_SEED)
        elif level == "request" and seen_step:
            raise ConfigError(f"pipeline stage {name!r} is request-level but comes after a step-level stage")
        missing = [i for i in cls.inputs if i not in produced]
        if missing:
            raise ConfigError(
                f"pipeline stage {name!r} needs {missing}, which no stage before it produces "
                f"(available at that point: {sorted(produced)})"
            )
        produced |= set(cls.outputs)
    for i, (name, cls) in enumerate(stages):  # an optional input produced only downstream would go unseen
        for field in getattr(cls, "optional_inputs", ()):
            later = [n for n, c in stages[i + 1:] if field in c.outputs]
            earlier = [n for n, c in stages[:i] if field in c.outputs]
            if later and not earlier:
                raise ConfigError(
                    f"pipeline stage {later[0]!r} produces {field!r}, which stage {name!r} reads before it: "
                    f"place {later[0]!r} before {name!r}"
                )
    if STEP_RESULT not in produced:
        raise ConfigError(
            f"pipeline: no stage produces {STEP_RESULT!r} (the sample stage), so the engine would have no tokens "
            "to append"
        )


def _lookup(kind: str, name: str, key: str) -> Any:
    try:
        return registry.get(kind, name)
    except registry.RegistryError as exc:
        raise ConfigError(f"{key}: {exc}") from exc


def build_cost_model(app: AppConfig, mc: ModelConfig, tiers: dict) -> CostModel:
    """The measured profile named by ``budget.profile``, else the analytic estimate."""
    b = app.budget
    if b.choices is not None and mc.is_moe:
        bad = [k for k in b.choices if k > mc.num_experts]
        if bad:
            raise ConfigError(f"budget.choices: {bad} exceed the model's {mc.num_experts} experts")
    if b.profile is not None:
        return CostModel.from_profile(b.profile, mc, tiers)
    return CostModel.analytic(mc, tiers, b.choices, b.analytic.flops_per_s, b.analytic.bytes_per_s,
                              torch.finfo(DTYPES[app.device.dtype]).bits // 8)


def budget_policy(app: AppConfig) -> BudgetPolicy:
    b = app.budget
    limits = {k: getattr(b, k) for k in ("latency_cost_ms", "latency_per_token_ms", "monetary_cost_units")}
    default = BudgetSpec(**limits) if any(v is not None for v in limits.values()) else None
    w = b.weights
    return BudgetPolicy(b.solver, b.on_infeasible, Weights(w.quality, w.latency, w.monetary), default,
                        b.latency_headroom)


def tenant_policies(app: AppConfig) -> dict[str, TenantPolicy]:
    """conf/tenants as plain policies (the API keys stay with the server, which alone authenticates)."""
    return {name: TenantPolicy(name, **t.model_dump(exclude={"api_key_sha256", "api_key_env"}))
            for name, t in app.tenants.items()}


def _takes_var_kwargs(cls: Any) -> bool:
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(cls).parameters.values())


def build_engine(cfg: DictConfig | Mapping[str, Any]) -> Engine:
    app = validate_config(to_plain(cfg))
    return build_from_app(app)


def _expert_device(moe, mc: ModelConfig, device: torch.device) -> torch.device | None:
    """Where the expert weights are loaded: host memory under expert offload, so they never fill the device."""
    if moe.hot_experts is None:
        return None
    if not mc.is_moe:
        raise ConfigError("moe.hot_experts: the model is dense (no MoE layers to offload)")
    if moe.hot_experts > mc.num_experts:
        raise ConfigError(f"moe.hot_experts: must be in 1..{mc.num_experts}, the model's experts per layer "
                          f"(got {moe.hot_experts})")
    return torch.device("cpu")


def build_from_app(app: AppConfig, member: Member | None = None) -> Engine:
    """The engine of ``app``. Under tensor / expert parallelism (``parallel``) this process is rank 0 (it starts or
    joins the workers) unless ``member`` says which worker it is; a worker's engine only serves its model shard."""
    # before the first lookup: which plugins may load is part of this config
    registry.set_plugin_filter(app.plugins.allow, app.plugins.deny)
    classes = stage_classes(app.pipeline)
    sched_cls = _lookup("scheduler", app.engine.scheduler, "engine.scheduler")
    policy_cls = _lookup("kv_policy", app.cache.kv_policy, "cache.kv_policy")
    sinks = [(name, _lookup("telemetry", name, f"telemetry.sinks[{i}]")) for i, name in enumerate(app.telemetry.sinks)]
    device = resolve_device(app.device.type)
    dtype = DTYPES[app.device.dtype]
    if app.device.threads:
        torch.set_num_threads(app.device.threads)
    path = app.model.path or demo_checkpoint()
    mc = load_model_config(path)
    if member is None and max(app.parallel.tensor, app.parallel.expert) > 1:
        check_parallel(app)
        member = start_driver(app, mc, device)
    try:
        return _build(app, mc, path, device, dtype, classes, sched_cls, policy_cls, sinks, member)
    except BaseException:
        if member is not None and member.driver is not None:
            member.driver.close()
        raise


def kv_cache_dtype(app: AppConfig, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """``cache.dtype``: the KV cache's dtype (null: the model's). A narrower cache under float32 weights halves the
    bytes each decode step reads per cached token (what llama.cpp's default F16 cache does); attention still
    computes in float32 on the rounded K/V."""
    name = app.cache.dtype
    if name is None:
        return dtype
    if name not in DTYPES:
        raise ConfigError(f"cache.dtype: {name!r} is not one of {sorted(DTYPES)} (or null: the model's dtype)")
    kv = DTYPES[name]
    if kv == dtype:
        return kv
    if device.type != "cpu":
        raise ConfigError(f"cache.dtype={name}: a KV cache of another dtype than device.dtype={app.device.dtype} "
                          f"runs on the CPU kernels only (device {device.type})")
    if not kv_cache_supported(dtype, kv):
        raise ConfigError(f"cache.dtype={name} under device.dtype={app.device.dtype}: the cache holds the model's "
                          "dtype, or float16 / bfloat16 under float32 weights")
    return kv


def check_parallel(app: AppConfig) -> None:
    """What tensor / expert parallelism does not combine with (said before any worker starts)."""
    if app.device.compile:
        raise ConfigError("device.compile: not with parallel.tensor / parallel.expert > 1 (the forward holds "
                          "collectives)")
    if app.moe.hot_experts is not None:
        raise ConfigError("moe.hot_experts: expert offload is not supported with parallel.tensor / parallel.expert "
                          "> 1 (spread the experts with parallel.expert instead)")


def _build(app: AppConfig, mc: ModelConfig, path, device: torch.device, dtype: torch.dtype, classes, sched_cls,
           policy_cls, sinks, member: Member | None) -> Engine:
    shard = member.shard if member is not None else None
    if member is not None:
        device = member.device  # a GPU rank's own GPU
    worker = member is not None and member.driver is None
    if member is not None and app.device.type == "cpu" and not app.device.threads:
        torch.set_num_threads(threads_per_rank(app, local_world(member.comm.world)))
    if worker:
        sinks = []  # the driver alone counts and reports
    kv_heads = shard.local_kv_heads(mc) if shard is not None else None
    kv_dtype = kv_cache_dtype(app, dtype, device)
    tiers = resolve_tiers(app.tiers, mc)
    _lookup("budget_solver", app.budget.solver, "budget.solver")
    cost_model = build_cost_model(app, mc, tiers)
    tokenizer = Tokenizer.from_dir(path)
    if tokenizer.vocab_size > mc.vocab_size:
        raise ConfigError(f"{path}: tokenizer has {tokenizer.vocab_size} tokens but the model only {mc.vocab_size}")
    max_len = resolve_max_model_len(mc, app.model.max_model_len)
    check_weights_fit(app, mc, dtype, shard)
    model = load_model(
        path,
        dtype=dtype,
        device=device,
        cfg=mc,
        attn_fn=registry.get("attention", "sdpa"),
        dispatch_fn=registry.get("moe_dispatch", "packed"),
        expert_device=_expert_device(app.moe, mc, device),
        shard=shard,
        comm=member.comm if member is not None else None,
    )
    model.rotary.reserve(max_len)
    if app.moe.hot_experts is not None:
        try:
            ExpertOffload(model, app.moe.hot_experts, prefetch=app.moe.prefetch)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
    bs = app.cache.block_size
    num_blocks = app.cache.num_blocks
    if num_blocks is None:
        wanted = app.engine.max_num_seqs * math.ceil(max_len / bs)
        affordable = int(app.cache.memory_gb * 2**30 // kv_bytes_per_block(mc, bs, kv_dtype, kv_heads))
        num_blocks = max(1, min(wanted, affordable))
    try:
        bus = build_bus([(name, app.telemetry.params.get(name, {})) for name, _ in sinks])
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"telemetry.params: {exc}") from exc
    block_bytes = kv_bytes_per_block(mc, bs, kv_dtype, kv_heads)
    warm_blocks = app.cache.warm_blocks
    if warm_blocks is None:
        warm_blocks = int(app.cache.warm_memory_gb * 2**30 // block_bytes)
    check_fits("cache.num_blocks", num_blocks, block_bytes, device)
    check_fits("cache.warm_blocks", warm_blocks, block_bytes, torch.device("cpu"))
    pool = BlockPool(num_blocks, policy=policy_cls())
    # one spare block past the pool's: the scratch slots padding rows of a CUDA-graph decode step write to
    hot_kv = allocate_kv_cache(mc, num_blocks + 1, bs, kv_dtype, device, kv_heads=kv_heads)
    warm = None
    if warm_blocks > 0:
        warm_kv = allocate_kv_cache(mc, warm_blocks, bs, kv_dtype, torch.device("cpu"), pin=device.type == "cuda",
                                    kv_heads=kv_heads)
        warm = WarmPool(BlockPool(warm_blocks, policy=policy_cls()), warm_kv, bs)
    kv = KVCacheManager(
        pool,
        hot_kv,
        bs,
        warm,
        prefix_caching=app.cache.enable_prefix_caching,
        session_ttl_s=app.cache.session_ttl_s,
        max_sessions=app.cache.max_sessions,
        bus=bus,
    )
    policies = tenant_policies(app)
    sched_kwargs = {}
    if "weights" in inspect.signature(sched_cls).parameters:  # a fair-share scheduler: the tenants' weights
        sched_kwargs["weights"] = {name: p.weight for name, p in policies.items()}
    shares = {name: (p.max_kv_fraction, p.min_kv_fraction) for name, p in policies.items()
              if p.max_kv_fraction is not None or p.min_kv_fraction is not None}
    if shares:
        if "kv_shares" not in inspect.signature(sched_cls).parameters and not _takes_var_kwargs(sched_cls):
            raise ConfigError(
                f"invalid config:\ntenants: max_kv_fraction / min_kv_fraction ({', '.join(shares)}) need a scheduler "
                f"that keeps KV shares, but engine.scheduler={app.engine.scheduler!r} takes no kv_shares")
        sched_kwargs["kv_shares"] = shares
    scheduler = sched_cls(
        kv, app.engine.max_num_seqs, app.engine.max_num_batched_tokens, app.engine.preemption, bus=bus,
        **sched_kwargs,
    )
    rt = Runtime(
        model=model,
        model_cfg=mc,
        tokenizer=tokenizer,
        kv_caches=hot_kv,
        pool=pool,
        kv=kv,
        scheduler=scheduler,
        block_size=bs,
        max_model_len=max_len,
        tiers=tiers,
        device=device,
        eos_token_ids=frozenset(tokenizer.eos_token_ids) | frozenset(mc.eos_token_ids),
        seed=app.seed,
        bus=bus,
        cost_model=cost_model,
        budget=budget_policy(app),
        deterministic=app.engine.deterministic,
        tenants=TenantLedger(policies) if policies else None,
        parallel=member,
        # captured graphs would replay without the workers: a parallel engine's steps run eagerly
        cuda_graphs=app.device.cuda_graphs and device.type == "cuda" and member is None,
        huge_pages=app.device.huge_pages and device.type == "cpu",
    )
    rt.constraints = ConstraintCompiler(
        functools.partial(Grammars, tokenizer, mc.vocab_size, rt.eos_token_ids, app.structured_output.any_whitespace),
        ConstraintSettings(**app.structured_output.model_dump()),
    )
    request_stages, step_stages = [], []
    for name, cls, params in classes:
        try:
            stage = cls(rt, **params)
        except (TypeError, ValueError, registry.RegistryError) as exc:
            raise ConfigError(_stage_param_error(name, params, str(exc))) from exc
        (request_stages if cls.level == "request" else step_stages).append(stage)
    # a stage that can hand each logits row's argmax on (decode: its fused kernels find it as they write the
    # logits) does so only where the stage right after it reads it, so no stage between them changed the logits
    for stage, after in zip(step_stages, step_stages[1:]):
        reads = type(after).inputs + getattr(type(after), "optional_inputs", ())
        if "logits_argmax" in type(stage).outputs and "logits_argmax" in reads:
            stage.argmax = True
    if worker:
        return Engine(rt, request_stages, step_stages)
    rt.speculator = build_speculator(app, rt)  # after the decode stage bound the model's layers
    if app.device.compile:  # after the stages bound their implementations into the model
        model.forward = torch.compile(model.forward, dynamic=True)
    if member is not None:  # the driver: every model call and KV copy goes to the workers too
        driver = member.driver
        driver.hot_kv, driver.tensor_parallel = hot_kv, shard.tensor > 1
        model.mirror = driver
        if warm is not None:
            warm.mirror = driver.copy_blocks
        driver.wait_ready()
    return Engine(rt, request_stages, step_stages)


def check_weights_fit(app: AppConfig, mc: ModelConfig, dtype: torch.dtype, shard) -> None:
    """``device.memory_gb``: the most the model's weights may take on one rank (this rank's shard of them)."""
    limit = app.device.memory_gb
    if limit is None:
        return
    with torch.device("meta"):
        meta = CausalLM(mc, registry.get("attention", "sdpa"), registry.get("moe_dispatch", "packed"), shard=shard)
    need = sum(p.numel() for p in meta.parameters()) * torch.finfo(dtype).bits // 8
    if need > limit * 2**30:
        ways = f" ({shard.world} ranks)" if shard is not None and shard.parallel else ""
        raise ConfigError(f"device.memory_gb={limit:g}: the model's weights take {need / 2**30:.3g} GiB per rank"
                          f"{ways}; raise it or split the model wider (parallel.tensor / parallel.expert)")


def build_speculator(app: AppConfig, rt: Runtime) -> Speculator | None:
    s = app.speculative
    if s.method == "none":
        return None
    cls = _lookup("proposer", s.method, "speculative.method")
    params = dict(s.params)
    if s.model is not None:
        params["model"] = s.model
    try:
        proposer = cls(rt, **params)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"speculative ({s.method}): {exc}") from exc
    settings = SpeculativeSettings(s.method, s.k, s.adaptive, s.disable_by_batch_size)
    return Speculator(proposer, settings, rt.max_model_len, rt.bus)


def _stage_param_error(stage: str, params: dict, msg: str) -> str:
    """A stage constructor's error with the key path of what it refused: kept where the message names it already,
    else the parameter whose value an unknown-name error quotes (``unknown sampler 'x'``: ``...params.sampler``)."""
    prefix = f"pipeline.stages.{stage}.params"
    if msg.startswith(prefix):
        return msg
    key = next((k for k, v in params.items() if isinstance(v, str) and repr(v) in msg), None)
    return f"{prefix}.{key}: {msg}" if key is not None else f"{prefix}: {msg}"
