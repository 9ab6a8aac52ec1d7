"""`python -m litellm_pipeline +recipe=...` end to end, in a subprocess like a user runs it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest


def run_cli(*args: str, cwd, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "litellm_pipeline", *args, f"hydra.run.dir={cwd}/run", f"hydra.sweep.dir={cwd}/multi"]
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300, env={**os.environ})
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


SUMMARY = re.compile(
    r"\[summary\] prompt_tokens=(\d+) output_tokens=(\d+) finish=(\w+) tier=(\w+) cost=([\d.e-]+) tokens/s=([\d.]+)"
)


def test_generate_on_the_embedded_default_model(tmp_path):
    out = run_cli("+recipe=generate", "sampling.max_tokens=12", cwd=tmp_path).stdout
    assert "trained demo model" in out
    rows = SUMMARY.findall(out)
    assert len(rows) == 5  # the demo prompts: one held-out prompt per skill, each answer checked
    assert out.count("✓") + out.count("✗") == 5
    for prompt_toks, out_toks, finish, tier, cost, tps in rows:
        assert int(prompt_toks) > 0 and 1 <= int(out_toks) <= 12 and finish in ("stop", "length")
        assert tier == "balanced" and float(tps) > 0
        # balanced's price: 0.5 / 1.0 monetary units per 1k prompt / output tokens
        assert float(cost) == pytest.approx((int(prompt_toks) * 0.5 + int(out_toks) * 1.0) / 1000, rel=1e-3)


def test_generate_on_a_local_checkpoint_with_sampling_overrides(hf_checkpoint, tmp_path):
    path = hf_checkpoint("qwen3")
    args = ("+recipe=generate", f"model.path={path}", "prompt=Hello there", "sampling.temperature=0.7",
            "sampling.seed=3", "sampling.max_tokens=10", "sampling.ignore_eos=true")
    a = run_cli(*args, cwd=tmp_path).stdout
    b = run_cli(*args, cwd=tmp_path).stdout
    assert "RANDOM" not in a and str(path) in a
    assert ">>> Hello there" in a
    assert SUMMARY.findall(a)[0][1] == "10"
    text = lambda s: s.split(">>> Hello there\n", 1)[1].split("[summary]")[0]  # noqa: E731
    assert text(a) == text(b)  # same seed, same text
    c = run_cli(*args[:-3], "sampling.seed=4", "sampling.max_tokens=10", "sampling.ignore_eos=true", cwd=tmp_path).stdout
    assert text(c) != text(a)


def test_unknown_recipe_lists_the_known_ones(tmp_path):
    proc = run_cli("+recipe=nope", cwd=tmp_path, check=False)
    assert proc.returncode != 0
    assert "nope" in proc.stderr and "generate" in proc.stderr


def test_no_recipe_says_how_to_choose_one(tmp_path):
    proc = run_cli(cwd=tmp_path, check=False)
    assert proc.returncode == 2
    assert "+recipe=generate" in proc.stderr


def test_bad_config_value_is_one_clear_line(tmp_path):
    proc = run_cli("+recipe=generate", "cache.block_size=0", cwd=tmp_path, check=False)
    assert proc.returncode == 2
    assert "cache.block_size: must be >= 1" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_multirun_sweeps_tiers(hf_checkpoint, tmp_path):
    path = hf_checkpoint("mixtral")
    proc = run_cli("-m", "+recipe=generate", f"model.path={path}", "prompt=abc", "sampling.max_tokens=4",
                   "pipeline.stages.select_tier.params.tier=fast,max", cwd=tmp_path)
    tiers = [row[3] for row in SUMMARY.findall(proc.stdout)]
    assert tiers == ["fast", "max"]


def _broken_checkpoint(src, dst, what: str):
    import shutil

    shutil.copytree(src, dst)
    if what == "corrupt_config":
        (dst / "config.json").write_text("{ not json")
    elif what in ("zero_heads", "bad_type"):
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update({"num_attention_heads": 0} if what == "zero_heads" else {"num_hidden_layers": "four"})
        (dst / "config.json").write_text(json.dumps(cfg))
    elif what == "truncated_weights":
        f = dst / "model.safetensors"
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif what == "no_tokenizer":
        (dst / "tokenizer.json").unlink()
    return dst


@pytest.mark.parametrize(
    "what, text",
    [
        ("missing", "checkpoint directory not found"),
        ("corrupt_config", "corrupt JSON in"),
        ("zero_heads", "num_attention_heads = 0 (must be >= 1)"),
        ("bad_type", "malformed LlamaForCausalLM config (ValueError: invalid literal for int()"),
        ("truncated_weights", "corrupt safetensors file"),
        ("no_tokenizer", "tokenizer file not found"),
    ],
)
def test_broken_checkpoint_is_one_line_and_exit_2(hf_checkpoint, tmp_path, what, text):
    path = tmp_path / "nowhere" if what == "missing" else _broken_checkpoint(hf_checkpoint("llama"), tmp_path / "ck", what)
    proc = run_cli("+recipe=generate", f"model.path={path}", cwd=tmp_path, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and text in proc.stderr
    assert len([ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]) == 1


def test_full_error_env_shows_the_traceback(tmp_path):
    cmd = [sys.executable, "-m", "litellm_pipeline", "+recipe=generate", f"model.path={tmp_path / 'nowhere'}",
           f"hydra.run.dir={tmp_path}/run"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HYDRA_FULL_ERROR": "1"})
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "CheckpointError" in proc.stderr
