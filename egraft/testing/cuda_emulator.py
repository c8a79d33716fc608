"""Run generated CUDA C on the CPU, so that the CUDA kernels' numbers are checked on a
machine without a GPU: the same translation unit NVRTC compiles for ``sm_90`` is compiled
by ``g++`` (C++20) with a shim header that makes ``threadIdx``/``blockIdx`` thread-local
variables, ``__syncthreads`` a ``std::barrier`` over the block's threads, warp shuffles an
exchange between the 32 threads of a warp, and ``__shared__`` arrays ``static`` (one
block runs at a time). A function that never synchronizes runs its threads one after the
other on one OS thread; one that does runs each of the block's threads on its own.

What it checks: indexing, tiling, edge handling, reductions and epilogues, i.e. what the
kernel computes. What it cannot: speed, coalescing, races that only a GPU's scheduling
shows, or warp-synchronous code without ``__syncwarp`` (every lane here runs freely).

Example:
    >>> emulator = Emulator()                                            # doctest: +SKIP
    >>> emulator.run(kernel, {("in", 0): x, ("out", 0): y}, {"n": 7})    # doctest: +SKIP
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from functools import lru_cache
from pathlib import Path

import numpy as np

from egraft.kernels.cuda.emit import CudaKernel

SHIM = r"""
#include <cmath>
#include <cstdint>
#include <cstring>
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __shared__ static
#define __align__(n) alignas(n)
struct eg_dim3 { unsigned x = 0, y = 0, z = 0; };
extern thread_local eg_dim3 threadIdx, blockIdx;
extern thread_local unsigned eg_linear;
extern eg_dim3 blockDim, gridDim;
extern unsigned char* eg_dynamic_shared;
extern "C" void eg_syncthreads();
extern "C" void eg_syncwarp();
extern "C" void eg_exchange(const void* value, unsigned source_lane, void* out, unsigned size);
extern "C" void eg_lock();
extern "C" void eg_unlock();
#define EG_DYNAMIC_SHARED(type, name) type* name = reinterpret_cast<type*>(eg_dynamic_shared)
inline void __syncthreads() { eg_syncthreads(); }
inline void __syncwarp(unsigned = 0xffffffffu) { eg_syncwarp(); }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
template <class T> T eg_shfl(T v, unsigned src) { T out; eg_exchange(&v, src % 32, &out, sizeof(T)); return out; }
template <class T> T __shfl_xor_sync(unsigned, T v, int mask, int = 32) { return eg_shfl(v, (eg_linear % 32) ^ mask); }
template <class T> T __shfl_down_sync(unsigned, T v, unsigned d, int = 32) {
    unsigned l = eg_linear % 32; return eg_shfl(v, l + d < 32 ? l + d : l);
}
template <class T> T __shfl_sync(unsigned, T v, int src, int = 32) { return eg_shfl(v, (unsigned)src); }
template <class T> T atomicAdd(T* p, T v) { eg_lock(); T old = *p; *p = old + v; eg_unlock(); return old; }
template <class T> T atomicMax(T* p, T v) { eg_lock(); T old = *p; *p = old > v ? old : v; eg_unlock(); return old; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __fdividef(float a, float b) { return a / b; }
template <class T> T __ldg(const T* p) { return *p; }
using std::sqrt; using std::exp;
"""

#: The emulator's runtime: the block's threads, barriers and warp exchanges, compiled once
#: per machine into a library the kernels' libraries link against (so each kernel compiles
#: without the thread headers: a quarter of the time).
RUNTIME = r"""
#include <algorithm>
#include <barrier>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <ucontext.h>
#include <vector>
struct eg_dim3 { unsigned x = 0, y = 0, z = 0; };
thread_local eg_dim3 threadIdx, blockIdx;
thread_local unsigned eg_linear = 0;
eg_dim3 blockDim, gridDim;
unsigned char* eg_dynamic_shared = nullptr;
static std::barrier<>* eg_block_barrier = nullptr;
struct eg_warp { std::barrier<>* barrier; alignas(8) unsigned char values[32][8]; };
static eg_warp* eg_warps = nullptr;
static std::mutex eg_atomic_lock;
// Fibers: a block's CUDA threads as coroutines on one OS thread, switched at barriers (no
// kernel scheduling: a loaded host does not slow a barrier down).
struct eg_fiber { ucontext_t context; unsigned thread; bool done; };
static bool eg_fibers_on = false;
static ucontext_t eg_scheduler;
static eg_fiber* eg_fiber_list = nullptr;
static unsigned eg_current = 0, eg_block_threads = 0;
static unsigned eg_block_arrived = 0, eg_block_phase = 0;
static std::vector<unsigned> eg_warp_arrived, eg_warp_phase, eg_warp_lanes;
static unsigned long long eg_progress = 0;  // barrier arrivals and finished threads: a pass without any is a deadlock
static void eg_fiber_wait(unsigned& arrived, unsigned& phase, unsigned count) {
    const unsigned mine = phase;
    ++eg_progress;
    if (++arrived == count) { arrived = 0; ++phase; return; }
    while (phase == mine) swapcontext(&eg_fiber_list[eg_current].context, &eg_scheduler);
}
static void eg_block_wait() {
    if (eg_fibers_on) eg_fiber_wait(eg_block_arrived, eg_block_phase, eg_block_threads);
    else eg_block_barrier->arrive_and_wait();
}
static void eg_warp_wait() {
    const unsigned w = eg_linear / 32;
    if (eg_fibers_on) eg_fiber_wait(eg_warp_arrived[w], eg_warp_phase[w], eg_warp_lanes[w]);
    else eg_warps[w].barrier->arrive_and_wait();
}
extern "C" void eg_syncthreads() { eg_block_wait(); }
extern "C" void eg_syncwarp() { eg_warp_wait(); }
extern "C" void eg_exchange(const void* value, unsigned source_lane, void* out, unsigned size) {
    eg_warp& w = eg_warps[eg_linear / 32];
    std::memcpy(w.values[eg_linear % 32], value, size);
    eg_warp_wait();
    std::memcpy(out, w.values[source_lane], size);
    eg_warp_wait();
}
static void (*eg_fiber_call)(void**) = nullptr;
static void** eg_fiber_args = nullptr;
static void eg_fiber_main() {
    eg_fiber_call(eg_fiber_args);
    ++eg_progress;
    eg_fiber_list[eg_current].done = true;
    swapcontext(&eg_fiber_list[eg_current].context, &eg_scheduler);
}
extern "C" void eg_lock() { eg_atomic_lock.lock(); }
extern "C" void eg_unlock() { eg_atomic_lock.unlock(); }
extern "C" int eg_launch(void (*call)(void**), void** args, unsigned gx, unsigned gy, unsigned gz,
                         unsigned bx, unsigned by, unsigned bz, unsigned long long shared, int threaded) {
    blockDim = {bx, by, bz}; gridDim = {gx, gy, gz};
    const unsigned n = bx * by * bz;
    const unsigned long long blocks = (unsigned long long)gx * gy * gz;
    std::vector<unsigned char> dynamic(shared + 64);
    eg_dynamic_shared = dynamic.data() + (64 - ((uintptr_t)dynamic.data() % 64)) % 64;
    auto set_block = [&](unsigned long long b) {
        blockIdx = {unsigned(b % gx), unsigned((b / gx) % gy), unsigned(b / ((unsigned long long)gx * gy))};
    };
    auto set_thread = [&](unsigned t) { eg_linear = t; threadIdx = {t % bx, (t / bx) % by, t / (bx * by)}; };
    if (!threaded) {
        for (unsigned long long b = 0; b < blocks; ++b)
            for (unsigned t = 0; t < n; ++t) { set_block(b); set_thread(t); call(args); }
        return 0;
    }
    std::vector<eg_warp> warps((n + 31) / 32);
    eg_warps = warps.data();
    if (threaded == 2) {  // fibers
        const size_t stack_bytes = 256 * 1024;
        std::unique_ptr<char[]> stacks(new char[stack_bytes * n]);
        std::vector<eg_fiber> fibers(n);
        eg_fiber_list = fibers.data();
        eg_block_threads = n;
        eg_warp_arrived.assign(warps.size(), 0);
        eg_warp_phase.assign(warps.size(), 0);
        eg_warp_lanes.assign(warps.size(), 0);
        for (size_t w = 0; w < warps.size(); ++w) eg_warp_lanes[w] = std::min(32u, n - unsigned(32 * w));
        eg_fiber_call = call;
        eg_fiber_args = args;
        eg_fibers_on = true;
        for (unsigned long long b = 0; b < blocks; ++b) {
            eg_block_arrived = 0;
            for (unsigned t = 0; t < n; ++t) {
                fibers[t].thread = t; fibers[t].done = false;
                getcontext(&fibers[t].context);
                fibers[t].context.uc_stack.ss_sp = stacks.get() + stack_bytes * t;
                fibers[t].context.uc_stack.ss_size = stack_bytes;
                fibers[t].context.uc_link = nullptr;
                makecontext(&fibers[t].context, eg_fiber_main, 0);
            }
            for (unsigned remaining = n; remaining > 0;) {
                remaining = 0;
                const unsigned long long before = eg_progress;
                for (unsigned t = 0; t < n; ++t) {
                    if (fibers[t].done) continue;
                    eg_current = t;
                    set_block(b);
                    set_thread(t);
                    swapcontext(&eg_scheduler, &fibers[t].context);
                    if (!fibers[t].done) ++remaining;
                }
                if (remaining > 0 && eg_progress == before) {  // threads wait at a barrier others never reach
                    eg_fibers_on = false;
                    return -1;
                }
            }
        }
        eg_fibers_on = false;
        return 0;
    }
    std::barrier<> block(n), end(n);
    eg_block_barrier = &block;
    std::vector<std::unique_ptr<std::barrier<>>> owned;
    for (size_t w = 0; w < warps.size(); ++w) {
        owned.emplace_back(new std::barrier<>(std::min(32u, n - unsigned(32 * w))));
        warps[w].barrier = owned.back().get();
    }
    std::vector<std::thread> threads;
    for (unsigned t = 0; t < n; ++t)
        threads.emplace_back([&, t] {
            set_thread(t);
            for (unsigned long long b = 0; b < blocks; ++b) { set_block(b); call(args); end.arrive_and_wait(); }
        });
    for (auto& th : threads) th.join();
    return 0;
}
"""

_LOCK = threading.Lock()
#: How a launch runs a block's threads: one after the other (code that never synchronizes),
#: as fibers switched at barriers on one OS thread (the default), or as OS threads
#: (``$EGRAFT_EMULATOR_FIBERS=0``).
SERIAL, OS_THREADS, FIBERS = 0, 1, 2


def synchronizes(kernel: CudaKernel) -> bool:
    """Whether ``kernel``'s own code (its helpers and functions, not the prelude's unused
    helpers) synchronizes threads: then a block's threads run as fibers (or OS threads)."""
    return _synchronizes(kernel.source)


@lru_cache(maxsize=4096)
def _synchronizes(source: str) -> bool:
    """:func:`synchronizes` by source text, once per kernel (a model's run launches each many times)."""
    from egraft.kernels.cuda.emit import PRELUDE

    own = source.replace(PRELUDE.strip(), "")
    return any(word in own for word in ("__syncthreads", "__shfl", "__syncwarp", "eg_warp_sum", "eg_warp_max"))


class EmulatorUnavailable(RuntimeError):
    """No C++20 compiler (``g++``) on this machine."""


class Emulator:
    """Compiles kernels with ``g++`` into shared libraries (cached by source) and runs them."""

    def __init__(self, folder: str | Path | None = None):
        self.compiler = shutil.which(os.environ.get("CXX", "g++"))
        if self.compiler is None:
            raise EmulatorUnavailable("the CUDA emulator needs g++ (C++20)")
        self.folder = Path(folder or Path(tempfile.gettempdir()) / f"egraft-cuda-emulator-{os.getuid()}")
        self.folder.mkdir(parents=True, exist_ok=True)
        self.libraries: dict[str, ctypes.CDLL] = {}
        self._locks: dict[str, threading.Lock] = {}
        self.runtime = self._build("rt", RUNTIME, global_symbols=True)
        self.runtime.eg_launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_uint] * 6 + \
            [ctypes.c_ulonglong, ctypes.c_int]

    def _build(self, prefix: str, text: str, global_symbols: bool = False) -> ctypes.CDLL:
        """``text`` compiled by g++ into a shared library in the folder (once: cached by its
        digest) and loaded; ``global_symbols`` makes its symbols visible to later libraries."""
        digest = hashlib.sha256(text.encode()).hexdigest()[:24]
        path = self.folder / f"{prefix}{digest}.so"
        if not path.exists():
            self.folder.mkdir(parents=True, exist_ok=True)
            tag = f"{os.getpid()}.{threading.get_ident()}"
            source = self.folder / f"{prefix}{digest}.{tag}.cpp"
            source.write_text(text)
            tmp = path.with_suffix(f".{tag}.tmp")
            done = subprocess.run([self.compiler, "-std=c++20", "-O1", "-fPIC", "-shared", "-pthread", "-w",
                                   "-o", str(tmp), str(source)], capture_output=True, text=True)
            source.unlink(missing_ok=True)
            if done.returncode != 0:
                raise RuntimeError(f"g++ refused the kernel:\n{done.stderr[-4000:]}\n--- source ---\n{text}")
            os.replace(tmp, path)
        return ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL if global_symbols else ctypes.RTLD_LOCAL)

    def library(self, kernel: CudaKernel) -> ctypes.CDLL:
        """The kernel's translation unit compiled for the CPU (with a wrapper per function)."""
        wrappers = []
        for launch in kernel.launches:
            args = []
            for k, p in enumerate(kernel.params):
                args.append(f"*({p.ctype}*)a[{k}]" if p.role[0] == "dim" else f"({p.ctype}*)a[{k}]")
            wrappers.append(f'extern "C" void eg_call_{launch.function}(void** a) '
                            f'{{ {launch.function}({", ".join(args)}); }}')
        text = SHIM + kernel.source + "\n" + "\n".join(dict.fromkeys(wrappers)) + "\n"
        digest = hashlib.sha256(text.encode()).hexdigest()[:24]
        with _LOCK:
            lock = self._locks.setdefault(digest, threading.Lock())
        with lock:  # one compile per kernel; different kernels compile at once
            if digest not in self.libraries:
                self.libraries[digest] = self._build("k", text)
            return self.libraries[digest]

    def launch(self, kernel: CudaKernel, addresses: list[int], bindings: dict[str, int]) -> None:
        """Run every launch of ``kernel`` on raw host addresses (one per operand parameter, in
        order; the dims come from ``bindings``): the emulated device of
        :class:`egraft.lowering.cuda_runtime.EmulatedDevice`."""
        if kernel.library is not None:  # numpy stands in for the vendor library
            from egraft.kernels.cuda.library import host_views, run_library

            run_library(kernel.library, np, host_views(kernel.library, list(addresses), bindings))
            return
        library = self.library(kernel)
        keep = []
        pointers = (ctypes.c_void_p * len(kernel.params))()
        operand = iter(addresses)
        for k, p in enumerate(kernel.params):
            if p.role[0] == "dim":
                value = np.array([bindings[p.role[1]]], np.int64)
                keep.append(value)
                pointers[k] = value.ctypes.data
            else:
                pointers[k] = next(operand)
        mode = (FIBERS if os.environ.get("EGRAFT_EMULATOR_FIBERS", "1") != "0" else OS_THREADS) \
            if synchronizes(kernel) else SERIAL
        for launch in kernel.launches:
            call = getattr(library, f"eg_call_{launch.function}")
            status = self.runtime.eg_launch(ctypes.cast(call, ctypes.c_void_p), pointers, *launch.grid_at(bindings),
                                            *launch.block, launch.shared_bytes, mode)
            if status != 0:
                raise RuntimeError(f"{launch.function}: some threads of a block wait at a barrier that others never "
                                   "reach (an early return before __syncthreads)")
        del keep

    def run(self, kernel: CudaKernel, arrays: dict[tuple, np.ndarray], bindings: dict[str, int] | None = None) -> None:
        """Run every launch of ``kernel`` in order on ``arrays`` (by operand role, C-contiguous,
        of the kernel's element types; outputs are written in place)."""
        addresses = []
        for p in kernel.params:
            if p.role[0] != "dim":
                array = arrays[p.role]
                if not array.flags.c_contiguous:
                    raise ValueError(f"operand {p.role} is not C-contiguous")
                addresses.append(array.ctypes.data)
        self.launch(kernel, addresses, dict(bindings or {}))


def emulate_node(node, graph, inputs: list[np.ndarray], bindings: dict[str, int] | None = None,
                 opset: int | None = None) -> list[np.ndarray]:
    """Generate ``node``'s CUDA kernel, run it in the emulator on ``inputs`` (one per input
    slot, ``None`` for an absent one) and return its outputs, shaped by the node's output
    types at ``bindings``.

    Example:
        >>> y, = emulate_node(graph.nodes[0], graph, [x])     # doctest: +SKIP
    """
    from egraft.ir.dims import evaluate_dim
    from egraft.ir.infer import node_opset
    from egraft.kernels.cuda import generate

    bindings = dict(bindings or {})
    kernel = generate(node, graph, opset or node_opset(graph, node))
    arrays: dict[tuple, np.ndarray] = {}
    for i, x in enumerate(inputs):
        if x is not None:
            arrays[("in", i)] = np.ascontiguousarray(x, dtype=node.inputs[i].type.dtype.numpy)
    outputs = []
    for i, v in enumerate(node.outputs):
        if v is None:  # an absent optional output (an LSTM's Y)
            outputs.append(None)
            continue
        shape = tuple(int(evaluate_dim(d, bindings)) for d in v.type.shape)
        out = np.full(shape, np.nan, v.type.dtype.numpy) if v.type.dtype.numpy.kind == "f" \
            else np.zeros(shape, v.type.dtype.numpy)
        arrays[("out", i)] = out
        outputs.append(out)
    emulator().run(kernel, arrays, bindings)
    return outputs


_DEFAULT: Emulator | None = None


def emulator() -> Emulator:
    """The process's emulator (compiled kernels are kept)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = Emulator()
    return _DEFAULT


__all__ = ["Emulator", "emulator", "emulate_node", "EmulatorUnavailable", "SHIM"]
