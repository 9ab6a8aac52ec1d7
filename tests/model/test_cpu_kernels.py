"""The kernel builds: the cache is keyed on the sources and torch's version, built from copies in the build
folder, so two checkouts (or versions) sharing it never rebuild over each other; LITELLM_PIPELINE_CPU_ISA asks
for a smaller build by name, only where the CPU has its features, and the loaded build reports its paths."""

from __future__ import annotations

import shutil

import pytest

from litellm_pipeline.errors import ConfigError
from litellm_pipeline.model import cpu_kernels


def _fake_sources(tmp_path, monkeypatch, body: str):
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    (src / "a.cpp").write_text(body)
    (src / "k.h").write_text("// header\n")
    monkeypatch.setattr(cpu_kernels, "SOURCES", (src / "a.cpp",))
    monkeypatch.setattr(cpu_kernels, "HEADERS", (src / "k.h",))
    return src


def test_source_key_follows_the_content(tmp_path, monkeypatch):
    src = _fake_sources(tmp_path, monkeypatch, "int a;\n")
    k1 = cpu_kernels._source_key()
    (src / "a.cpp").write_text("int b;\n")
    k2 = cpu_kernels._source_key()
    (src / "k.h").write_text("// changed header\n")
    k3 = cpu_kernels._source_key()
    assert len({k1, k2, k3}) == 3


def test_sources_are_staged_once_into_the_build_folder(tmp_path, monkeypatch):
    _fake_sources(tmp_path, monkeypatch, "int a;\n")
    build = tmp_path / "build"
    build.mkdir()
    staged = cpu_kernels._staged_sources(build)
    assert staged == [build / "a.cpp"] and (build / "k.h").read_text() == "// header\n"
    mtime = (build / "a.cpp").stat().st_mtime_ns
    (tmp_path / "other").mkdir()
    _fake_sources(tmp_path / "other", monkeypatch, "int a;\n")  # another checkout, same content
    assert cpu_kernels._staged_sources(build) == [build / "a.cpp"]
    assert (build / "a.cpp").stat().st_mtime_ns == mtime  # untouched: the build stays up to date


def test_build_is_named_after_the_sources_and_compiles_the_staged_copies(tmp_path, monkeypatch):
    from pathlib import Path

    from torch.utils import cpp_extension

    calls = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: calls.append(kw))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    cpu_kernels.build()
    key = cpu_kernels._source_key()
    assert cpu_kernels.HEADERS, "the kernels include a header: it must be part of the key"
    name = calls[0]["name"]
    assert name.startswith("litellm_cpu_kernels_") and name.endswith(f"_{key}")
    assert [Path(p) for p in calls[0]["sources"]] == [tmp_path / name / p.name for p in cpu_kernels.SOURCES]
    assert all((tmp_path / name / h.name).is_file() for h in cpu_kernels.HEADERS)


# what each build's kernels report: (simd_isa, row_linear_path without AMX, native bf16, native fp16)
BUILD_REPORTS = {
    "generic": ("none", "none", False, False),
    "avx2": ("avx2", "avx2", False, False),
    "avx512": ("avx512", "avx512", False, False),
    "avx512_bf16": ("avx512", "avx512_bf16", True, False),
}


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
def test_the_build_runs_the_paths_of_the_cpu_or_of_the_isa_asked_for():
    """The loaded kernels are the ones asked for (LITELLM_PIPELINE_CPU_ISA), else this CPU's own: AVX-512 where it
    has AVX-512 F+BW, vdpbf16ps where it has AVX-512 BF16, AMX tiles for row_linear where it has AMX."""
    ns = cpu_kernels.ops()
    got = (ns.simd_isa(), ns.row_linear_path(), ns.native_bf16_gemm(), ns.native_fp16_gemm())
    asked = cpu_kernels.isa()
    if asked != "native":
        assert got == BUILD_REPORTS[asked]
        return
    flags = cpu_kernels.cpu_flags()
    if not flags or cpu_kernels._cpu_key() is None:
        pytest.skip("the CPU cannot be named: a generic build")
    avx512 = {"avx512f", "avx512bw"} <= flags
    assert ns.simd_isa() == ("avx512" if avx512 else "avx2" if {"avx2", "fma", "f16c"} <= flags else "none")
    assert ns.native_bf16_gemm() == (avx512 and "avx512_bf16" in flags)
    assert ns.native_fp16_gemm() == ("avx512_fp16" in flags)
    row = ns.row_linear_path()
    if row == "amx":
        assert {"amx_tile", "amx_bf16"} <= flags
    else:
        assert row == ("avx512_bf16" if ns.native_bf16_gemm() else ns.simd_isa())


def test_an_isa_is_asked_for_by_name_and_only_where_the_cpu_has_it(monkeypatch):
    monkeypatch.delenv(cpu_kernels.ISA_ENV, raising=False)
    assert cpu_kernels.isa() == "native"
    monkeypatch.setenv(cpu_kernels.ISA_ENV, "avx9")
    with pytest.raises(ConfigError, match=r"LITELLM_PIPELINE_CPU_ISA='avx9': unknown kernel build; choose one of "
                                          r"native, generic, avx2, avx512, avx512_bf16"):
        cpu_kernels.isa()
    monkeypatch.setenv(cpu_kernels.ISA_ENV, "avx512_bf16")
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset(cpu_kernels.ISAS["avx512"][1]))
    with pytest.raises(ConfigError, match=r"'avx512_bf16': this CPU lacks avx512_bf16 \(/proc/cpuinfo flags\)"):
        cpu_kernels.isa()
    monkeypatch.setenv(cpu_kernels.ISA_ENV, "avx512")
    assert cpu_kernels.isa() == "avx512" and cpu_kernels.missing_features("avx512") == []
    monkeypatch.setenv(cpu_kernels.ISA_ENV, "generic")
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset())
    assert cpu_kernels.isa() == "generic"


def test_an_isa_asked_for_is_built_alone_under_its_own_name(tmp_path, monkeypatch):
    from torch.utils import cpp_extension

    calls = []

    def load(**kw):
        calls.append(kw)
        raise RuntimeError("compile error")

    monkeypatch.setattr(cpp_extension, "load", load)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset(cpu_kernels.ISAS["avx2"][1]))
    monkeypatch.setenv(cpu_kernels.ISA_ENV, "avx2")
    with pytest.raises(RuntimeError, match="compile error"):  # no fallback to another build
        cpu_kernels.build()
    assert len(calls) == 1
    assert calls[0]["name"] == f"litellm_cpu_kernels_avx2_{cpu_kernels._source_key()}"
    assert "-march=x86-64-v3" in calls[0]["extra_cflags"] and "-march=native" not in calls[0]["extra_cflags"]
    calls.clear()
    monkeypatch.delenv(cpu_kernels.ISA_ENV)
    with pytest.raises(RuntimeError, match="compile error"):  # native, then generic
        cpu_kernels.build()
    assert [c["name"].split("_")[3] for c in calls][-1] == "generic"


def test_a_build_the_cpu_cannot_run_stops_the_fused_ops_with_the_reason(monkeypatch):
    from litellm_pipeline.model.layer_ops import CpuFusedLayerOps

    monkeypatch.setattr(cpu_kernels, "_ops", None)
    monkeypatch.setattr(cpu_kernels, "_error", None)
    monkeypatch.setenv(cpu_kernels.ISA_ENV, "avx512_bf16")
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset())
    with pytest.raises(ConfigError, match="this CPU lacks avx"):
        CpuFusedLayerOps()


def test_the_build_key_names_the_torch_it_links_against(monkeypatch):
    import torch

    k1 = cpu_kernels._source_key()
    monkeypatch.setattr(torch, "__version__", torch.__version__ + "+other")
    assert cpu_kernels._source_key() != k1
