"""The optional llama.cpp peer (``bench.llamacpp=true``): the same checkpoint as GGUF through ``llama-cpp-python``.

Needs ``llama-cpp-python`` (it compiles llama.cpp for a long time, so it is never installed by the project or in
CI) and the ``gguf`` package; without them the peer is reported as unavailable, never an error.

Precisions map to llama.cpp's closest formats: float32 -> F32, bfloat16 -> BF16, float16 -> F16, int8 -> Q8_0,
int4 -> Q4_0 (blocks of 32 weights with one float16 scale: every 2-D weight, the embeddings and the output head
included, as llama.cpp's own Q8_0 files). Norms stay F32. The GGUF is written from the bench checkpoint's safetensors (Llama
layout, Mixtral experts stacked per layer as llama.cpp expects; Q/K rows permuted for llama.cpp's rotary
convention, so the model computes what the checkpoint computes) with a placeholder vocabulary: prompts are
token ids, never text.

Each precision's peer runs in a child process of its own (``PeerProcess``). What is measured: batch-1 decode
(the same prompt and length as the engine's batch-1 row; tokens/s after the first token, best of N, in rounds
with the engine's own runs: see ``engine_runs.batch1_rounds``) and the mixed workload one request at a time
(``llama_cpp.Llama`` runs one sequence, so this understates llama.cpp on a mixed load).

``bench.llamacpp_server=PATH`` (a ``llama-server`` binary built from llama.cpp, or a command on PATH) measures the
mixed load the way llama.cpp serves it: the same GGUF in ``llama-server`` with ``bench.llamacpp_server_slots``
parallel slots and continuous batching, every request of the workload sent at once over HTTP (``/completion``
with token-id prompts, greedy, ``ignore_eos``), output tokens over the wall time from the first request to the
last answer; plus its batch-1 decode speed (one request alone, the server's own decode timing). Needs only the
binary and ``gguf``, not llama-cpp-python. The server keeps its default F16 KV cache in every precision; the
engine's row says its own (``kv_cache_dtype``: the model's dtype unless ``cache.dtype`` is set, e.g.
``'++bench.engine={cache.dtype: float16}'`` for the same cache as the server's).
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

import torch

GGUF_TYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "int8": "Q8_0", "int4": "Q4_0"}


def _missing(*mods: tuple[str, str]) -> str | None:
    """The pip name of the first ``(module, pip name)`` that does not import, or None."""
    for mod, what in mods:
        try:
            __import__(mod)
        except ImportError:
            return what
    return None


def unavailable() -> str | None:
    """Why the peer cannot run here, or None when it can."""
    what = _missing(("llama_cpp", "llama-cpp-python"), ("gguf", "gguf"))
    if what:
        return f"llama.cpp peer: {what} is not installed (pip install {what}; llama-cpp-python compiles llama.cpp)"
    return None


def version() -> str | None:
    try:
        import llama_cpp

        return getattr(llama_cpp, "__version__", "?")
    except ImportError:
        return None


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF's rotate-half Q/K rows -> llama.cpp's interleaved-pair order (as llama.cpp's converter does)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(ckpt: Path, out: Path, precision: str) -> Path:
    """The checkpoint at ``ckpt`` (config.json + model.safetensors of a Llama / Mixtral) as a GGUF file."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file

    cfg = json.loads((ckpt / "config.json").read_text())
    sd = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    h, layers, nh = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads", nh)
    hd = cfg.get("head_dim") or h // nh
    experts = cfg.get("num_local_experts", 0)
    qtype = getattr(gguf.GGMLQuantizationType, GGUF_TYPES[precision])
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name(ckpt.name)
    w.add_context_length(cfg.get("max_position_embeddings", 2048))
    w.add_embedding_length(h)
    w.add_block_count(layers)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-5)))
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_file_type({"F32": 0, "F16": 1, "Q4_0": 2, "Q8_0": 7, "BF16": 32}[GGUF_TYPES[precision]])
    vocab = cfg["vocab_size"]
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + [f"t{i}" for i in range(259, vocab)])
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (vocab - 259))
    w.add_bos_token_id(cfg.get("bos_token_id", 1) or 0)
    w.add_eos_token_id(cfg.get("eos_token_id", 2) or 0)

    def put(name: str, t: torch.Tensor, matrix: bool = True) -> None:
        a = t.float().numpy()
        if not matrix or qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, a.astype(np.float32))
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_shape=gguf.quant_shape_to_byte_shape(a.shape, qtype),
                         raw_dtype=qtype)

    put("token_embd.weight", sd["model.embed_tokens.weight"])
    put("output_norm.weight", sd["model.norm.weight"], matrix=False)
    put("output.weight", sd.get("lm_head.weight", sd["model.embed_tokens.weight"]))
    for i in range(layers):
        p = f"model.layers.{i}."
        put(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"], matrix=False)
        put(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"], matrix=False)
        put(f"blk.{i}.attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], nh))
        put(f"blk.{i}.attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], nkv))
        put(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        put(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        if experts:
            e = p + "block_sparse_moe."
            put(f"blk.{i}.ffn_gate_inp.weight", sd[e + "gate.weight"], matrix=False)
            for ours, theirs in (("w1", "gate"), ("w3", "up"), ("w2", "down")):
                stacked = torch.stack([sd[f"{e}experts.{j}.{ours}.weight"] for j in range(experts)])
                put(f"blk.{i}.ffn_{theirs}_exps.weight", stacked)
        else:
            for ours, theirs in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
                put(f"blk.{i}.ffn_{theirs}.weight", sd[p + f"mlp.{ours}.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


class Peer:
    """One GGUF loaded in ``llama_cpp.Llama`` with ``threads`` threads."""

    def __init__(self, path: Path, threads: int, n_ctx: int):
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                         n_batch=512, verbose=False)

    def generate(self, prompt: Sequence[int], n: int) -> tuple[float, float, int]:
        """Greedy ``n`` tokens after ``prompt`` (ids); ``(ttft_s, decode_s after the first token, tokens)``."""
        self.llm.reset()
        t0 = time.perf_counter()
        first = last = None
        count = 0
        for _ in self.llm.generate(list(prompt), top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                   reset=True):
            now = time.perf_counter()
            first = now if first is None else first
            last = now
            count += 1
            if count >= n:
                break
        return first - t0, last - first, count


def ensure_gguf(path: Path, precision: str, workdir: Path) -> Path:
    """The checkpoint's GGUF in ``precision``'s format under ``workdir`` (written once, then reused)."""
    gguf_path = workdir / f"{path.name}-{GGUF_TYPES[precision]}.gguf"
    if not gguf_path.exists():
        write_gguf(path, gguf_path.with_suffix(".tmp"), precision).rename(gguf_path)
    return gguf_path


def context_need(items, b1) -> int:
    return max(len(it.prompt_ids) + it.output_len for it in [*items, b1]) + 8


def _peer_batch1_tpot(peer: Peer, b1) -> float:
    """One batch-1 run through ``peer`` (a :class:`Peer`): seconds per token after the first."""
    _, dt, n = peer.generate(b1.prompt_ids, b1.output_len)
    return dt / max(n - 1, 1)


def _peer_mixed(peer: Peer, items) -> dict:
    """The mixed workload through ``peer``, one request after the other."""
    t0 = time.perf_counter()
    out_tokens, ttft = 0, []
    for it in items:
        t_first, _, n = peer.generate(it.prompt_ids, it.output_len)
        out_tokens += n
        ttft.append(t_first)
    elapsed = time.perf_counter() - t0
    return {"requests": len(items), "output_tokens": out_tokens, "output_tok_s": out_tokens / elapsed,
            "elapsed_s": elapsed, "ttft_ms_p50": sorted(ttft)[len(ttft) // 2] * 1e3}


_PEER: Peer | None = None  # the child process's peer (PeerProcess)


def _child_load(gguf_path: Path, threads: int, n_ctx: int) -> None:
    global _PEER
    _PEER = Peer(gguf_path, threads, n_ctx)
    _PEER.generate([1, 2, 3, 4, 5, 6, 7, 8], 4)  # warm up


def _child_call(fn, *args):
    return fn(_PEER, *args)


class PeerProcess:
    """A :class:`Peer` in a child process of its own, for the length of a ``with`` block: llama.cpp's threads,
    memory and mappings live there and are gone when the block ends, and the engine can run between its calls
    (the bench interleaves their batch-1 runs)."""

    def __init__(self, path: Path, precision: str, threads: int, n_ctx: int, workdir: Path):
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        self.precision = precision
        self.gguf_path = ensure_gguf(path, precision, workdir)
        self._pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        try:
            self._pool.submit(_child_load, self.gguf_path, threads, n_ctx).result()
        except BaseException:
            self.close()
            raise

    def batch1_tpot(self, b1) -> float:
        return self._pool.submit(_child_call, _peer_batch1_tpot, b1).result()

    def mixed(self, items) -> dict:
        return self._pool.submit(_child_call, _peer_mixed, items).result()

    def info(self) -> dict:
        return {"format": GGUF_TYPES[self.precision], "gguf_mb": self.gguf_path.stat().st_size / 2**20,
                "version": version()}

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "PeerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ------------------------------------------------------------------------------------------------ llama-server


def server_unavailable(binary: str) -> str | None:
    """Why the llama-server peer cannot run with ``binary``, or None when it can."""
    if shutil.which(binary) is None:
        return (f"llama-server peer: {binary!r} is neither an executable file nor a command on PATH (build llama.cpp's "
                "llama-server target and pass its path as bench.llamacpp_server)")
    if _missing(("gguf", "gguf")):
        return "llama-server peer: gguf is not installed (pip install gguf)"
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """``llama-server`` on one GGUF, on a free local port, for the length of a ``with`` block.

    ``slots`` parallel sequences of ``ctx_per_slot`` tokens each, ``threads`` threads for decode and prompt
    processing. Its output goes to ``log``; a server that exits or is not healthy within ``startup_s`` raises
    RuntimeError with the end of that log.
    """

    def __init__(self, binary: str, gguf_path: Path, threads: int, slots: int, ctx_per_slot: int, log: Path,
                 startup_s: float = 180.0, fmt: str = ""):
        self.format, self.slots = fmt, slots
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [shutil.which(binary) or binary, "-m", str(gguf_path), "--host", "127.0.0.1", "--port", str(self.port),
               "-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(slots * ctx_per_slot),
               "-b", "512", "-ub", "512"]
        self._log_file = open(log, "wb")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            self._wait_healthy(startup_s)
        except BaseException:
            self.close()
            raise

    def _tail(self) -> str:
        self._log_file.flush()
        return " | ".join(self.log.read_text(errors="replace").strip().splitlines()[-5:])

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with code {self.proc.returncode}: {self._tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"llama-server not healthy after {timeout_s:.0f} s: {self._tail()}")

    def complete(self, prompt: Sequence[int], n: int, timeout_s: float = 600.0) -> dict:
        """Greedy ``n`` tokens after ``prompt`` (token ids), end-of-sequence ignored: the server's answer."""
        body = json.dumps({"prompt": [int(t) for t in prompt], "n_predict": int(n), "ignore_eos": True,
                           "temperature": 0.0, "top_k": 1, "cache_prompt": False, "stream": False}).encode()
        req = urllib.request.Request(self.url + "/completion", data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"llama-server /completion: HTTP {exc.code}: {exc.read()[:300]!r}") from exc

    def batch1_tpot(self, b1) -> float:
        """One batch-1 run: seconds per token after the first, from the server's own decode timing.

        ``predicted_ms`` runs from the first token (sampled from the prompt's logits) to the last, so it spans
        ``predicted_n - 1`` decode steps, as the engine's ``batch1_tpot`` counts them."""
        t = self.complete(b1.prompt_ids, b1.output_len)["timings"]
        return (t["predicted_ms"] / 1e3) / max(t["predicted_n"] - 1, 1)

    def mixed(self, items) -> dict:
        """Every request of the mixed workload sent at once; output tokens over the wall time."""
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=len(items)) as pool:
            answers = list(pool.map(lambda it: self.complete(it.prompt_ids, it.output_len), items))
        elapsed = time.perf_counter() - t0
        out_tokens = sum(int(a["tokens_predicted"]) for a in answers)
        want = sum(it.output_len for it in items)
        if out_tokens != want:
            raise RuntimeError(f"llama-server produced {out_tokens} tokens, the workload asks for {want}")
        return {"requests": len(items), "output_tokens": out_tokens, "output_tok_s": out_tokens / elapsed,
                "elapsed_s": elapsed}

    def info(self) -> dict:
        return {"format": self.format, "slots": self.slots}

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_file.close()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_server(binary: str, path: Path, precision: str, threads: int, slots: int, n_ctx: int,
                workdir: Path) -> Server:
    """``llama-server`` on the checkpoint's GGUF in ``precision``'s format, ``n_ctx`` tokens per slot, warmed up."""
    gguf_path = ensure_gguf(path, precision, workdir)
    log = workdir / f"llama-server-{path.name}-{GGUF_TYPES[precision]}.log"
    srv = Server(binary, gguf_path, threads, slots, n_ctx, log, fmt=GGUF_TYPES[precision])
    try:
        srv.complete([1, 2, 3, 4, 5, 6, 7, 8], 4)  # warm up
    except BaseException:
        srv.close()
        raise
    return srv


def measure_server(binary: str, path: Path, precision: str, items, b1, repeats: int, threads: int, slots: int,
                   workdir: Path) -> dict:
    """Batch-1 decode (best of ``repeats``) and the mixed workload (all requests at once) through ``llama-server``
    (see the module doc)."""
    with open_server(binary, path, precision, threads, slots, context_need(items, b1), workdir) as srv:
        best = min(srv.batch1_tpot(b1) for _ in range(repeats))
        return {**srv.info(), "batch1_tok_s": 1.0 / best, **srv.mixed(items)}
