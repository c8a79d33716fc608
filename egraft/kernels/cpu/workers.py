"""Native worker threads for parallel kernels: a part handed over in about a microsecond,
not the tens of microseconds a Python thread pool takes (which would make splitting
anything but the largest kernels a loss).

Each worker is a Python daemon thread that calls ``egraft_worker`` once, through ctypes
(which releases the interpreter lock for as long as the call lasts): the native loop
never returns. It waits for a new *generation* of the shared state, runs its part of the
posted kernel, counts itself done and waits again: spinning (``pause``) for a while after
each job, then sleeping on a futex until the next post wakes it. A run of kernels
(``egraft_run_steps``) that splits any wakes the workers as it starts and keeps them
spinning until it ends: woken per kernel, a worker missed the parts of kernels under
~100 us (ShuffleNet at 2 threads: 0.95x its 1-thread time, 0.74x spinning through the run).

``egraft_parallel(state, kernel, table, dims, parts, scratch)`` posts a kernel; the calling
thread and the workers then claim its parts one at a time (a compare-and-swap), so a
worker slow to wake costs nothing: the caller runs the parts nobody claimed, then spins
until every claimed part is done. Each thread claims its own part first (the caller part
0, worker ``i`` part ``i + 1``), so a kernel's share of rows or channels stays on the same
core from one kernel to the next, in that core's cache. ``egraft_run_steps`` runs a
whole run of kernels in one call (the runtime's schedule: one foreign call per run). One caller owns the
workers at a time (a compare-and-swap on ``busy``); a caller that finds them busy runs
its kernel alone, so concurrent callers never oversubscribe the cores.

Example:
    >>> workers = NativeWorkers([scratch])                               # doctest: +SKIP
    >>> workers.run(kernel_address, table, dims, parts=2, scratch=s)    # doctest: +SKIP
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np
from llvmlite import ir

from egraft.kernels.cpu.llvm import JitModule, host_cpu

I32 = ir.IntType(32)
I64 = ir.IntType(64)
I8P = ir.IntType(8).as_pointer()
KERNEL = ir.FunctionType(ir.VoidType(), [I8P.as_pointer(), I64.as_pointer(), I64, I64, I8P])

#: Fields of the shared state (one ``i64`` each). ``CLAIM`` is the posting's tag (the low
#: 32 bits of its generation) in the high half and the next unclaimed part in the low half.
GENERATION, DONE, KERNEL_FN, TABLE, DIMS, PARTS, SLEEPING, BUSY, CLAIM, RUNS = range(10)
STATE_FIELDS = 10
#: ``pause`` iterations a worker spins after a job before it sleeps: tens of microseconds
#: (``pause`` takes about 140 cycles on Intel since Skylake, a few dozen on AMD). 10,000
#: (half a millisecond on Intel) outlasted a whole 50 us model run: the spinning worker
#: then slowed the caller on a 2-vCPU host (akiki_vad at 2 threads 1.06x its 1-thread
#: time, 1.01x with 1,000; ppocr_v4_rec and SqueezeNet at 2 threads kept their speed).
SPIN = 1000
#: Parts a kernel is split into at most: one bit each in ``CLAIM``'s low half.
MAX_PARTS = 32
SYS_FUTEX = 202  # x86-64 Linux
FUTEX_WAIT_PRIVATE, FUTEX_WAKE_PRIVATE = 128, 129


def _module_text() -> str:
    module = ir.Module(name="egraft_workers")
    module.triple = host_cpu()[0]
    syscall = ir.Function(module, ir.FunctionType(I64, [I64], var_arg=True), "syscall")
    pause = ir.Function(module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse2.pause")

    def field(b: ir.IRBuilder, state: ir.Value, index: int) -> ir.Value:
        return b.gep(state, [ir.Constant(I64, index)])

    def atomic_load(b: ir.IRBuilder, pointer: ir.Value) -> ir.Value:
        return b.load_atomic(pointer, "seq_cst", 8)

    def atomic_store(b: ir.IRBuilder, value: ir.Value, pointer: ir.Value) -> None:
        b.store_atomic(value, pointer, "seq_cst", 8)

    def futex(b: ir.IRBuilder, state: ir.Value, op: int, value: ir.Value) -> None:
        word = b.ptrtoint(field(b, state, GENERATION), I64)  # the generation's low 32 bits (little-endian)
        b.call(syscall, [ir.Constant(I64, SYS_FUTEX), word, ir.Constant(I64, op), value, ir.Constant(I64, 0),
                         ir.Constant(I64, 0), ir.Constant(I64, 0)])

    # ---- void egraft_claim_parts(i64* state, i64 tag, i64 kernel, i64 table, i64 dims, i64 parts, i8* scratch,
    #                              i64 home)
    # claims the posting's parts one at a time and runs each, counting it done: its own part
    # ``home`` first, then any part nobody has claimed (a compare-and-swap that sets the part's
    # bit in CLAIM, which only succeeds while CLAIM still carries this posting's tag)
    claim = ir.Function(module, ir.FunctionType(ir.VoidType(), [I64.as_pointer(), I64, I64, I64, I64, I64, I8P,
                                                                I64]),
                        "egraft_claim_parts")
    claim.linkage = "internal"
    c_state, c_tag, c_kernel, c_table, c_dims, c_parts, c_scratch, c_home = claim.args
    c_entry, c_loop, c_try, c_run, c_done = (claim.append_basic_block(n)
                                             for n in ("entry", "loop", "try", "run", "done"))
    cttz = ir.Function(module, ir.FunctionType(I64, [I64, ir.IntType(1)]), "llvm.cttz.i64")
    b = ir.IRBuilder(c_entry)
    b.branch(c_loop)
    b.position_at_end(c_loop)
    current = atomic_load(b, field(b, c_state, CLAIM))
    mine = b.icmp_signed("==", b.lshr(current, ir.Constant(I64, 32)), c_tag)
    taken = b.or_(b.and_(current, ir.Constant(I64, 0xFFFFFFFF)), ir.Constant(I64, -1 << 32))
    home_free = b.and_(b.icmp_signed("<", c_home, c_parts),
                       b.icmp_signed("==", b.and_(taken, b.shl(ir.Constant(I64, 1), c_home)), ir.Constant(I64, 0)))
    first_free = b.call(cttz, [b.xor(taken, ir.Constant(I64, -1)), ir.Constant(ir.IntType(1), 1)])
    next_part = b.select(home_free, c_home, first_free)
    b.cbranch(b.and_(mine, b.icmp_signed("<", next_part, c_parts)), c_try, c_done)
    b.position_at_end(c_try)
    swapped = b.cmpxchg(field(b, c_state, CLAIM), current, b.or_(current, b.shl(ir.Constant(I64, 1), next_part)),
                        "seq_cst", "seq_cst")
    b.cbranch(b.extract_value(swapped, 1), c_run, c_loop)
    b.position_at_end(c_run)
    b.call(b.inttoptr(c_kernel, KERNEL.as_pointer()),
           [b.inttoptr(c_table, I8P.as_pointer()), b.inttoptr(c_dims, I64.as_pointer()), next_part, c_parts,
            c_scratch])
    b.atomic_rmw("add", field(b, c_state, DONE), ir.Constant(I64, 1), "seq_cst")
    b.branch(c_loop)
    b.position_at_end(c_done)
    b.ret_void()

    def tag_of(b: ir.IRBuilder, generation: ir.Value) -> ir.Value:
        return b.and_(generation, ir.Constant(I64, 0xFFFFFFFF))

    # ---- void egraft_worker(i64* state, i64 index, i8* scratch): never returns
    worker = ir.Function(module, ir.FunctionType(ir.VoidType(), [I64.as_pointer(), I64, I8P]), "egraft_worker")
    state, index, scratch = worker.args
    entry, wait, spin, sleep, job = (worker.append_basic_block(n) for n in ("entry", "wait", "spin", "sleep", "job"))
    b = ir.IRBuilder(entry)
    seen = b.alloca(I64, name="seen")
    spins = b.alloca(I64, name="spins")
    # generation 0 is the one the workers are created in: reading it here instead would race with
    # the first post (a worker that starts late would take that job's generation as already seen)
    b.store(ir.Constant(I64, 0), seen)
    b.store(ir.Constant(I64, 0), spins)
    b.branch(wait)
    b.position_at_end(wait)
    generation = atomic_load(b, field(b, state, GENERATION))
    b.cbranch(b.icmp_signed("!=", generation, b.load(seen)), job, spin)
    b.position_at_end(spin)
    count = b.add(b.load(spins), ir.Constant(I64, 1))
    b.store(count, spins)
    keep_spinning = worker.append_basic_block("pause")
    # while a run of kernels with split ones is under way (RUNS > 0), a worker keeps spinning:
    # woken from its futex for each split kernel, it came too late to take a part of one
    # under ~100 us, and the caller paid the wake-up's system call instead
    running = b.icmp_signed(">", atomic_load(b, field(b, state, RUNS)), ir.Constant(I64, 0))
    b.cbranch(b.or_(b.icmp_signed("<", count, ir.Constant(I64, SPIN)), running), keep_spinning, sleep)
    b.position_at_end(keep_spinning)
    b.call(pause, [])
    b.branch(wait)
    b.position_at_end(sleep)  # announce, re-check, then sleep until the generation moves on
    b.atomic_rmw("add", field(b, state, SLEEPING), ir.Constant(I64, 1), "seq_cst")
    still = b.icmp_signed("==", atomic_load(b, field(b, state, GENERATION)), b.load(seen))
    with b.if_then(still):
        futex(b, state, FUTEX_WAIT_PRIVATE, b.and_(b.load(seen), ir.Constant(I64, 0xFFFFFFFF)))
    b.atomic_rmw("sub", field(b, state, SLEEPING), ir.Constant(I64, 1), "seq_cst")
    b.store(ir.Constant(I64, 0), spins)
    b.branch(wait)
    b.position_at_end(job)
    b.store(generation, seen)
    b.store(ir.Constant(I64, 0), spins)
    # the posting's fields were stored before its generation: read them, then claim parts while the
    # CLAIM tag is still this generation's (a worker that comes late, after the caller has done every
    # part and posted again, finds another tag and claims nothing of the new posting with old fields)
    parts = atomic_load(b, field(b, state, PARTS))
    kernel = atomic_load(b, field(b, state, KERNEL_FN))
    table = atomic_load(b, field(b, state, TABLE))
    dims = atomic_load(b, field(b, state, DIMS))
    b.call(claim, [state, tag_of(b, generation), kernel, table, dims, parts, scratch,
                   b.add(index, ir.Constant(I64, 1))])
    b.branch(wait)

    # ---- i64 egraft_parallel(i64* state, i64 kernel, i64 table, i64 dims, i64 parts, i8* scratch, i64 workers)
    # returns the parts it ran in (1 when the workers were busy with another caller's kernel)
    run = ir.Function(module, ir.FunctionType(I64, [I64.as_pointer(), I64, I64, I64, I64, I8P, I64]),
                      "egraft_parallel")
    state, kernel_address, table, dims, parts, scratch, workers = run.args
    entry, alone, post, waiting, finish = (run.append_basic_block(n)
                                           for n in ("entry", "alone", "post", "waiting", "finish"))
    b = ir.IRBuilder(entry)
    kernel = b.inttoptr(kernel_address, KERNEL.as_pointer())
    table_p = b.inttoptr(table, I8P.as_pointer())
    dims_p = b.inttoptr(dims, I64.as_pointer())
    owned = b.cmpxchg(field(b, state, BUSY), ir.Constant(I64, 0), ir.Constant(I64, 1), "seq_cst", "seq_cst")
    b.cbranch(b.extract_value(owned, 1), post, alone)
    b.position_at_end(alone)
    b.call(kernel, [table_p, dims_p, ir.Constant(I64, 0), ir.Constant(I64, 1), scratch])
    b.ret(ir.Constant(I64, 1))
    b.position_at_end(post)
    generation = b.add(atomic_load(b, field(b, state, GENERATION)), ir.Constant(I64, 1))  # only the owner posts
    tag = tag_of(b, generation)
    for slot, value in ((KERNEL_FN, kernel_address), (TABLE, table), (DIMS, dims), (PARTS, parts),
                        (DONE, ir.Constant(I64, 0)), (CLAIM, b.shl(tag, ir.Constant(I64, 32)))):
        atomic_store(b, value, field(b, state, slot))
    atomic_store(b, generation, field(b, state, GENERATION))
    with b.if_then(b.icmp_signed(">", atomic_load(b, field(b, state, SLEEPING)), ir.Constant(I64, 0))):
        futex(b, state, FUTEX_WAKE_PRIVATE, ir.Constant(I64, 0x7FFFFFFF))
    # the caller claims parts too: a worker that is slow to wake leaves its parts to the caller,
    # never a wait for it (the split costs nothing then, instead of a wake-up's latency)
    b.call(claim, [state, tag, kernel_address, table, dims, parts, scratch, ir.Constant(I64, 0)])
    b.branch(waiting)
    b.position_at_end(waiting)
    all_done = b.icmp_signed(">=", atomic_load(b, field(b, state, DONE)), parts)
    not_yet = run.append_basic_block("not_yet")
    b.cbranch(all_done, finish, not_yet)
    b.position_at_end(not_yet)
    b.call(pause, [])
    b.branch(waiting)
    b.position_at_end(finish)
    atomic_store(b, ir.Constant(I64, 0), field(b, state, BUSY))
    b.ret(parts)

    # ---- i64 egraft_ticks(): the CPU's time-stamp counter
    ticks_fn = ir.Function(module, ir.FunctionType(I64, []), "egraft_ticks")
    counter = ir.Function(module, ir.FunctionType(I64, []), "llvm.readcyclecounter")
    b = ir.IRBuilder(ticks_fn.append_basic_block("entry"))
    b.ret(b.call(counter, []))

    # ---- void egraft_run_steps(i64* state, i64 workers, i64* kernels, i64* parts, i64 count,
    #                            i64 table, i64 dims, i8* scratch, i64* ticks)
    # a run of kernels, one after the other: kernel k in parts[k] parts (on the workers when > 1);
    # when ticks is not null, the counter before and after kernel k in ticks[2k], ticks[2k + 1]
    steps = ir.Function(module, ir.FunctionType(ir.VoidType(), [I64.as_pointer(), I64, I64.as_pointer(),
                                                                I64.as_pointer(), I64, I64, I64, I8P,
                                                                I64.as_pointer()]),
                        "egraft_run_steps")
    state, workers, kernels, parts_of, count, table, dims, scratch, ticks = steps.args
    entry, head, body, split, serial, step_done, done = (steps.append_basic_block(n) for n in (
        "entry", "head", "body", "split", "serial", "step_done", "done"))
    b = ir.IRBuilder(entry)
    k = b.alloca(I64, name="k")
    split_any = b.alloca(ir.IntType(1), name="split_any")
    b.store(ir.Constant(ir.IntType(1), 0), split_any)
    b.store(ir.Constant(I64, 0), k)
    scan, scan_body, scan_done = (steps.append_basic_block(n) for n in ("scan", "scan_body", "scan_done"))
    b.branch(scan)
    b.position_at_end(scan)  # does any kernel of the run split?
    at = b.load(k)
    b.cbranch(b.icmp_signed("<", at, count), scan_body, scan_done)
    b.position_at_end(scan_body)
    splits = b.icmp_signed(">", b.load(b.gep(parts_of, [at])), ir.Constant(I64, 1))
    b.store(b.or_(b.load(split_any), splits), split_any)
    b.store(b.add(at, ir.Constant(I64, 1)), k)
    b.branch(scan)
    b.position_at_end(scan_done)
    b.store(ir.Constant(I64, 0), k)
    with b.if_then(b.load(split_any)):  # keep the workers spinning for the run; wake them now, ahead of its first split
        b.atomic_rmw("add", field(b, state, RUNS), ir.Constant(I64, 1), "seq_cst")
        with b.if_then(b.icmp_signed(">", atomic_load(b, field(b, state, SLEEPING)), ir.Constant(I64, 0))):
            futex(b, state, FUTEX_WAKE_PRIVATE, ir.Constant(I64, 0x7FFFFFFF))
    b.branch(head)
    b.position_at_end(head)
    index = b.load(k)
    b.cbranch(b.icmp_signed("<", index, count), body, done)
    b.position_at_end(body)
    timed = b.icmp_unsigned("!=", b.ptrtoint(ticks, I64), ir.Constant(I64, 0))
    with b.if_then(timed):
        b.store(b.call(counter, []), b.gep(ticks, [b.mul(index, ir.Constant(I64, 2))]))
    kernel_address = b.load(b.gep(kernels, [index]))
    parts = b.load(b.gep(parts_of, [index]))
    b.cbranch(b.icmp_signed(">", parts, ir.Constant(I64, 1)), split, serial)
    b.position_at_end(split)
    b.call(run, [state, kernel_address, table, dims, parts, scratch, workers])
    b.branch(step_done)
    b.position_at_end(serial)
    b.call(b.inttoptr(kernel_address, KERNEL.as_pointer()),
           [b.inttoptr(table, I8P.as_pointer()), b.inttoptr(dims, I64.as_pointer()), ir.Constant(I64, 0),
            ir.Constant(I64, 1), scratch])
    b.branch(step_done)
    b.position_at_end(step_done)
    with b.if_then(b.icmp_unsigned("!=", b.ptrtoint(ticks, I64), ir.Constant(I64, 0))):
        b.store(b.call(counter, []), b.gep(ticks, [b.add(b.mul(index, ir.Constant(I64, 2)), ir.Constant(I64, 1))]))
    b.store(b.add(index, ir.Constant(I64, 1)), k)
    b.branch(head)
    b.position_at_end(done)
    with b.if_then(b.load(split_any)):
        b.atomic_rmw("sub", field(b, state, RUNS), ir.Constant(I64, 1), "seq_cst")
    b.ret_void()
    return str(module)


class NativeWorkers:
    """Native worker threads, one per scratch buffer given (64-byte aligned, kept alive
    here), and the state they share (see the module docstring)."""

    def __init__(self, scratch: list[np.ndarray]):
        self.count = len(scratch)
        self._jit = JitModule(_module_text())
        self._state = np.zeros(STATE_FIELDS, np.int64)
        self._state_address = self._state.ctypes.data
        self._run = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                     ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64)(
            self._jit.address("egraft_parallel"))
        self._run_steps = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                           ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                           ctypes.c_void_p)(self._jit.address("egraft_run_steps"))
        self._ticks = ctypes.CFUNCTYPE(ctypes.c_int64)(self._jit.address("egraft_ticks"))
        loop = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p)(
            self._jit.address("egraft_worker"))
        self._scratch = scratch
        self._threads = []
        for index, buffer in enumerate(scratch):
            thread = threading.Thread(target=loop, args=(self._state.ctypes.data, index, buffer.ctypes.data),
                                      name=f"egraft-worker-{index}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def run_steps(self, kernels: int, parts: int, count: int, table: int, dims: int, scratch: int,
                  ticks: int | None = None) -> None:
        """Run ``count`` kernels in order (``kernels`` and ``parts``: addresses of ``i64``
        arrays, each kernel's address and the parts to split it into, at most ``count + 1``;
        1 runs it on this thread alone) in one native call. ``ticks``, when given, is the
        address of ``2 * count`` ``i64``: each kernel's start and end on :meth:`ticks`' clock."""
        self._run_steps(self._state_address, self.count, kernels, parts, count, table, dims, scratch, ticks)

    def ticks(self) -> int:
        """The CPU's time-stamp counter (see :func:`tick_ns`)."""
        return self._ticks()

    def run(self, kernel: int, table: int, dims: int, parts: int, scratch: int) -> int:
        """Run ``kernel`` in ``parts`` parts (at most ``count + 1``): part 0 here, the others
        on the workers; returns the parts it ran in (1 if another caller had the workers)."""
        parts = max(1, min(parts, self.count + 1, MAX_PARTS))
        return self._run(self._state_address, kernel, table, dims, parts, scratch, self.count)


__all__ = ["NativeWorkers"]
