"""The embedded demo model: skills corpus, tokenizer, shipped checkpoint (ours vs transformers), the eval and
train_demo recipes."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from litellm_pipeline import LLM, SamplingParams
from litellm_pipeline.demo import CHECKPOINT_DIR, demo_checkpoint, demo_prompts
from litellm_pipeline.demo.network import MoeForTraining, NetworkConfig
from litellm_pipeline.demo.skills import (
    TASKS,
    Example,
    heldout,
    solve,
    split_of,
    training_stream,
)
from litellm_pipeline.demo.tokenizer import EOS_ID, build_char_tokenizer
from litellm_pipeline.tasks.train_demo import TrainSettings, encode_batch, train

# a fixed handful of held-out prompts (two per skill); the shipped model must answer all of them
HANDFUL = heldout(2, seed=7)
TINY = dict(steps=3, batch_size=4, eval_per_task=1, progress=False, hidden_size=32, intermediate_size=16,
            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM()  # no model: the embedded demo model


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "litellm_pipeline", *args, f"hydra.run.dir={cwd}/run"]
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300, env={**os.environ})
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


# --- corpus and tokenizer ---------------------------------------------------------------------------------


def test_corpus_is_deterministic_and_answers_are_right():
    a, b = heldout(30, seed=5), heldout(30, seed=5)
    assert a == b and len(a) == 30 * len(TASKS)
    assert heldout(30, seed=6) != a
    assert [e.task for e in a[::30]] == list(TASKS)
    s1, s2 = (list(itertools.islice(training_stream(3), 200)) for _ in range(2))
    assert s1 == s2 and s1 != list(itertools.islice(training_stream(4), 200))
    chars = set(build_char_tokenizer().convert_ids_to_tokens(range(4, 47)))
    for ex in a + s1:
        assert solve(ex.prompt) == (ex.task, ex.answer)
        assert set(ex.prompt + ex.answer) <= chars
    assert solve("12+345=") == ("add", "357") and solve("a3,b7,c1;b") == ("recall", "7")
    assert solve("rev:abcde=") == ("reverse", "edcba") and solve("sort:3917=") == ("sort", "1379")
    assert solve("Hello") is None and solve("a1;b") is None and solve("a=3,b=7;b?") is None


def _asked(ex) -> list[str]:
    """Every single-question prompt a training example answers (recall follow-ups included)."""
    pairs = ex.prompt.split(";")[0]
    return [ex.prompt] + [f"{pairs}{q}" for q, _ in ex.followups]


def test_heldout_prompts_never_appear_in_training():
    held = {e.prompt for e in heldout(200, seed=0)}
    assert all(split_of(p) == "eval" for p in held)
    stream = list(itertools.islice(training_stream(0, recall_questions=4), 20000))
    train_prompts = {p for e in stream for p in _asked(e)}
    assert all(split_of(p) == "train" for p in train_prompts)
    assert not held & train_prompts
    assert any(e.followups for e in stream)  # the follow-ups were exercised


def test_recall_followups_ask_other_keys_with_their_values():
    stream = [e for e in itertools.islice(training_stream(1, {"recall": 1.0}, recall_questions=4), 300)]
    sizes = set()
    for ex in stream:
        asked = [ex.prompt.split(";")[1]] + [q[1:] for q, _ in ex.followups]
        assert len(set(asked)) == len(asked)  # never the same key twice
        for prompt, (_, answer) in zip(_asked(ex)[1:], ex.followups):
            assert solve(prompt) == ("recall", answer)
        sizes.add(len(ex.followups))
    assert sizes == {0, 1, 2, 3}
    plain = list(itertools.islice(training_stream(1, {"recall": 1.0}), 50))
    assert all(not e.followups for e in plain)


def test_encode_batch_scores_answers_only():
    tok = build_char_tokenizer()
    ex = Example("recall", "e9,i1;i", "1", ((";e", "9"),))
    ids, valid, target = encode_batch([ex, Example("copy", "copy:ab=", "ab")], tok, 64)
    text = tok.decode(ids[0][valid[0]].tolist())
    assert text == "e9,i1;i1;e9"
    scored = [tok.convert_ids_to_tokens([t])[0] for t in ids[0][target[0]].tolist()]
    assert scored == ["1", "9", "</s>"]  # the follow-up question ";e" is context, not a target
    assert [tok.convert_ids_to_tokens([t])[0] for t in ids[1][target[1]].tolist()] == ["a", "b", "</s>"]
    assert not target[~valid].any()


def test_per_layer_expert_counts_match_uniform_ones():
    torch.manual_seed(0)
    net = MoeForTraining(NetworkConfig(vocab_size=47, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                                           num_attention_heads=2, num_key_value_heads=1)).eval()
    ids = torch.randint(4, 47, (2, 7))
    valid = torch.ones_like(ids, dtype=torch.bool)
    k = torch.full_like(ids, 2)
    with torch.no_grad():
        same, _ = net(ids, valid, k)
        layered, _ = net(ids, valid, torch.stack([k, k]))
        mixed, _ = net(ids, valid, torch.stack([k, torch.full_like(ids, 8)]))
    assert torch.equal(same, layered)
    assert not torch.allclose(same, mixed)  # the second layer's count is used


def test_char_tokenizer_roundtrip_and_transformers_agree(tmp_path):
    tok = build_char_tokenizer()
    ids = tok.encode("12+345=357")
    assert ids[0] == tok.bos_token_id and len(ids) == 11
    assert tok.decode(ids + [EOS_ID]) == "12+345=357"
    assert tok.decode(tok.encode("Q")) == ""  # outside the charset: <unk>, a special token
    transformers = pytest.importorskip("transformers")
    tok.save(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in ("rev:abcde=", "a3,b7,c1;b", "sort: 3917="):
        assert hf(text).input_ids == tok.encode(text)
        assert hf.decode(tok.encode(text), skip_special_tokens=True) == text
    assert (hf.eos_token_id, hf.pad_token_id, hf.bos_token_id) == (EOS_ID, 2, 0)


# --- the shipped checkpoint -------------------------------------------------------------------------------


def test_shipped_checkpoint_is_a_small_qwen3_moe():
    path = demo_checkpoint()
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["model_type"] == "qwen3_moe"
    assert (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["norm_topk_prob"]) == (8, 2, False)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (path / name).is_file()
    size = sum(f.stat().st_size for f in path.iterdir())
    assert size < 8 * 2**20
    names = set(load_file(path / "model.safetensors"))
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in names and "lm_head.weight" in names


def _hf_greedy(model, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    toks, lps = [], []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids + toks])).logits[0, -1].float()
            t = int(logits.argmax())
            toks.append(t)
            lps.append(float(torch.log_softmax(logits, -1)[t]))
    return toks, lps


def test_shipped_model_matches_transformers(llm):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(CHECKPOINT_DIR, dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(CHECKPOINT_DIR)
    prompts = [e.prompt for e in HANDFUL[::2]]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        ids = hf_tok(prompt).input_ids
        assert ids == out.prompt_token_ids
        toks, lps = _hf_greedy(model, ids, 10)
        assert out.token_ids == toks, prompt
        ours = [lp[t] for lp, t in zip(out.logprobs, out.token_ids)]
        assert max(abs(a - b) for a, b in zip(ours, lps)) < 1e-3


@pytest.mark.parametrize("tier", ["balanced", "max"])  # balanced is the default tier
def test_shipped_model_answers_held_out_prompts(llm, tier):
    outs = llm.generate([e.prompt for e in HANDFUL], SamplingParams(max_tokens=16, temperature=0.0), tier=tier)
    got = {e.prompt: o.text for e, o in zip(HANDFUL, outs)}
    assert got == {e.prompt: e.answer for e in HANDFUL}
    assert all(o.finish_reason == "stop" for o in outs)  # each answer ends with EOS


def test_default_run_prints_checked_answers(tmp_path):
    out = run_cli("+recipe=generate", cwd=tmp_path).stdout
    assert "trained demo model" in out
    for ex in demo_prompts(0):
        assert f">>> {ex.prompt}\n{ex.answer}   ✓\n" in out
    assert out.count("✓") == len(TASKS) and "✗" not in out  # the default run answers every prompt


def test_chat_run_renders_the_template_once_and_answers(tmp_path):
    """chat=true: each prompt goes through the demo model's chat template (BOS + the user message), tokenized
    without a second BOS, so the answers are the plain run's."""
    out = run_cli("+recipe=generate", "chat=true", cwd=tmp_path).stdout
    for ex in demo_prompts(0):
        assert f">>> <s>{ex.prompt}\n{ex.answer}   ✓\n" in out
    assert f"prompt_tokens={1 + len(demo_prompts(0)[0].prompt)} " in out and "✗" not in out


# --- recipes ------------------------------------------------------------------------------------------------


def test_eval_recipe_writes_accuracy_per_task_and_tier(tmp_path):
    proc = run_cli("+recipe=eval", "eval.per_task=3", "eval.progress=false", cwd=tmp_path)
    result = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert list(result["accuracy"]) == ["fast", "balanced", "deep", "max"]
    assert [result["tiers"][t]["experts_per_token"] for t in result["accuracy"]] == [1, 2, 4, 8]
    for accs in result["accuracy"].values():
        assert set(accs) == {*TASKS, "all"}
        assert all(0.0 <= a <= 1.0 for a in accs.values())
    assert result["per_task"] == 3
    assert "balanced" in proc.stdout and "recall" in proc.stdout


def test_eval_rejects_unknown_tier_and_task(tmp_path):
    for arg, text in (("eval.tiers=[turbo]", "eval.tiers: unknown tier"), ("eval.tasks=[mul]", "eval.tasks: unknown")):
        cmd = [sys.executable, "-m", "litellm_pipeline", "+recipe=eval", arg, f"hydra.run.dir={tmp_path}/run"]
        proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and text in proc.stderr and "Traceback" not in proc.stderr


def test_few_step_training_is_reproducible_and_loadable(tmp_path):
    a = train(TrainSettings(**TINY), tmp_path / "a")
    train(TrainSettings(**TINY), tmp_path / "b")
    wa, wb = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert a["parameters"] > 0 and len(a["history"]) == 1 and a["workers"] == 2
    assert [step for step, _ in a["loss_curve"]] == [3] and a["loss_curve"][0][1] > 0
    assert (tmp_path / "a" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = LLM(model=str(tmp_path / "a")).generate("12+34=", SamplingParams(max_tokens=4, temperature=0.0), tier="max")
    assert 1 <= len(out[0].token_ids) <= 4


def test_a_failing_training_worker_is_reported_by_rank(tmp_path):
    # rank 0 cannot write the checkpoint (its parent folder is a file): the parent names the worker and its
    # exit code instead of returning as if trained
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(RuntimeError, match="training worker 0 of 2 exited with code 1"):
        train(TrainSettings(**TINY), tmp_path / "file" / "c")


def test_train_demo_recipe_writes_a_checkpoint_transformers_loads(tmp_path):
    args = [f"train.{k}={v}" for k, v in TINY.items()]
    proc = run_cli("+recipe=train_demo", *args, cwd=tmp_path)
    ckpt = tmp_path / "run" / "checkpoint"
    assert "wrote" in proc.stdout and (ckpt / "model.safetensors").is_file()
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    assert model.config.num_local_experts == 8
    ours = LLM(model=str(ckpt)).generate("rev:abc=", SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    ids = transformers.AutoTokenizer.from_pretrained(ckpt)("rev:abc=").input_ids
    assert ours[0].token_ids == _hf_greedy(model, ids, 5)[0]


def test_a_qwen3_moe_network_without_renormalisation_loads_and_matches(tmp_path):
    """family qwen3_moe, norm_topk_prob false: a Qwen3MoeForCausalLM checkpoint; transformers and the engine
    give the training network's own greedy tokens, and at one expert the engine runs what it trained."""
    settings = TrainSettings(**{**TINY, "family": "qwen3_moe", "norm_topk_prob": False, "split_loss_coef": 0.1})
    train(settings, tmp_path / "q")
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe" and cfg["norm_topk_prob"] is False and cfg["num_experts"] == 8
    names = set(load_file(tmp_path / "q" / "model.safetensors"))
    assert {"model.layers.0.mlp.experts.7.down_proj.weight", "model.layers.0.self_attn.q_norm.weight"} <= names
    net = MoeForTraining(NetworkConfig.from_hf(cfg))
    net.load_state_dict({k: v.float() for k, v in load_file(tmp_path / "q" / "model.safetensors").items()})
    net.eval()
    llm = LLM(model=str(tmp_path / "q"), dtype="float32")
    prompt = "rev:abc="
    for tier, k in (("fast", 1), ("balanced", 2), ("max", 8)):
        (out,) = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0, logprobs=3), tier=tier)
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            logits, _ = net(ids, torch.ones_like(ids, dtype=torch.bool), torch.full_like(ids, k))
        ref = torch.log_softmax(logits[0, -1], -1)
        for tok, lp in out.logprobs[0].items():
            assert abs(lp - float(ref[tok])) < 1e-4, tier
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.float32).eval()
    ours = llm.generate(prompt, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert ours[0].token_ids == _hf_greedy(model, ours[0].prompt_token_ids, 5)[0]
