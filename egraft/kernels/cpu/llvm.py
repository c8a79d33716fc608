"""llvmlite set-up: the host target machine, the -O3 pipeline and JIT compilation of a
module, with the compiled object code cached on disk.

One :class:`JitModule` owns one MCJIT engine; its functions stay callable as long as the
object lives. Compilation optimizes for the host CPU's real features (AVX-512 where
present, AVX2 elsewhere) with loop and SLP vectorization on.

Example:
    >>> mod = jit_compile(module_text)                       # doctest: +SKIP
    >>> address = mod.address("relu_0")                      # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import os
import threading
from functools import cache
from pathlib import Path

import llvmlite
import llvmlite.binding as llvm

_LOCK = threading.Lock()


@cache
def _initialized() -> bool:
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    return True


@cache
def host_cpu() -> tuple[str, str, str]:
    """(triple, cpu name, feature string) of this machine, as LLVM sees it."""
    _initialized()
    return llvm.get_process_triple(), llvm.get_host_cpu_name(), llvm.get_host_cpu_features().flatten()


def host_vector_bits() -> int:
    """The widest float vector the host has: 512 with AVX-512F, 256 with AVX, else 128."""
    features = host_cpu()[2].split(",")
    if "+avx512f" in features:
        return 512
    if "+avx" in features:
        return 256
    return 128


def _target_machine():
    triple, cpu, features = host_cpu()
    target = llvm.Target.from_triple(triple)
    return target.create_target_machine(cpu=cpu, features=features, opt=3, jit=True)


def cache_dir() -> Path:
    """Where compiled objects are kept: ``$EGRAFT_CACHE_DIR``, else ``$XDG_CACHE_HOME/egraft``,
    else ``~/.cache/egraft`` (``objects/`` below it)."""
    if os.environ.get("EGRAFT_CACHE_DIR"):
        return Path(os.environ["EGRAFT_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "egraft"


def object_key(module_text: str) -> str:
    """The cache key of a module's object code: its IR, the host CPU and llvmlite's version."""
    h = hashlib.sha256()
    for part in (module_text, *host_cpu(), llvmlite.__version__):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


class JitModule:
    """A compiled module: function addresses by name; keep it alive while they are called.

    Attributes:
        cached: True when the object code came from the disk cache (no LLVM passes ran).
        seconds: time spent parsing, optimizing and generating code.
    """

    def __init__(self, module_text: str, use_cache: bool = True):
        import time

        _initialized()
        start = time.perf_counter()
        self.key = object_key(module_text)
        path = cache_dir() / "objects" / f"{self.key}.o"
        self.cached = use_cache and path.is_file()
        with _LOCK:
            module = llvm.parse_assembly(module_text)
            module.verify()
            self._tm = _target_machine()
            if not self.cached:
                pto = llvm.create_pipeline_tuning_options(speed_level=3)
                pto.loop_vectorization = True
                pto.slp_vectorization = True
                pto.loop_unrolling = True
                pto.loop_interleaving = True
                builder = llvm.create_pass_builder(self._tm, pto)
                builder.getModulePassManager().run(module, builder)
            self._engine = llvm.create_mcjit_compiler(module, self._tm)
            if use_cache:
                self._engine.set_object_cache(self._store(path), self._load(path))
            self._engine.finalize_object()
        self.seconds = time.perf_counter() - start

    @staticmethod
    def _store(path: Path):
        def notify(module, buffer: bytes) -> None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_bytes(buffer)
                tmp.replace(path)  # atomic: a reader never sees half a file
            except OSError:
                pass  # a read-only cache only costs the next compile its time
        return notify

    @staticmethod
    def _load(path: Path):
        def getbuffer(module) -> bytes | None:
            try:
                return path.read_bytes()
            except OSError:
                return None
        return getbuffer

    def address(self, name: str) -> int:
        """The address of function ``name`` (0 when the module has none)."""
        return self._engine.get_function_address(name)
