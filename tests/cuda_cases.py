"""What the CUDA kernel tests share: whether the tools are here (g++ for the emulator, CuPy's
NVRTC for the compile checks), and one-node *cases* run in batches on the emulator.

A case is a one-node ONNX model over graph inputs (:class:`In`) and initializers
(:class:`Const`). The emulator compiles a translation unit with g++ in about a second, so
cases run in batches: the kernels of the cases that share dim bindings (and that all
synchronize threads, or all do not) are renamed apart into one translation unit and
launched by one emulator run (:func:`emulate_cases`); a batch that fails falls back to its
cases one by one, so a failure names its case.

Example:
    >>> c = case("relu", "Relu", [In("x", [3, 4])])                 # doctest: +SKIP
    >>> emulate_cases([c])["relu", 0]                               # doctest: +SKIP
"""

from __future__ import annotations

import re
import shutil
import zlib
from dataclasses import dataclass, field

import numpy as np
import onnx
from conftest import reference_options
from onnx import TensorProto, helper, numpy_helper

import egraft
from egraft.ir.dims import evaluate_dim
from egraft.ir.infer import node_opset
from egraft.kernels.cuda import generate
from egraft.kernels.cuda.emit import PRELUDE, CudaKernel, Launch, Param

HAVE_GXX = shutil.which("g++") is not None


def _nvrtc_available() -> bool:
    try:
        from egraft.kernels.cuda.nvrtc import nvrtc

        nvrtc()
        return True
    except Exception:  # CuPy or NVRTC missing: the numbers are still checked
        return False


HAVE_NVRTC = _nvrtc_available()


# ---- building cases -------------------------------------------------------------------------------
@dataclass
class In:
    """A graph input: its ONNX shape (ints or dim names), element type and values (an array,
    or a function of the concrete shape and a random generator; random when absent)."""

    name: str
    shape: list
    dtype: type = np.float32
    values: object = None


@dataclass
class Const:
    """An initializer read by the node."""

    name: str
    value: np.ndarray


@dataclass
class Case:
    id: str
    model: onnx.ModelProto
    graph: object
    inputs: list
    bindings: list = field(default_factory=lambda: [{}])
    rtol: float = 1e-6
    onnxruntime: bool = True
    #: the first launch's function the generator must choose (``None``: any)
    function: str | None = None

    @property
    def node(self):
        return self.graph.nodes[0]


def case(id: str, op: str, inputs: list, *, attrs: dict | None = None, domain: str = "", opset: int = 17,
         outputs: int = 1, bindings: list | None = None, rtol: float = 1e-6, onnxruntime: bool = True,
         function: str | None = None, ir_version: int | None = None) -> Case:
    """A one-node model of ``op`` over ``inputs`` (In, Const, or "" for an absent one) with
    outputs ``y0``, ``y1``...; onnxruntime judges it too unless the op is egraft's own."""
    graph_inputs = [helper.make_tensor_value_info(x.name, helper.np_dtype_to_tensor_dtype(np.dtype(x.dtype)),
                                                  x.shape) for x in inputs if isinstance(x, In)]
    initializers = [numpy_helper.from_array(x.value, x.name) for x in inputs if isinstance(x, Const)]
    names = [x if isinstance(x, str) else x.name for x in inputs]
    outs = [f"y{k}" for k in range(outputs)]
    node = helper.make_node(op, names, outs, domain=domain, **(attrs or {}))
    graph_outputs = [helper.make_tensor_value_info(y, TensorProto.UNDEFINED, None) for y in outs]
    opsets = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    model = helper.make_model(helper.make_graph([node], id, graph_inputs, graph_outputs, initializers),
                              opset_imports=opsets)
    if ir_version is not None:
        model.ir_version = ir_version
    graph = egraft.load(model)
    for out, v in zip(model.graph.output, graph.nodes[0].outputs):  # onnxruntime wants the output types
        out.type.tensor_type.elem_type = v.type.dtype.value
    return Case(id, model, graph, inputs, bindings or [{}], rtol, onnxruntime and domain == "", function)


def feeds_of(c: Case, bindings: dict) -> dict[str, np.ndarray]:
    """The values of the case's graph inputs at ``bindings`` (the same ones every time)."""
    rng = np.random.default_rng(zlib.crc32(f"{c.id} {sorted(bindings.items())}".encode()))
    out = {}
    for x in c.inputs:
        if not isinstance(x, In):
            continue
        shape = tuple(bindings[d] if isinstance(d, str) else d for d in x.shape)
        kind = np.dtype(x.dtype).kind
        if callable(x.values):
            value = x.values(shape, rng)
        elif x.values is not None:
            value = x.values
        elif kind == "b":
            value = rng.random(shape) < 0.5
        elif kind in "iu":
            value = rng.integers(-20 if kind == "i" else 0, 20, shape)
        else:
            value = rng.standard_normal(shape) * 2
        out[x.name] = np.asarray(value).astype(x.dtype)
    return out


def node_inputs(c: Case, feeds: dict) -> list:
    """The node's inputs in slot order: feeds, constants, or None when absent."""
    return [None if v is None else c.graph.constants[v.const] if v.const is not None else feeds[v.name]
            for v in c.node.inputs]


def kernel_of(c: Case) -> CudaKernel:
    return generate(c.node, c.graph, node_opset(c.graph, c.node))


# ---- running batches in the emulator --------------------------------------------------------------
def batch_kernel(kernels: list[CudaKernel]) -> CudaKernel:
    """One translation unit that runs every kernel of ``kernels``: kernel ``j``'s functions,
    helpers and operands renamed with a ``_k<j>`` suffix, its operands' roles ``(kind, 1000
    * j + slot)``, every function taking every operand."""
    prelude = PRELUDE.strip()
    prelude_names = set(re.findall(r"\beg_\w+", prelude))
    params: list[Param] = []
    dims: dict[str, Param] = {}
    parts, launches = [], []
    for j, kernel in enumerate(kernels):
        assert kernel.source.startswith(prelude)
        text = kernel.source[len(prelude):]
        renames = {p.name: f"{p.name}_k{j}" for p in kernel.params if p.role[0] != "dim"}
        renames |= {name: f"{name}_k{j}" for name in set(re.findall(r"\beg_\w+", text)) - prelude_names}
        text = re.sub(r"\b(" + "|".join(map(re.escape, renames)) + r")\b", lambda m: renames[m.group(1)], text)
        parts.append(re.sub(r'(extern "C" __global__ void \w+)\([^)]*\)', r"\1(EG_BATCH_SIGNATURE)", text))
        for p in kernel.params:
            if p.role[0] == "dim":
                dims[p.name] = p
            else:
                params.append(Param((p.role[0], 1000 * j + p.role[1]), renames[p.name], p.ctype))
        launches += [Launch(renames[launch.function], launch.grid, launch.block, launch.shared_bytes)
                     for launch in kernel.launches]
    params.sort(key=lambda p: p.role[0] != "out")
    params += sorted(dims.values(), key=lambda p: p.name)
    signature = ", ".join(
        f"{p.ctype} {p.name}" if p.role[0] == "dim"
        else f"{'const ' if p.role[0] == 'in' else ''}{p.ctype}* __restrict__ {p.name}" for p in params)
    source = prelude + "".join(parts).replace("EG_BATCH_SIGNATURE", signature)
    return CudaKernel(source, tuple(launches), tuple(params))


def _empty_outputs(c: Case, bindings: dict) -> list[np.ndarray]:
    """Output buffers filled with values no kernel writes by accident (NaN, an extreme integer)."""
    outs = []
    for v in c.node.outputs:
        shape = tuple(int(evaluate_dim(d, bindings)) for d in v.type.shape)
        dtype = v.type.dtype.numpy
        fill = np.nan if dtype.kind == "f" else (np.iinfo(dtype).max if dtype.kind in "iu" else 0)
        outs.append(np.full(shape, fill, dtype))
    return outs


def run_batch(cases: list[Case], bindings: dict) -> dict[str, list[np.ndarray]]:
    """Every case's outputs at ``bindings``, from one emulator run."""
    from egraft.testing.cuda_emulator import emulator

    arrays, results = {}, {}
    for j, c in enumerate(cases):
        for i, x in enumerate(node_inputs(c, feeds_of(c, bindings))):
            if x is not None:
                arrays[("in", 1000 * j + i)] = np.ascontiguousarray(x, c.node.inputs[i].type.dtype.numpy)
        outs = _empty_outputs(c, bindings)
        for i, y in enumerate(outs):
            arrays[("out", 1000 * j + i)] = y
        results[c.id] = outs
    emulator().run(batch_kernel([kernel_of(c) for c in cases]), arrays, bindings)
    return results


def run_alone(c: Case, bindings: dict) -> list[np.ndarray]:
    from egraft.testing.cuda_emulator import emulate_node

    return emulate_node(c.node, c.graph, node_inputs(c, feeds_of(c, bindings)), bindings)


def emulate_cases(cases: list[Case]) -> dict[tuple, list[np.ndarray] | Exception]:
    """(case id, bindings index) -> outputs (or the exception its run raised), the cases
    batched by bindings and by whether their kernels synchronize (a synchronizing kernel
    runs its block's threads as fibers), one by one when a batch fails."""
    from egraft.testing.cuda_emulator import synchronizes

    groups: dict[tuple, list[tuple[Case, int]]] = {}
    for c in cases:
        try:
            threaded = synchronizes(kernel_of(c))
        except Exception:  # the case's own test reports it
            threaded = False
        for k, b in enumerate(c.bindings):
            groups.setdefault((threaded, tuple(sorted(b.items()))), []).append((c, k))
    results = {}
    for (_, key), members in groups.items():
        bindings = dict(key)
        try:
            outs = run_batch([c for c, _ in members], bindings)
        except Exception:
            outs = {}
            for c, _ in members:
                try:
                    outs[c.id] = run_alone(c, bindings)
                except Exception as e:  # the case's own test reports it
                    outs[c.id] = e
        for c, k in members:
            results[c.id, k] = outs[c.id]
    return results


def run_onnxruntime(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    import onnxruntime

    session = onnxruntime.InferenceSession(model.SerializeToString(), reference_options(),
                                           providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def compare(got: np.ndarray, want: np.ndarray, rtol: float, what: str, atol: float | None = None) -> None:
    """Shape and dtype equal; integers and bools (and ``rtol == 0``) exactly, floats within
    ``rtol`` and ``atol`` (default ``rtol / 10``)."""
    want = np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, expected {want.dtype}"
    if got.dtype.kind in "biu" or rtol == 0:
        np.testing.assert_array_equal(got, want, err_msg=what)
    else:
        np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * 0.1 if atol is None else atol, err_msg=what)
