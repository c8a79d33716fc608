"""CUDA C to a cubin for an explicit architecture, with no GPU: CuPy's binding of NVRTC
(``cupy.cuda.nvrtc``; CuPy's own ``compile_with_cache`` asks the device for its
architecture, so it is not used). ptxas' verbose report gives each function's registers,
spills, shared memory and stack, read here into :class:`Resources`.

Cubins are cached on disk under ``<cache dir>/cuda/``, keyed by the SHA-256 of the source,
the architecture, the options and NVRTC's version: a kernel shared by two models (or two
runs) compiles once. Modules compile on a thread pool (NVRTC releases the interpreter lock).

Example:
    >>> module = compile_source(kernel.source, "sm_90")          # doctest: +SKIP
    >>> module.resources["eg_relu"].registers                    # doctest: +SKIP
    8
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from egraft.errors import EgraftError

#: The architecture compiled for when none is given (the H200 and H100: Hopper).
DEFAULT_ARCH = "sm_90"
#: NVRTC options besides the architecture.
OPTIONS = ("--std=c++17", "--ptxas-options=-v")
_ARCH = re.compile(r"sm_\d{2,3}a?")


class CudaToolkitMissing(EgraftError):
    """CuPy or NVRTC is not installed: nothing can compile CUDA C."""


class CudaCompileError(Exception):
    """NVRTC refused generated code (a bug in a generator: the log says where)."""


@dataclass(frozen=True)
class Resources:
    """What ptxas reports for one function."""

    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    shared_bytes: int = 0
    stack_bytes: int = 0

    @property
    def spill_bytes(self) -> int:
        return self.spill_stores + self.spill_loads


@dataclass
class CompiledModule:
    """A cubin and its functions' resources."""

    cubin: bytes
    arch: str
    resources: dict[str, Resources] = field(default_factory=dict)
    seconds: float = 0.0
    cached: bool = False


def check_arch(arch: str) -> str:
    """``arch`` when it names a real architecture (``sm_80``, ``sm_90``, ``sm_90a``), else an error.

    Example:
        >>> check_arch("sm_90")
        'sm_90'
    """
    if not _ARCH.fullmatch(arch or ""):
        raise EgraftError(f"--arch {arch}: not a CUDA architecture; write it as sm_XX (sm_90 for an H100 or H200)")
    return arch


def nvrtc():
    """CuPy's NVRTC binding, or :class:`CudaToolkitMissing` naming what to install."""
    try:
        from cupy.cuda import nvrtc as binding

        binding.getVersion()
    except Exception as e:  # ImportError, or the NVRTC library missing under an installed CuPy
        raise CudaToolkitMissing(
            "compiling for --target cuda needs CuPy and NVRTC (no GPU needed): "
            "pip install 'egraft[cuda]' (cupy-cuda12x and nvidia-cuda-nvrtc-cu12); "
            f"the import failed: {type(e).__name__}: {e}") from None
    return binding


def parse_ptxas_log(log: str) -> dict[str, Resources]:
    """Each function's resources from ptxas' ``-v`` report.

    Example:
        >>> log = '''ptxas info    : Compiling entry function 'k' for 'sm_90'
        ... ptxas         .     0 bytes stack frame, 4 bytes spill stores, 8 bytes spill loads
        ... ptxas info    : Used 38 registers, used 1 barriers, 8704 bytes smem'''
        >>> parse_ptxas_log(log)["k"]
        Resources(registers=38, spill_stores=4, spill_loads=8, shared_bytes=8704, stack_bytes=0)
    """
    out: dict[str, Resources] = {}
    current, fields = None, {}
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            if current is not None:
                out[current] = Resources(**fields)
            current, fields = m.group(1), {}
            continue
        if current is None:
            continue
        if m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line):
            fields.update(stack_bytes=int(m[1]), spill_stores=int(m[2]), spill_loads=int(m[3]))
        if m := re.search(r"Used (\d+) registers", line):
            fields["registers"] = int(m[1])
        if m := re.search(r"(\d+) bytes smem", line):
            fields["shared_bytes"] = int(m[1])
    if current is not None:
        out[current] = Resources(**fields)
    return out


def cache_folder() -> Path:
    from egraft.kernels.cpu.llvm import cache_dir

    return cache_dir() / "cuda"


def _key(source: str, arch: str, version: tuple) -> str:
    text = "\0".join([source, arch, *OPTIONS, repr(version)])
    return hashlib.sha256(text.encode()).hexdigest()


def compile_source(source: str, arch: str = DEFAULT_ARCH, name: str = "kernel.cu",
                   use_cache: bool = True) -> CompiledModule:
    """Compile one translation unit for ``arch``; :class:`CudaCompileError` with the
    compiler's log when NVRTC refuses it."""
    binding = nvrtc()
    check_arch(arch)
    version = tuple(binding.getVersion())
    path = cache_folder() / f"{_key(source, arch, version)}.cubin"
    meta = path.with_suffix(".json")
    if use_cache and path.exists() and meta.exists():
        try:
            resources = {k: Resources(**v) for k, v in json.loads(meta.read_text())["resources"].items()}
            return CompiledModule(path.read_bytes(), arch, resources, 0.0, cached=True)
        except (OSError, ValueError, TypeError, KeyError):
            pass  # damaged: compiled again, and rewritten
    start = time.perf_counter()
    program = binding.createProgram(source, name, [], [])
    try:
        try:
            binding.compileProgram(program, [f"-arch={arch}", *OPTIONS])
        except binding.NVRTCError as e:
            log = binding.getProgramLog(program)
            raise CudaCompileError(f"NVRTC refused {name} for {arch}: {e}\n{log}\n--- source ---\n{source}") from None
        log = binding.getProgramLog(program)
        cubin = binding.getCUBIN(program)
    finally:
        binding.destroyProgram(program)
    module = CompiledModule(cubin, arch, parse_ptxas_log(log), time.perf_counter() - start)
    if use_cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(cubin)
            os.replace(tmp, path)
            meta.write_text(json.dumps({"arch": arch, "resources": {k: asdict(v) for k, v in
                                                                     module.resources.items()}}))
        except OSError:
            pass  # a read-only cache: compiled each time
    return module


def compile_sources(sources: Sequence[str], arch: str = DEFAULT_ARCH, use_cache: bool = True,
                    threads: int | None = None) -> list[CompiledModule]:
    """Compile many translation units (in order) on a thread pool."""
    nvrtc()
    workers = threads or min(8, os.cpu_count() or 1)
    if len(sources) <= 1 or workers <= 1:
        return [compile_source(s, arch, use_cache=use_cache) for s in sources]
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda s: compile_source(s, arch, use_cache=use_cache), sources))


__all__ = ["compile_source", "compile_sources", "CompiledModule", "Resources", "parse_ptxas_log", "check_arch",
           "nvrtc", "CudaToolkitMissing", "CudaCompileError", "DEFAULT_ARCH"]
