"""The kernel build cache: keyed on the sources, built from copies in the build folder, so two checkouts
(or two versions) sharing the cache never rebuild over each other."""

from __future__ import annotations

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
