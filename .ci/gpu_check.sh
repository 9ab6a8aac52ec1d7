#!/usr/bin/env bash
# The GPU check, run once on a lent GPU machine (not part of CI, which has no GPU).
#
# The machine has python3 with torch, triton, transformers and pytest, and no network: the project's other
# pure-Python dependencies travel as wheels in .whl/ (fetched here first, e.g.
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     hydra-core omegaconf antlr4-python3-runtime==4.9.3 pydantic pydantic-core annotated-types typing-inspection
# ) and the run carries .whl. It runs the CUDA and Triton tests compiled on the GPU (the tests named *triton* also
# at real sizes), then +recipe=bench on the GPU with the Triton entries selected: the engine against
# transformers.generate in the same run, batch-1 decode against the measured HBM bandwidth, the 64-request mixed
# load, and expert offload (hit rate, decode cost of a miss). Everything it prints also lands in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"

timeout 180 python3 -m pytest -q -p no:cacheprovider \
  tests/model/test_cuda.py tests/model/test_cuda_graphs.py tests/model/test_expert_offload.py \
  tests/model/test_triton_attention.py tests/model/test_rope.py tests/parallel/test_parallel.py \
  -k "cuda or triton or offload or device" \
  2>&1 | tee "$OUT/gpu_tests.log"

timeout "${BENCH_TIMEOUT:-420}" python3 -m litellm_pipeline +recipe=bench device=cuda \
  'bench.models=[llama125m,mixtral175m]' 'bench.dtypes=[bfloat16]' bench.num_requests="${BENCH_REQUESTS:-64}" \
  bench.peer_single_max_requests=4 bench.prefix_len=1024 'bench.offload=[2,4]' bench.roofline.bandwidth_mb=4096 \
  +bench.engine.pipeline.stages.decode.params.attention=triton_paged \
  +bench.engine.pipeline.stages.decode.params.moe_dispatch=triton_fused \
  +bench.engine.pipeline.stages.decode.params.layer_ops=triton \
  "hydra.run.dir=$OUT/bench" 2>&1 | tee "$OUT/bench.txt"
