"""The project's C++ CPU kernels (``csrc/*.cpp``): built on first use with torch's JIT extension loader.

One extension holds every op (namespace ``torch.ops.litellm_pipeline_cpu``): the paged attention of
``cpu_paged``, the fused layer ops of ``layer_ops: cpu_fused`` and structured output's token mask. It is compiled once per machine into the
user cache (``-march=native`` where the CPU can be named, else a generic build) and reused afterwards. A build is
named by the CPU, the sources, the compiler flags, the compiler, torch's version and the Python ABI, so installs
that differ in any of them never rebuild over each other; processes that start at once build once (torch's loader
holds a file lock in the build folder while one compiles; the others wait, then load it). A first build is logged
before it starts and when it ends. Callers decide what to do when it cannot be built: every user of these ops has
a torch fallback.

``LITELLM_PIPELINE_CPU_ISA`` builds the kernels for a smaller instruction set than the CPU's own (one of
:data:`ISAS`), so a CPU with more features runs, and the tests check, the code a CPU with fewer runs; it is read
once per process (the ops of one process come from one build).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sysconfig
import threading
import time
from pathlib import Path

import torch

from litellm_pipeline.errors import ConfigError

_CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = tuple(_CSRC / f for f in ("paged_attention.cpp", "layer_ops.cpp", "int8_linear.cpp", "int4_linear.cpp",
                                     "token_mask.cpp"))
HEADERS = tuple(sorted(_CSRC.glob("*.h")))
NAMESPACE = "litellm_pipeline_cpu"

ISA_ENV = "LITELLM_PIPELINE_CPU_ISA"
# x86-64-v3 (AVX2, FMA, F16C and the bit ops the compiler may use with them) and x86-64-v4 (AVX-512 F/BW/CD/DQ/VL)
# as /proc/cpuinfo names their features (abm: lzcnt)
_V3 = ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave")
_V4 = (*_V3, "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")
# The builds LITELLM_PIPELINE_CPU_ISA can ask for, fewest features first: (compiler flags, CPU features needed).
# Each is a kernel path some CPUs take natively: generic (no vector kernels: the torch ops), avx2 (AMD Zen 2/3,
# Intel Haswell..Alder Lake), avx512 (Skylake-SP..Ice Lake: widened 16-bit values), avx512_bf16 (AMD Zen 4/5:
# vdpbf16ps for bfloat16). "native" (the default) is -march=native: on Sapphire Rapids and later AMX tiles and
# AVX-512 FP16 too.
ISAS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "generic": ((), ()),
    "avx2": (("-march=x86-64-v3",), _V3),
    "avx512": (("-march=x86-64-v4",), _V4),
    "avx512_bf16": (("-march=x86-64-v4", "-mavx512bf16"), (*_V4, "avx512_bf16")),
}

log = logging.getLogger(__name__)

_lock = threading.Lock()
_ops = None  # the loaded namespace
_error: BaseException | None = None  # why it could not be built (raised again on every later call)


def extension_dir() -> Path:
    """Where built kernels live: ``$TORCH_EXTENSIONS_DIR`` if set, else the user cache."""
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    if env:
        return Path(env)
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "litellm_pipeline" / "torch_extensions"


def _cpuinfo() -> dict[str, str]:
    """The first ``model name`` and ``flags`` lines of /proc/cpuinfo (empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    lines: dict[str, str] = {}
    for line in text.splitlines():
        key, _, val = line.partition(":")
        key = key.strip()
        if key in ("model name", "flags") and key not in lines:
            lines[key] = val.strip()
    return lines


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as /proc/cpuinfo lists them (empty where it cannot be read)."""
    return frozenset(_cpuinfo().get("flags", "").split())


def missing_features(isa: str) -> list[str]:
    """The CPU features build ``isa`` needs that this CPU lacks (empty: it can run it)."""
    have = cpu_flags()
    return [f for f in ISAS[isa][1] if f not in have]


def isa() -> str:
    """The build this process asks for: ``$LITELLM_PIPELINE_CPU_ISA`` or ``native``; a ConfigError names an
    unknown value, or the features this CPU lacks for the one asked."""
    name = os.environ.get(ISA_ENV, "").strip() or "native"
    if name == "native":
        return name
    if name not in ISAS:
        raise ConfigError(f"{ISA_ENV}={name!r}: unknown kernel build; choose one of native, {', '.join(ISAS)}")
    if platform.machine() not in ("x86_64", "AMD64") and name != "generic":
        raise ConfigError(f"{ISA_ENV}={name!r}: x86-64 builds need an x86-64 CPU (this is {platform.machine()})")
    missing = missing_features(name)
    if missing:
        raise ConfigError(f"{ISA_ENV}={name!r}: this CPU lacks {', '.join(missing)} (/proc/cpuinfo flags)")
    return name


def _cpu_key() -> str | None:
    """A short hash naming this CPU (model + feature flags), or None where it cannot be read.

    ``-march=native`` code only runs on CPUs with the same features, and the build cache may be shared
    (a home directory on several machines), so a native build is named after the CPU it was built for.
    """
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    lines = _cpuinfo()
    if "flags" not in lines:
        return None
    return hashlib.sha1(repr(sorted(lines.items())).encode()).hexdigest()[:10]


# -fno-trapping-math: the default FP environment traps nothing, so the compiler may vectorise what may raise a
# flag (exp_f's nearbyint, which keeps e.g. silu_mul scalar otherwise); no value changes, no reassociation
CFLAGS = ("-O3", "-fopenmp", "-DNDEBUG", "-fno-trapping-math")


def _source_key() -> str:
    """A short hash of the kernel sources and flags: a build is reused only by code compiled from the same
    sources, so two checkouts (or versions) sharing the cache never rebuild over each other."""
    h = hashlib.sha1(repr(CFLAGS).encode())
    h.update(torch.__version__.encode())  # a build links against one torch: other versions build their own
    h.update(str(sysconfig.get_config_var("SOABI")).encode())  # ... and one Python ABI
    h.update(_compiler_id().encode())
    for path in (*SOURCES, *HEADERS):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:10]


@functools.lru_cache(maxsize=1)
def _compiler_id() -> str:
    """The C++ compiler's name and the first line of its ``--version``."""
    cxx = os.environ.get("CXX", "c++")
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return cxx
    return f"{cxx} {out.splitlines()[0] if out else ''}"


def _staged_sources(build_dir: Path) -> list[Path]:
    """The sources copied into the build folder: the build files then name the same paths whichever
    checkout asks, so an up-to-date build is found instead of redone."""
    staged = []
    for path in (*SOURCES, *HEADERS):
        dst = build_dir / path.name
        data = path.read_bytes()
        if not dst.is_file() or dst.read_bytes() != data:
            tmp = dst.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, dst)  # atomic: a concurrent build never reads half a file
        staged.append(dst)
    return staged[: len(SOURCES)]


def build():
    """Compile (or reuse the cached build of) the kernels; returns the op namespace."""
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler ({cxx!r} not on PATH)")
    if shutil.which("ninja") is None:
        try:  # the `ninja` wheel ships the binary inside the package; its folder may not be on PATH
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            raise RuntimeError("ninja not found (pip install ninja)") from None
    from torch.utils import cpp_extension

    src = _source_key()
    forced = isa()
    if forced != "native":  # only the build asked for: a failure is the answer, not a cue to try another
        builds = [(f"litellm_cpu_kernels_{forced}_{src}", list(ISAS[forced][0]))]
    else:
        key = _cpu_key()
        builds = ([(f"litellm_cpu_kernels_{key}_{src}", ["-march=native"])] if key else []) + [
            (f"litellm_cpu_kernels_generic_{src}", [])
        ]
    for i, (name, arch) in enumerate(builds):
        build_dir = extension_dir() / name
        build_dir.mkdir(parents=True, exist_ok=True)
        first = not (build_dir / f"{name}.so").is_file()
        if first:
            log.info("compiling the CPU kernels for this machine (%s build; first run only, half a minute to a minute "
                     "on two cores; a process starting meanwhile waits for this build) into %s",
                     "native" if "-march=native" in arch else forced if arch else "generic", build_dir)
        t0 = time.monotonic()
        try:
            cpp_extension.load(
                name=name,
                sources=[str(s) for s in _staged_sources(build_dir)],
                extra_cflags=[*CFLAGS, *arch],
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir),
                is_python_module=False,
                verbose=False,
            )
            if first:
                log.info("CPU kernels ready in %.0f s (later runs reuse them)", time.monotonic() - t0)
            break
        except Exception:
            if i == len(builds) - 1:
                raise  # a native build can fail where a generic one works (an assembler older than the CPU)
    return getattr(torch.ops, NAMESPACE)


def ops():
    """The op namespace, building it on first use; raises (the same error every time) if it cannot be built
    (a ConfigError where ``$LITELLM_PIPELINE_CPU_ISA`` asks for a build this CPU cannot run)."""
    global _ops, _error
    if _ops is not None:
        return _ops
    with _lock:
        if _ops is None and _error is None:
            try:
                _ops = build()
            except Exception as exc:
                _error = exc
    if _error is not None:
        raise _error
    return _ops


def loaded():
    """The op namespace if it is built already (by a caller of :func:`ops`), else None; never builds."""
    return _ops


def reason(exc: BaseException) -> str:
    """One line: the exception's first line plus the compiler's first ``error:`` line when there is one."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    head = f"{type(exc).__name__}: {lines[0] if lines else ''}"[:200]
    err = next((ln for ln in lines[1:] if "error" in ln.lower()), None)
    return head + (f" ... {err[:200]}" if err else "")
