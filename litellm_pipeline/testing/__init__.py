"""The conformance kit: checks a plugin author calls from their own pytest tests, one per registry kind.

Each ``check_*`` takes a registry name (built-in, from an installed plugin, or ``"pkg.mod:Attr"``) or the object
itself, exercises it the way the engine will, and raises ``AssertionError`` with a message naming what broke and
where. They need nothing but this package: the engine checks run the embedded demo model on the CPU.

```python
from litellm_pipeline.testing import check_kv_policy
from my_plugin.policy import MyPolicy

def test_my_policy_conforms():
    check_kv_policy(MyPolicy)
```

| kind | check | what it runs |
|---|---|---|
| attention | :func:`check_attention` | float64 reference on random paged steps: GQA/MQA, prefill chunks over cached prefixes, decode, sliding windows, several dtypes |
| layer_ops | :func:`check_layer_ops` | every op against float64 math, batch invariance of ``linear`` when deterministic, the demo model's greedy tokens |
| moe_dispatch | :func:`check_moe_dispatch` | the weighted sum of each token's chosen experts; the demo model's greedy tokens |
| kv_policy | :func:`check_kv_policy` | scripted and random hit/evict sequences through a real ``BlockPool``; the demo model on a 12-block pool |
| budget_solver | :func:`check_budget_solver` | brute force on constructed and random multiple-choice problems; planning in the engine |
| router | :func:`check_router` | random mixed-tier steps: each token within its TierSet's counts and experts, deterministic, independent of the batch; the demo engine |
| sampler | :func:`check_sampler` | greedy ties, top-k/top-p/min-p, seeded determinism, draw frequencies, logprobs |
| stage | :func:`check_stage` | the demo model's pipeline with the stage in it: mixed batches, streaming, aborts, preemption |
| scheduler | :func:`check_scheduler` | tiny pools with recompute and swap preemption, late arrivals, aborts; every plan checked |
| proposer | :func:`check_proposer` | greedy output equal to no speculation (batched, alone, tiny pools with recompute and swap), seeded reproducibility, drafts in range, every block back |
| constraint | :func:`check_constraint` | compile of good and bad values, seeded token walks through the mask to end-of-sequence, refusals, rollback; the demo engine |
| telemetry | :func:`check_telemetry_sink` | one event of every type, a real run's events, and a live engine |
"""

from litellm_pipeline.testing.attention import check_attention
from litellm_pipeline.testing.budget_solver import check_budget_solver
from litellm_pipeline.testing.constraint import check_constraint
from litellm_pipeline.testing.kv_policy import check_kv_policy
from litellm_pipeline.testing.layer_ops import check_layer_ops
from litellm_pipeline.testing.moe_dispatch import check_moe_dispatch
from litellm_pipeline.testing.proposer import check_proposer
from litellm_pipeline.testing.router import check_router
from litellm_pipeline.testing.sampler import check_sampler
from litellm_pipeline.testing.scheduler import check_scheduler
from litellm_pipeline.testing.stage import check_stage
from litellm_pipeline.testing.telemetry import check_telemetry_sink

__all__ = [
    "check_attention",
    "check_budget_solver",
    "check_constraint",
    "check_kv_policy",
    "check_layer_ops",
    "check_moe_dispatch",
    "check_proposer",
    "check_router",
    "check_sampler",
    "check_scheduler",
    "check_stage",
    "check_telemetry_sink",
]
