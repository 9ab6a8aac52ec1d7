"""The ``bench:`` config section, validated by the bench itself (the app schema only passes it through)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from litellm_pipeline.errors import section_settings


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RooflineSettings(_Section):
    bandwidth_mb: int = Field(default=1024, ge=1)  # size of the tensor read for the bandwidth measurement
    gemm_size: int = Field(default=2048, ge=16)  # n of the n x n x n matmuls
    repeats: int = Field(default=5, ge=1)  # best of N


class BenchSettings(_Section):
    models: list[str | dict[str, Any]] = Field(default=["llama125m", "mixtral175m"], min_length=1)
    # precisions: a float dtype (weights and activations), int8 (layer_ops cpu_int8: int8 projection weights,
    # activations in int8_activations, the LM head int8 too when int8_lm_head) or int4 (layer_ops cpu_int4: 4-bit
    # projection weights in groups of int4_group_size, symmetric with float16 scales as llama.cpp's Q4_0)
    dtypes: list[Literal["float32", "bfloat16", "float16", "int8", "int4"]] = Field(
        default=["float32", "bfloat16"], min_length=1)
    int8_activations: Literal["float32", "bfloat16", "float16"] = "float32"
    int8_lm_head: bool = True
    # int8: prefill and large batches quantize activations per token for the int8 x int8 GEMM; float: exact ones
    int8_dot: Literal["float", "int8"] = "float"
    int4_activations: Literal["float32", "bfloat16", "float16"] = "float32"
    int4_lm_head: bool = True
    int4_group_size: int = Field(default=32, ge=32, multiple_of=32)
    # int8: activations quantized per 32 for integer dot products (llama.cpp's Q4_0 x Q8_0); float: exact ones
    int4_dot: Literal["int8", "float"] = "int8"
    num_requests: int = Field(default=64, ge=1)
    prompt_len: tuple[int, int] = (16, 512)  # uniform, inclusive
    output_len: tuple[int, int] = (16, 256)
    seed: int = 0
    model_seed: int = 0  # seed of the random weights
    peer: bool = True  # also measure transformers.generate
    # also measure llama.cpp on the same checkpoint as GGUF (needs llama-cpp-python and gguf; bench/llamacpp.py)
    llamacpp: bool = False
    # llama.cpp's llama-server on the same GGUF (mixed load all at once with continuous batching, and batch-1):
    # the path of a llama-server binary or a command on PATH; None: not measured
    llamacpp_server: str | None = None
    llamacpp_server_slots: int = Field(default=8, ge=1)
    peer_batch_size: int = Field(default=8, ge=1)
    peer_single_max_requests: int | None = Field(default=None, ge=1)  # one-at-a-time: first N requests (null: all)
    prefix_len: int = Field(default=1024, ge=0)  # 0: skip the prefix-hit measurement
    prefix_suffix_len: int = Field(default=16, ge=1)
    batch1_prompt_len: int = Field(default=32, ge=1)
    batch1_output_len: int = Field(default=128, ge=2)
    batch1_repeats: int = Field(default=3, ge=1)  # rounds of batch-1 decode (engine and llama.cpp peers), best of each
    warmup: int = Field(default=2, ge=0)  # small untimed requests before each timed part
    roofline: RooflineSettings = RooflineSettings()
    engine: dict[str, Any] = {}  # extra config overrides for the engine under test, dotted keys
    # also run the workload and batch-1 decode with engine.deterministic=true and report its cost
    deterministic: bool = False
    # MoE models: batch-1 decode again with moe.hot_experts = each value (expert offload): hit rate, misses per
    # token and the decode cost of a miss against the all-resident run
    offload: list[int] = []
    # structured output: masking overhead (a JSON schema vs free decoding, same tokens) at each batch size, and the
    # compile time of a typical schema; on the model's shape with a trained BPE vocabulary (bench/structured.py)
    structured: bool = False
    # speculative decoding (bench/speculative.py): tokens/s of each proposer vs none at each batch size on the demo
    # model's skills at speculative_tier, with acceptance rates, and a picture of speed-up against acceptance
    speculative: bool = False
    speculative_methods: list[Literal["none", "ngram", "tier", "draft", "draft_random"]] = Field(
        default=["none", "ngram", "tier", "draft", "draft_random"], min_length=1)
    speculative_batches: list[int] = Field(default=[1, 8], min_length=1)
    speculative_tier: str = "max"
    speculative_k: int = Field(default=4, ge=1, le=16)
    speculative_per_task: int = Field(default=8, ge=1)
    speculative_rounds: int = Field(default=3, ge=1)
    speculative_max_tokens: int = Field(default=24, ge=2)
    # and on each bench model (float32, random prompts, ignore_eos): none / ngram / draft / tier (MoE)
    speculative_models: bool = True
    speculative_requests: int = Field(default=4, ge=1)
    speculative_prompt_len: int = Field(default=32, ge=1)
    speculative_output_len: int = Field(default=64, ge=2)
    # tensor / expert parallelism (bench/parallel.py): each bench model in one process and over 2 ranks (tensor=2;
    # expert=2 for MoE), tokens/s and the driver's time in collectives per step
    parallel: bool = False
    parallel_batches: list[int] = Field(default=[1, 4], min_length=1)
    parallel_requests: int = Field(default=4, ge=1)
    parallel_prompt_len: int = Field(default=32, ge=1)
    parallel_output_len: int = Field(default=32, ge=2)
    parallel_rounds: int = Field(default=3, ge=1)
    structured_batches: list[int] = Field(default=[1, 16], min_length=1)
    structured_rounds: int = Field(default=3, ge=1)
    structured_max_tokens: int = Field(default=256, ge=16)
    busy_cores: float = Field(default=0.3, ge=0)  # other processes' CPU use (cores) above which a run is flagged

    def compute_dtype(self, precision: str) -> str:
        """The activation (device) dtype a precision runs in."""
        return {"int8": self.int8_activations, "int4": self.int4_activations}.get(precision, precision)

    def precision_overrides(self, precision: str) -> dict[str, Any]:
        """Engine config overrides a precision adds to ``engine`` (int8 / int4: the cpu_int8 / cpu_int4 layer ops)."""
        if precision == "int8":
            return {"pipeline.stages.decode.params.layer_ops": "cpu_int8",
                    "pipeline.stages.decode.params.layer_ops_params": {"lm_head": self.int8_lm_head,
                                                                       "activations": self.int8_dot}}
        if precision == "int4":
            return {"pipeline.stages.decode.params.layer_ops": "cpu_int4",
                    "pipeline.stages.decode.params.layer_ops_params": {
                        "lm_head": self.int4_lm_head, "group_size": self.int4_group_size, "activations": self.int4_dot}}
        return {}

    @field_validator("prompt_len", "output_len")
    @classmethod
    def _range(cls, v: tuple[int, int]) -> tuple[int, int]:
        lo, hi = v
        if lo < 1 or hi < lo:
            raise ValueError("must be [lo, hi] with 1 <= lo <= hi")
        return v


def bench_settings(section: Any) -> BenchSettings:
    """Validate the plain ``bench`` dict; a bad value gives one line per problem naming ``bench.<key>``."""
    return section_settings(BenchSettings, section, "bench")
