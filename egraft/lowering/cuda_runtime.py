"""The CUDA runtime: :class:`CudaModel` runs a :class:`~egraft.lowering.cuda.CudaProgram`
on a device, one call at a time per model.

A call checks the feeds as the CPU runtime does (names, dtypes, dims), binds the symbolic
dims, lays out the arena for them (:func:`egraft.lowering.memory.plan_memory`, cached per
binding), copies the inputs in, launches each kernel step's functions in order on one
stream with the grids evaluated at those dims, and copies the outputs back: numpy arrays
in, numpy arrays out (CuPy arrays in stay on the device, and CuPy arrays come out).
Constants are copied to the device once. A fallback step runs its numpy reference kernel
on host copies of its inputs.

The device is CuPy's current GPU (:class:`CupyDevice`), or :class:`EmulatedDevice`: the
same CUDA C compiled for the CPU (:mod:`egraft.testing.cuda_emulator`), which checks a
model's numbers on a machine without a GPU, slowly. Without either, a call raises
:class:`NoCudaDevice`, naming what is missing.

Example:
    >>> model = egraft.compile("model.onnx", target="cuda")         # doctest: +SKIP
    >>> model.run({"x": x})["y"]                                    # doctest: +SKIP
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from egraft.errors import EgraftError, ExecutionError
from egraft.ir.dims import evaluate_dim
from egraft.ir.interpreter import Bindings, _run_node, check_feeds
from egraft.lowering.cuda import CudaProgram
from egraft.lowering.memory import plan_memory


class NoCudaDevice(EgraftError):
    """A CUDA model was run where no CUDA device can be used."""


class CupyDevice:
    """CuPy's current GPU: memory as CuPy arrays, kernels loaded from the cubins."""

    name = "cuda"

    def __init__(self, program: CudaProgram):
        try:
            import cupy
        except ImportError as e:
            raise NoCudaDevice(f"running a CUDA model needs CuPy and an NVIDIA GPU: {e}; "
                               "pip install 'egraft[cuda]', or run it with device='emulator' to check "
                               "its numbers on the CPU") from None
        try:
            count = cupy.cuda.runtime.getDeviceCount()
        except Exception as e:  # no driver: CUDARuntimeError
            raise NoCudaDevice(f"no CUDA device: {type(e).__name__}: {e} (this model was compiled for "
                               f"{program.arch}; run it on a machine with an NVIDIA GPU, or with "
                               "device='emulator' (egraft run --backend cuda-emulated) to check its numbers on the "
                               "CPU)") from None
        if count == 0:
            raise NoCudaDevice(f"no CUDA device (this model was compiled for {program.arch})")
        self.cp = cupy
        self.functions: dict[tuple[str, str], object] = {}
        for digest, module in program.modules.items():
            if not module.cubin:  # a library step: nothing to load
                continue
            loaded = cupy.cuda.function.Module()
            loaded.load(module.cubin)
            for launch in program.kernels.kernels[digest].launches:
                function = loaded.get_function(launch.function)
                if launch.shared_bytes > 48 * 1024:  # above 48 KiB a function must opt in
                    driver = cupy.cuda.driver
                    driver.funcSetAttribute(function.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                            launch.shared_bytes)
                self.functions[(digest, launch.function)] = function
            self.functions[(digest, "")] = loaded  # keeps the module loaded

    def alloc(self, nbytes: int):
        return self.cp.empty(max(int(nbytes), 1), self.cp.uint8)

    def address(self, buffer) -> int:
        return int(buffer.data.ptr)

    def upload(self, array: np.ndarray):
        return self.cp.ascontiguousarray(self.cp.asarray(array))

    def download(self, address: int, shape: tuple, dtype: np.dtype, owner, on_device: bool = False):
        count = int(np.prod(shape)) if shape else 1
        memory = self.cp.cuda.MemoryPointer(self.cp.cuda.UnownedMemory(address, count * dtype.itemsize, owner), 0)
        view = self.cp.ndarray(shape, dtype, memory)
        return view.copy() if on_device else view.get()

    def is_device_array(self, array) -> bool:
        return isinstance(array, self.cp.ndarray)

    def write(self, address: int, array) -> None:
        stream = self.cp.cuda.get_current_stream().ptr
        if isinstance(array, self.cp.ndarray):
            array = self.cp.ascontiguousarray(array)
            self.cp.cuda.runtime.memcpyAsync(address, array.data.ptr, array.nbytes, 3, stream)  # device to device
        else:
            array = np.ascontiguousarray(array)
            self.cp.cuda.runtime.memcpyAsync(address, array.ctypes.data, array.nbytes, 1, stream)  # host to device
            self.synchronize()  # the host array may be freed as soon as this returns

    def capture(self, launches) -> object:
        """The launches made by ``launches()`` captured on a stream, as a CUDA graph."""
        stream = self.cp.cuda.Stream(non_blocking=True)
        with stream:
            stream.begin_capture()
            launches()
            graph = stream.end_capture()
        self.graph_stream = stream
        return graph

    def replay(self, graph) -> None:
        graph.launch(self.cp.cuda.get_current_stream())

    def launch(self, program: CudaProgram, digest: str, addresses: list[int], bindings: dict[str, int]) -> None:
        kernel = program.kernels.kernels[digest]
        if kernel.library is not None:
            from egraft.kernels.cuda.library import run_library, shapes_at

            views = []
            for address, shape in zip(addresses, shapes_at(kernel.library, bindings)):
                nbytes = int(np.prod(shape)) * 4 if shape else 4
                memory = self.cp.cuda.MemoryPointer(self.cp.cuda.UnownedMemory(address, nbytes, self), 0)
                views.append(self.cp.ndarray(shape, self.cp.float32, memory))
            run_library(kernel.library, self.cp, views)
            return
        dims = [np.int64(bindings[s]) for s in kernel.symbols]
        args = tuple(np.uint64(a) for a in addresses) + tuple(dims)
        for launch in kernel.launches:
            self.functions[(digest, launch.function)](launch.grid_at(bindings), launch.block, args,
                                                      shared_mem=launch.shared_bytes)

    def synchronize(self) -> None:
        self.cp.cuda.get_current_stream().synchronize()


class EmulatedDevice:
    """The CPU standing in for the GPU: host memory, kernels through the emulator."""

    name = "emulator"

    def __init__(self, program: CudaProgram):
        from egraft.testing.cuda_emulator import emulator

        self.emulator = emulator()

    def alloc(self, nbytes: int):
        return np.zeros(max(int(nbytes), 1) + 64, np.uint8)

    def address(self, buffer) -> int:
        return (buffer.ctypes.data + 63) // 64 * 64

    def upload(self, array: np.ndarray):
        buffer = self.alloc(array.nbytes)
        self.write(self.address(buffer), array)
        return buffer

    def is_device_array(self, array) -> bool:
        return False

    def download(self, address: int, shape: tuple, dtype: np.dtype, owner, on_device: bool = False) -> np.ndarray:
        count = int(np.prod(shape)) if shape else 1
        raw = (np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * (count * dtype.itemsize)).from_address(address))
               if count else np.zeros(0, np.uint8))
        return raw.view(dtype).reshape(shape).copy()

    def write(self, address: int, array: np.ndarray) -> None:
        array = np.ascontiguousarray(array)
        if array.nbytes:
            np.ctypeslib.ctypes.memmove(address, array.ctypes.data, array.nbytes)

    def launch(self, program: CudaProgram, digest: str, addresses: list[int], bindings: dict[str, int]) -> None:
        self.emulator.launch(program.kernels.kernels[digest], addresses, bindings)

    def synchronize(self) -> None:
        pass

    def capture(self, launches) -> None:
        return None  # the emulator runs each call's launches

    def replay(self, graph) -> None:
        raise AssertionError("the emulated device never captures")


DEVICES = {"cuda": CupyDevice, "emulator": EmulatedDevice}


@dataclass
class _Bound:
    """A model's device state at one binding of its dims: buffers, value addresses and shapes,
    the steps as launches (or fallbacks) on those addresses, and the run captured as a CUDA graph."""

    keep: list = field(default_factory=list)
    address: dict[str, int] = field(default_factory=dict)
    shapes: dict[str, tuple] = field(default_factory=dict)
    actions: list = field(default_factory=list)
    graph: object | None = None
    #: the input dims and those the host derived from them (a Range's length ``_d0``)
    bindings: dict = field(default_factory=dict)
    #: values that live on the host: an unknown rank, or dims only a fallback's run tells
    #: (an If's outputs); the steps that read them run their reference kernels too
    host: set = field(default_factory=set)


def _stand_in(v, bindings: Bindings) -> np.ndarray:
    """A zero-copy array of ``v``'s shape at ``bindings`` and its dtype (every element 0)."""
    shape = tuple(int(evaluate_dim(d, bindings)) for d in v.type.shape)
    return np.lib.stride_tricks.as_strided(np.zeros(1, v.type.dtype.numpy), shape, (0,) * len(shape))


class CudaModel:
    """A model compiled for CUDA; ``run`` it on feeds (``device``: ``cuda``, the default,
    or ``emulator``). ``cuda_graph=True`` captures a call's launches as a CUDA graph the
    first time a binding of the dims is seen and replays it after (one launch from the host
    per call instead of one per kernel; a model with fallbacks runs eagerly)."""

    def __init__(self, program: CudaProgram, device: str = "cuda", cuda_graph: bool = False):
        if device not in DEVICES:
            raise EgraftError(f"device {device!r}: expected one of {', '.join(DEVICES)}")
        self.program = program
        self.lowered = program.lowered
        self.graph = program.lowered.graph
        self.device_name = device
        self._device = None
        self._constants: dict[str, object] = {}
        self._bound: dict[tuple, _Bound] = {}
        self.cuda_graph = cuda_graph
        self._lock = threading.Lock()

    @property
    def arch(self) -> str:
        return self.program.arch

    def report(self) -> dict:
        return self.program.report()

    @property
    def fallbacks(self) -> list:
        return [s for s in self.lowered.steps if s.kind == "fallback"]

    def device(self):
        if self._device is None:
            self._device = DEVICES[self.device_name](self.program)
        return self._device

    def __call__(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.run(feeds)

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run the model on ``feeds`` (input name -> numpy or CuPy array) and return its outputs
        by name: numpy arrays, or CuPy arrays on the device when any feed was one."""
        with self._lock:  # one call at a time: the arena and the stream are the model's
            return self._run(feeds)

    def _run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        device = self.device()
        on_device = {k for k, v in feeds.items() if device.is_device_array(v)}
        # device arrays are checked through a zero-copy stand-in of their shape and dtype
        host = {k: np.lib.stride_tricks.as_strided(np.zeros(1, v.dtype), v.shape, (0,) * v.ndim)
                if k in on_device else v for k, v in feeds.items()}
        arrays, bindings = check_feeds(self.graph, host)
        key = tuple(sorted(bindings.items()))
        bound = self._bound.get(key)
        if bound is None:
            bound = self._bound[key] = self._bind(device, bindings)
        bindings = bound.bindings  # with the dims the host derived (a Range's length)
        for v in self.graph.inputs:
            device.write(bound.address[v.name], feeds[v.name] if v.name in on_device else arrays[v.name])
        host_values: dict[str, np.ndarray] = {}  # this call's values that live on the host
        if bound.graph is not None:
            device.replay(bound.graph)
        else:
            for action in bound.actions:
                if action[0] == "launch":
                    try:
                        device.launch(self.program, action[1], action[2], bindings)
                    except Exception as e:  # CuPy's CUDA errors: named by the step, never a traceback
                        raise ExecutionError(f"the CUDA kernel of {action[3]} failed to launch: "
                                             f"{type(e).__name__}: {e}") from None
                else:
                    self._fallback(device, action[1], bound, bindings, host_values)
            if self.cuda_graph and not any(a[0] == "fallback" for a in bound.actions):
                bound.graph = device.capture(lambda: [device.launch(self.program, a[1], a[2], bindings)
                                                      for a in bound.actions])
        try:
            device.synchronize()
        except Exception as e:  # an asynchronous fault in some kernel of the run
            raise ExecutionError(f"a CUDA kernel of this run failed: {type(e).__name__}: {e}") from None
        out = {}
        for v in self.graph.outputs:
            if v.const is not None:
                out[v.name] = self.graph.constants[v.const]
            elif v.name in bound.host:
                out[v.name] = host_values[v.name]
            else:
                out[v.name] = device.download(bound.address[v.name], bound.shapes[v.name], v.type.dtype.numpy,
                                              bound.keep, bool(on_device))
        return out

    def _bind(self, device, bindings: Bindings) -> _Bound:
        """The buffers, addresses and launches of a call at ``bindings`` (kept for the next
        call at the same dims: its arena, inputs and outputs stay where they are, so a CUDA
        graph captured once replays)."""
        bindings = Bindings(bindings)
        self._check_host_sized(bindings)
        self._check_guards(bindings)
        plan = plan_memory(self.lowered.buffers, dict(bindings), self.lowered.parts)
        bound = _Bound(keep=[device.alloc(plan.peak)], bindings=bindings)
        arena = device.address(bound.keep[0])
        bound.address.update({name: arena + offset for name, offset in plan.offsets.items()})
        for name, buffer in self._constant_buffers(device).items():
            bound.address[name] = device.address(buffer)

        def evaluable(v) -> bool:
            """Whether ``v``'s shape is known at these dims (else it lives on the host)."""
            if v.name in bound.shapes:
                return True
            if v.name in bound.host or v.type.shape is None:
                return False
            try:
                bound.shapes[v.name] = tuple(int(evaluate_dim(d, bindings)) for d in v.type.shape)
            except (TypeError, ValueError):  # a dim only a fallback's run binds
                return False
            return True

        def located(v) -> int:
            if not evaluable(v):
                raise ExecutionError(f"%{v.name} has no shape at these dims")
            if v.name not in bound.address:  # an input, an output, or a value with no arena buffer
                buffer = device.alloc(int(np.prod(bound.shapes[v.name])) * v.type.dtype.numpy.itemsize)
                bound.keep.append(buffer)
                bound.address[v.name] = device.address(buffer)
            return bound.address[v.name]

        def on_host(node) -> None:
            """``node`` runs its reference kernel: its outputs of unknown shape stay on the host."""
            for v in node.inputs:
                if v is not None and v.const is None and v.name not in bound.host:
                    located(v)
            for v in node.outputs:
                if v is not None:
                    if evaluable(v):
                        located(v)
                    else:
                        bound.host.add(v.name)
            bound.actions.append(("fallback", node))

        for v in self.graph.inputs:
            located(v)
        calls = {c.step: c for c in self.lowered.kernels.calls}
        for step in self.lowered.steps:
            node = step.node
            reads_host = any(v is not None and v.name in bound.host for v in node.inputs)
            if step.kind == "fallback" or (reads_host and step.kind in ("kernel", "view")):
                on_host(node)
            elif step.kind == "view":
                source = node.inputs[0]
                bound.address[node.outputs[0].name] = located(source) + step.offset * source.type.dtype.numpy.itemsize
            elif step.kind == "kernel":
                call = calls[step.index]
                values = {v.name: v for v in (*node.inputs, *node.outputs) if v is not None}
                bound.actions.append(("launch", call.module, [located(values[n]) for n in call.operands], node.label))
        for v in self.graph.outputs:
            if v.const is None and v.name not in bound.host:
                located(v)
        return bound

    def _check_host_sized(self, bindings: Bindings) -> None:
        """The output dims of each kernel that small computed inputs size (a Slice to
        ``Shape(x)[1]``, a Range to ``Shape(x)[2]``), derived on the host from the input shapes
        alone: dims only they decide (``_d0``) are bound in ``bindings``, the others checked (a
        binding they contradict is refused, naming the node)."""
        checks = self.lowered.kernels.host_checks
        if not checks:
            return
        env: dict[str, np.ndarray] = {}
        for v in self.graph.inputs:  # stand-ins: the shapes are all that these nodes read
            env[v.name] = _stand_in(v, bindings)
        for index, producers in sorted(checks.items()):
            node = self.graph.nodes[index]
            for producer in producers:
                if not all(o is None or o.name in env for o in producer.outputs):
                    if producer.op in ("Shape", "Size"):  # it reads its input's shape only
                        source = producer.inputs[0]
                        if source.const is None and source.name not in env:
                            env[source.name] = _stand_in(source, bindings)
                    _run_node(self.graph, producer, env, Bindings(bindings), check_outputs=False)
            data = node.inputs[0]
            if node.op not in ("Range", "ConstantOfShape") and data is not None and data.const is None \
                    and data.name not in env:
                env[data.name] = _stand_in(data, bindings)
            _run_node(self.graph, node, dict(env), bindings, check_outputs=True)  # binds its fresh dims

    def _check_guards(self, bindings: Bindings) -> None:
        """Each pair of dims a kernel takes for equal (:meth:`CudaContext.guard`), at these dims."""
        for index, pairs in sorted(self.lowered.kernels.guards.items()):
            for dim, equals in pairs:
                a, b = int(evaluate_dim(dim, bindings)), int(evaluate_dim(equals, bindings))
                if a != b:
                    at = ", ".join(f"{k}={v}" for k, v in sorted(bindings.items()))
                    raise ExecutionError(f"{self.graph.nodes[index].label}: an operand dim {dim} = {a} where the "
                                         f"CUDA kernel reads the result's {equals} = {b} (at {at})")

    def _constant_buffers(self, device) -> dict[str, object]:
        if not self._constants:
            for node in self.graph.nodes:
                for v in node.inputs:
                    if v is not None and v.const is not None and v.name not in self._constants:
                        self._constants[v.name] = device.upload(
                            np.ascontiguousarray(self.graph.constants[v.const], v.type.dtype.numpy))
        return self._constants

    def _fallback(self, device, node, bound: _Bound, bindings: Bindings, host_values: dict) -> None:
        """Run ``node``'s reference kernel on host copies of its inputs; write its outputs back
        to the device, or keep them in ``host_values`` when they live on the host."""
        device.synchronize()
        env = {}
        for v in node.inputs:
            if v is not None and v.const is None:
                env[v.name] = host_values[v.name] if v.name in bound.host else device.download(
                    bound.address[v.name], bound.shapes[v.name], v.type.dtype.numpy, None)
        _run_node(self.graph, node, env, Bindings(bindings), check_outputs=True)
        for v in node.outputs:
            if v is None:
                continue
            result = env.get(v.name)
            if result is None:
                raise ExecutionError(f"{node.label} produced no output %{v.name}")
            if v.name in bound.host:
                host_values[v.name] = result
            else:
                device.write(bound.address[v.name], np.ascontiguousarray(result, v.type.dtype.numpy))


__all__ = ["CudaModel", "CupyDevice", "EmulatedDevice", "NoCudaDevice", "DEVICES"]
