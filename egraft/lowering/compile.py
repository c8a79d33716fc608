"""Lowering: an IR graph becomes a schedule of steps, an arena layout and one LLVM module
of kernels, wrapped as a :class:`egraft.lowering.runtime.CompiledModel`.

Each node becomes one step:

- a **kernel**: the op has a generator (:mod:`egraft.kernels.cpu`), emitted into its own
  function, called through the step's stub ``void k<n>_<op>(i8** table, i64* dims, ...)``;
- a **view**: Reshape, Squeeze, Unsqueeze, Flatten, Identity and Dropout (inference) of
  a contiguous tensor move no data, the output shares its input's storage;
- a **fallback**: the op's reference kernel (numpy) runs on the arena's buffers; the
  report names the op and why it has no generated code;
- a **control** step: an If, Loop or Scan whose bodies are compiled sub-programs
  (:mod:`egraft.lowering.control`).

Each kernel is a module of its own, named after its content, so equal kernels compile once
and a kernel compiled for another model is found in the disk cache (:mod:`egraft.lowering.kernels`);
the kernels still to compile are optimized at -O3 for the host CPU in parallel processes
and linked in one engine with the steps' call stubs (:mod:`egraft.kernels.cpu.llvm`).

Example:
    >>> compiled = compile_graph(egraft.load("model.onnx"))     # doctest: +SKIP
    >>> compiled.run({"x": x})["y"]                           # doctest: +SKIP
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import llvmlite.binding as llvm
from llvmlite import ir

from egraft import trace
from egraft.ir.dims import dim_product, dim_symbols, dims_equal
from egraft.ir.graph import Graph, Node, Value
from egraft.ir.infer import node_opset, resolve_op
from egraft.ir.ops.nn_dense import dropout_is_identity
from egraft.kernels.cpu import early_compile, find_kernel, in_place
from egraft.kernels.cpu.emit import KernelContext, Unsupported
from egraft.kernels.cpu.llvm import JitModule, compile_jobs, host_cpu, pipeline_header, submit_early
from egraft.lowering.control import inline_constant_ifs, is_control, lower_bodies
from egraft.lowering.kernel_memo import Emission, KernelMemo, replay
from egraft.lowering.kernels import KernelSet
from egraft.lowering.memory import ALIGNMENT, BufferSpec

#: Ops whose output is its input's storage, reshaped.
VIEW_OPS = {"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Dropout"}

#: Ops whose output dims are a function of their input *values* (a shape tensor, Range's
#: scalars, Slice's starts and ends): when those dims are fresh symbols (``_d3``: data-dependent),
#: the runtime computes them just before the kernel runs, by the op's shape inference on the
#: input arrays (:meth:`egraft.lowering.runtime.CompiledModel._bind_output_dims`), binds them,
#: allocates the outputs, then calls the generated kernel (which reads the dims from ``dims``).
SIZED_BY_INPUT_VALUES = {"Range", "Expand", "ConstantOfShape", "Slice"}


@dataclass(frozen=True)
class Step:
    """One node of the schedule: ``kind`` is ``kernel``, ``view``, ``placed`` (a Concat whose
    inputs were written in place: nothing runs), ``fallback`` or ``control``; ``function``
    names a kernel's LLVM function; ``reason`` says why a node fell back."""

    index: int
    node: Node
    kind: str
    function: str = ""
    reason: str = ""
    offset: int = 0  # a view: where it starts in its input, in elements (a contiguous Slice)
    parallel: bool = False  # a kernel that computes share `part` of `parts` (run on several threads)
    #: a kernel whose output dims the runtime computes from its input values before calling it
    #: (see :data:`SIZED_BY_INPUT_VALUES`)
    sized_by_inputs: bool = False
    #: a kernel's broadcasts decided at run time, ``(axis, operand dim, result dim)``: the
    #: runtime checks each operand dim is 1 or the result's (:mod:`egraft.lowering.guards`)
    guards: tuple = ()


@dataclass
class Lowered:
    """What lowering produced: the schedule, storage, symbols and the module's IR text."""

    graph: Graph
    steps: list[Step]
    slots: dict[str, int]
    storage: dict[str, str]  # value name -> the value whose buffer it uses (itself or a view's root)
    buffers: list[BufferSpec]
    dynamic: set[str]  # values whose size is known only when their producer runs (data-dependent dims)
    symbols: list[str]
    #: the distinct kernels (one LLVM module each) and each kernel step's call of its kernel
    kernels: KernelSet
    seconds: dict[str, float] = field(default_factory=dict)
    #: a Concat's inputs written in place: value name -> (the Concat output whose buffer holds
    #: it, byte offset there, bytes); see :func:`_concat_in_place`
    parts: dict[str, tuple[str, int, int]] = field(default_factory=dict)
    #: constants the kernels computed at compile time (packed weights), by table slot name
    derived: dict = field(default_factory=dict)
    #: the constant values (by name) that some step reads at run time: a kernel's operands
    #: whose pointers its code loads, a view's source, every constant input of a fallback.
    #: A constant left out is read only while generating code (packed into ``derived``, or
    #: baked into the code); ``None`` when unknown (every constant input then counts)
    runtime_constants: set[str] | None = None
    #: how each packed derived constant was made from which constant (by table slot name,
    #: :class:`~egraft.kernels.cpu.emit.PackedFrom`, from ``KernelContext.packed_from``)
    packed_from: dict = field(default_factory=dict)
    #: the shape assumptions the model was compiled with (:mod:`egraft.ir.assume`), checked on every call
    assumptions: tuple = ()
    #: the lowered bodies of each ``control`` step (If, Loop, Scan), by step index and
    #: attribute name (see :mod:`egraft.lowering.control`)
    bodies: dict = field(default_factory=dict)
    #: the nodes of the graph as given, when lowering changed them (If nodes with a known
    #: condition replaced by their branch): what ``CompiledModel.graph`` shows; ``graph`` is
    #: what the steps run
    source_nodes: list | None = None
    #: kernel steps whose code an earlier step's emission gave (:mod:`egraft.lowering.kernel_memo`)
    reused_emissions: int = 0
    #: the helper compiling the kernels since they were emitted (:mod:`egraft.kernels.cpu.early_compile`),
    #: until :func:`compile_lowered` takes their objects; never pickled
    early: early_compile.Session | None = field(default=None, repr=False, compare=False)
    #: what the kernels are for: ``cpu`` (LLVM modules) or ``cuda`` (CUDA C, :mod:`egraft.lowering.cuda`)
    target: str = "cpu"

    def __getstate__(self) -> dict:
        return {**self.__dict__, "early": None}

    @property
    def module_text(self) -> str:
        """The LLVM IR of the call stubs and every distinct kernel, one module after the other."""
        return self.kernels.text


def _is_view(graph: Graph, node: Node) -> bool:
    if node.op not in VIEW_OPS or node.domain not in ("", "ai.onnx"):
        return False
    outputs = [v for v in node.outputs if v is not None]
    if len(outputs) != 1 or node.outputs[0] is None or node.inputs[0] is None:
        return False  # Dropout with its mask output computes
    if node.op == "Dropout" and not dropout_is_identity(node, node_opset(graph, node), graph.constants):
        return False  # training mode: random
    return node.inputs[0].type.dtype == outputs[0].type.dtype


def _contiguous_slice(graph: Graph, node: Node) -> int | None:
    """For a Slice of a static shape with constant starts (and axes, steps), unit steps,
    whose result (of the length inference gave it) is one contiguous run of its input, the
    element offset where that run starts; else ``None`` (it is computed by a kernel).

    Example: ``x: f32[4, 8, 16]`` sliced to ``x[1:3]`` is elements 128..384 of ``x``: 128.
    """
    if node.op != "Slice" or node.domain not in ("", "ai.onnx") or node.inputs[0] is None:
        return None
    shape = node.inputs[0].type.shape
    if shape is None or not all(isinstance(d, int) for d in shape):
        return None
    if node_opset(graph, node) < 10:
        starts, axes, steps = node.attrs.get("starts"), node.attrs.get("axes"), None
    else:
        params = []
        for k, v in enumerate(node.inputs[1:5]):
            if v is not None and v.const is None and k != 1:
                return None  # computed ends are fine: the output type has the lengths
            params.append(None if v is None or v.const is None else graph.constants[v.const].ravel().tolist())
        params += [None] * (4 - len(params))
        starts, _, axes, steps = params
    out_shape = node.outputs[0].type.shape
    if starts is None or out_shape is None or len(out_shape) != len(shape):
        return None
    rank = len(shape)
    axes = list(range(len(starts))) if axes is None else [int(a) % rank for a in axes]
    steps = [1] * len(starts) if steps is None else steps
    begin, length = [0] * rank, list(out_shape)
    for start, axis, step in zip(starts, axes, steps):
        if step != 1:
            return None
        begin[axis] = slice(int(start), None, 1).indices(shape[axis])[0]
    if 0 in length:
        return 0  # empty: no element to address
    cut = [j for j in range(rank) if length[j] != shape[j]]
    if cut and any(length[j] != 1 for j in range(cut[-1])):
        return None  # contiguous only when every axis before the last cut one keeps one index
    stride, offset = 1, 0
    for j in reversed(range(rank)):
        offset += begin[j] * stride
        stride *= shape[j]
    return offset


def _nbytes(v: Value):
    if v.type.shape is None:
        return None
    return dim_product(v.type.shape) * v.type.dtype.numpy.itemsize


def lower(graph: Graph) -> Lowered:
    """Schedule ``graph``, plan its storage and emit its kernels. They start compiling in a
    helper process as they come (:mod:`egraft.kernels.cpu.early_compile`, with two cores or
    more); :func:`compile_lowered` finishes."""
    session = early_compile.begin(compile_jobs() > 1)
    try:
        lowered = _lower(graph)
    except BaseException:
        early_compile.end(session)
        raise
    early_compile.detach(session)
    lowered.early = session
    return lowered


def _lower(graph: Graph, renderer_type: type | None = None) -> Lowered:
    start = time.perf_counter()
    source, graph = graph, inline_constant_ifs(graph)  # an If whose condition is known is its branch
    values: list[Value] = list(graph.inputs)
    for node in graph.nodes:
        values.extend(v for v in node.inputs if v is not None and v.const is not None)
        values.extend(v for v in node.outputs if v is not None)
    slots: dict[str, int] = {}
    for v in values:
        slots.setdefault(v.name, len(slots))
    symbols = sorted({s for v in values if v.type.shape is not None for s in dim_symbols(v.type.shape)})
    dim_index = {s: k for k, s in enumerate(symbols)}

    steps: list[Step] = []
    runtime_constants: set[str] = set()
    bodies: dict[int, dict[str, Lowered]] = {}
    output_names = {v.name for v in graph.outputs}
    storage: dict[str, str] = {}
    sharing = _StorageGroups(graph)
    input_symbols = {s for v in graph.inputs if v.type.shape is not None for s in dim_symbols(v.type.shape)}
    parts: dict[str, tuple[str, int, int]] = {}
    producers: dict[str, Step] = {}
    renderer = (renderer_type or CpuRenderer)(storage, sharing, output_names, input_symbols)
    for index, node in enumerate(graph.nodes):
        if steps:
            producers.update((v.name, steps[-1]) for v in steps[-1].node.outputs if v is not None)
        if node.op == "Concat" and node.domain in ("", "ai.onnx") \
                and _concat_in_place(node, producers, storage, parts, sharing, output_names):
            steps.append(Step(index, node, "placed"))
            continue
        if is_control(node):  # its bodies become compiled sub-programs (even when its output rank is unknown)
            if renderer.target != "cpu":
                steps.append(Step(index, node, "fallback", reason=f"{node.op} bodies are compiled for the CPU only"))
                continue
            try:
                bodies[index] = lower_bodies(node, lower, f"{graph.name}#{index}")
            except Unsupported as e:
                steps.append(Step(index, node, "fallback", reason=str(e)))
            else:
                steps.append(Step(index, node, "control"))
            continue
        unranked = [v for v in (*node.inputs, *node.outputs) if v is not None and v.type.shape is None]
        if unranked:  # an If whose branches differ in rank: only the run knows
            steps.append(Step(index, node, "fallback", reason=f"the rank of %{unranked[0].name} is known only at "
                                                              "run time"))
            continue
        # Output dims only the node's own run binds (a Reshape to a target computed from data):
        # its reference kernel runs and binds them, unless the generator refuses for a reason of its own.
        learned = _dims_learned_by(node, input_symbols) or _dims_given_by_values(node)
        offset = _contiguous_slice(graph, node)
        if (_is_view(graph, node) or offset is not None) and node.outputs[0].name not in output_names \
                and not learned:
            storage[node.outputs[0].name] = storage.get(node.inputs[0].name, node.inputs[0].name)
            sharing.join(storage[node.outputs[0].name], node.outputs[0].name)
            steps.append(Step(index, node, "view", offset=offset or 0))
            if node.inputs[0].const is not None:
                runtime_constants.add(node.inputs[0].name)
            continue
        made = renderer.kernel_step(index, node, graph, slots, dim_index, learned, runtime_constants)
        if isinstance(made, Step):
            steps.append(made)
            continue
        steps.append(Step(index, node, "fallback", reason=made))
    for step in steps:
        if step.kind in ("fallback", "control"):
            runtime_constants.update(v.name for v in step.node.inputs if v is not None and v.const is not None)
    if trace.enabled("lower"):
        for step in steps:
            why = f": {step.reason}" if step.kind == "fallback" else ""
            outs = ", ".join(f"%{v.name}" for v in step.node.outputs if v is not None)
            trace.emit("lower", f"{outs} = {step.node.label} -> {step.kind}{why}")
    buffers, dynamic = _buffers(graph, steps, storage, input_symbols, parts)
    return Lowered(graph, steps, slots, storage, buffers, dynamic, symbols, renderer.kernels,
                   {"lower": time.perf_counter() - start}, parts, renderer.derived, runtime_constants,
                   renderer.packed_from, bodies=bodies, source_nodes=None if graph is source else list(source.nodes),
                   reused_emissions=renderer.reused_emissions, target=renderer.target)


class CpuRenderer:
    """Kernels as LLVM modules for this CPU (:mod:`egraft.kernels.cpu`): the renderer the
    schedule loop of :func:`lower` asks for each node that is not a view, a placed Concat
    or a control step. :class:`egraft.lowering.cuda.CudaRenderer` is its CUDA sibling.

    ``kernel_step`` returns the node's kernel :class:`Step`, or the reason it falls back."""

    target = "cpu"

    def __init__(self, storage: dict[str, str], sharing: _StorageGroups, output_names: set[str],
                 input_symbols: set[str]):
        self.kernels = KernelSet()
        self.memo = KernelMemo()
        self.derived: dict = {}
        self.packed_from: dict = {}
        self.storage, self.sharing = storage, sharing
        self.output_names, self.input_symbols = output_names, input_symbols

    @property
    def reused_emissions(self) -> int:
        return self.memo.hits

    def kernel_step(self, index: int, node: Node, graph: Graph, slots: dict[str, int], dim_index: dict[str, int],
                    learned: list[str], runtime_constants: set[str]) -> Step | str:
        kernels, memo, derived, packed_from = self.kernels, self.memo, self.derived, self.packed_from
        generator = find_kernel(node.op, node.domain)
        reason = "no generated code for this op"
        if generator is not None:
            if in_place(node.op, node.domain):
                _reuse_a_dying_input(index, node, self.storage, slots, self.sharing, self.output_names,
                                     self.input_symbols)
            name = f"k{index}_{node.op}"
            opset = node_opset(graph, node)
            key = memo.key(node, opset, slots)
            emission = memo.find(key, node)
            try:
                if emission is None:
                    emission = _emit(generator, node, graph, name, opset, slots, dim_index, memo, key)
            except Unsupported as e:
                reason = str(e)
            else:
                names, own, packed = replay(emission, node, graph, name)
                for derived_name in own:
                    slots.setdefault(derived_name, len(slots))
                sized = (bool(learned) or _length_assumes_computed_starts(graph, node)) \
                    and node.op in SIZED_BY_INPUT_VALUES and node.domain in ("", "ai.onnx")
                if learned and not sized:
                    return f"dim {learned[0]} is known only once this node has run"
                if sized:  # the runtime's inference reads every input, constants included
                    runtime_constants.update(v.name for v in node.inputs if v is not None and v.const is not None)
                known = len(kernels.modules)
                symbol = kernels.add(emission.text)
                if len(kernels.modules) > known:  # a new kernel: it compiles while the next are emitted
                    submit_early(kernels.modules[symbol])
                kernels.call(name, symbol, tuple(slots[names[role]] for role in emission.operands),
                             tuple(dim_index[s] for s in emission.dim_operands))
                derived.update(own)
                packed_from.update(packed)
                runtime_constants.update(v.name for i, v in enumerate(node.inputs)
                                         if v is not None and v.const is not None and ("in", i) in emission.table_roles)
                return Step(index, node, "kernel", function=name, parallel=emission.parallel,
                            sized_by_inputs=sized, guards=emission.guards)
        return reason


def _emit(generator, node: Node, graph: Graph, name: str, opset: int, slots: dict[str, int],
          dim_index: dict[str, int], memo: KernelMemo, key) -> Emission:
    """Run ``generator`` on ``node`` in a module of its own and record the emission in ``memo``;
    the derived constants it made are taken out of ``slots`` again (:func:`replay` gives them
    their slots, for this node as for a later one that reuses the emission)."""
    scratch = ir.Module(name="kernel")
    scratch.triple = host_cpu()[0]
    before = set(slots)
    ctx = KernelContext(scratch, name, node, graph, resolve_op(node, opset), opset, slots, dim_index, {})
    try:
        generator(ctx)
        ctx.finish()
    finally:
        for made in set(slots) - before:
            del slots[made]
    text = pipeline_header(ctx.llvm_unroll, ctx.llvm_loop_vectorize) + str(scratch)
    return memo.record(key, ctx, text)


def _dims_given_by_values(node: Node) -> list[str]:
    """Symbols of the output dims of a Range, ConstantOfShape, Expand or Slice (the ops of
    :data:`SIZED_BY_INPUT_VALUES`) that its data input's shape does not give, when an input
    that sizes it (Range's scalars, a shape, starts or ends) is computed: its values decide
    them. Such a dim may be a named dim that a data-dependent one was unified with
    (:mod:`egraft.ir.unify`), so the runtime computes the output shape from the values and
    checks it (``sized_by_inputs``) rather than trusting it."""
    if node.op not in SIZED_BY_INPUT_VALUES or node.domain not in ("", "ai.onnx"):
        return []
    sizing = node.inputs if node.op in ("Range", "ConstantOfShape") else node.inputs[1:]
    if all(v is None or v.const is not None for v in sizing):
        return []
    data = node.inputs[0] if node.op not in ("Range", "ConstantOfShape") else None
    given = dim_symbols(data.type.shape) if data is not None and data.type.shape is not None else set()
    found: set[str] = set()
    for v in node.outputs:
        if v is not None and v.type.shape is not None:
            found |= dim_symbols(v.type.shape) - given
    return sorted(found)


def _length_assumes_computed_starts(graph: Graph, node: Node) -> bool:
    """A Slice whose starts or steps are computed: inference took its output length from their
    symbolic values assumed in range (``x[n - 2:]`` is 2 long only when ``n >= 2``), so the
    runtime checks that length against the actual values before the kernel runs, as it binds a
    data-dependent one (``sized_by_inputs``)."""
    if node.op != "Slice" or node_opset(graph, node) < 10:
        return False
    return any(k < len(node.inputs) and node.inputs[k] is not None and node.inputs[k].const is None for k in (1, 4))


def _dims_learned_by(node: Node, input_symbols: set[str]) -> list[str]:
    """Symbols in the node's output types that neither the graph's inputs nor the node's own
    inputs bind: only running the node tells them (its output shape depends on data)."""
    known = set(input_symbols)
    for v in node.inputs:
        if v is not None and v.type.shape is not None:
            known |= dim_symbols(v.type.shape)
    learned: set[str] = set()
    for v in node.outputs:
        if v is not None and v.type.shape is not None:
            learned |= dim_symbols(v.type.shape) - known
    return sorted(learned)


class _StorageGroups:
    """Which values share one buffer (a root and its views and in-place results), and the
    last step that reads each value."""

    def __init__(self, graph: Graph):
        self.last_read: dict[str, int] = {}
        for index, node in enumerate(graph.nodes):
            for name in reads(node):
                self.last_read[name] = index
        for v in graph.outputs:
            self.last_read[v.name] = len(graph.nodes)  # read by the caller, after every step
        self.members: dict[str, set[str]] = {}
        self.external = {v.name for v in graph.inputs} | {v.name for v in graph.outputs}
        self.values = {v.name: v for v in graph.values()}

    def join(self, root: str, name: str) -> None:
        self.members.setdefault(root, {root}).add(name)

    def last_use(self, root: str) -> int:
        return max(self.last_read.get(m, -1) for m in self.members.get(root, {root}))


def reads(node: Node) -> set[str]:
    """The computed values ``node`` reads: its inputs (which include the outer values its
    If/Loop/Scan bodies capture: see ``egraft.ir.ops.control``)."""
    return {v.name for v in node.inputs if v is not None and v.const is None}


def _same_size(a: Value | None, b: Value) -> bool:
    """True when ``a`` and ``b`` provably take the same number of bytes."""
    if a is None or a.type.shape is None or b.type.shape is None or a.type.dtype != b.type.dtype:
        return False
    return dims_equal(dim_product(a.type.shape), dim_product(b.type.shape))


def _same_shape(a: Value, b: Value) -> bool:
    if a.type.shape is None or b.type.shape is None or len(a.type.shape) != len(b.type.shape):
        return False
    return all(dims_equal(x, y) for x, y in zip(a.type.shape, b.type.shape))


def _reuse_a_dying_input(index: int, node: Node, storage: dict[str, str], slots: dict[str, int],
                         sharing: _StorageGroups, output_names: set[str], input_symbols: set[str]) -> None:
    """In place: an elementwise node whose input's buffer is read by no later step writes
    its output into that buffer (same shape and dtype). The output then takes the input's
    table slot, so the kernel sees one pointer and LLVM vectorizes without alias checks."""
    out = node.outputs[0]
    if len(node.outputs) != 1 or out is None or out.name in output_names:
        return
    if out.type.shape is None or not dim_symbols(out.type.shape) <= input_symbols:
        return  # a data-dependent size: allocated when produced
    for v in node.inputs:
        if v is None or v.const is not None:
            continue
        root = storage.get(v.name, v.name)
        if root in sharing.external or sharing.last_use(root) != index:
            continue
        if root != v.name and not _same_size(sharing.values.get(root), v):
            continue  # a view of part of its root (a contiguous Slice): the root's buffer is another size
        if v.type.dtype != out.type.dtype or not _same_shape(v, out):
            continue
        storage[out.name] = root
        slots[out.name] = slots[v.name]
        sharing.join(root, out.name)
        return


def _concat_in_place(node: Node, producers: dict[str, Step], storage: dict[str, str],
                     parts: dict[str, tuple[str, int, int]], sharing: _StorageGroups, output_names: set[str]) -> bool:
    """A Concat along an axis with only 1s before it (``[1, C/8, H, W, 8]`` on the channel
    blocks: each input is one contiguous range of the output) copies nothing: its inputs'
    kernels write straight into their ranges of its buffer. Taken when the output is not a
    graph output, every size is static and every range starts 64-byte aligned, and each
    input is a distinct value a kernel (or another such Concat) wrote, that owns its buffer
    (no view or in-place result shares it) and sits in no other Concat. An input that is
    such a Concat's output brings its own ranges along (DenseNet's growing concatenations
    become one buffer). Records the ranges in ``parts`` and returns True.

    Example: SqueezeNet's ``Concat(e1: f32[1, 8, 55, 55, 8], e3: f32[1, 8, 55, 55, 8], axis=1)``:
    e1 at byte 0, e3 at byte 774,400 of the Concat's buffer."""
    out = node.outputs[0]
    if len(node.outputs) != 1 or out is None or out.name in output_names or out.type.shape is None:
        return False
    shape = out.type.shape
    if not all(isinstance(d, int) for d in shape) or not shape:
        return False
    axis = int(node.attrs.get("axis", 0))
    axis = axis + len(shape) if axis < 0 else axis
    if not 0 <= axis < len(shape) or math.prod(shape[:axis]) != 1:
        return False
    inputs = list(node.inputs)
    if any(v is None for v in inputs) or len({v.name for v in inputs}) != len(inputs):
        return False
    ranges, offset = [], 0
    for v in inputs:
        step = producers.get(v.name)
        if v.const is not None or step is None or step.kind not in ("kernel", "placed") or v.name in output_names \
                or v.type.dtype != out.type.dtype or v.type.shape is None \
                or not all(isinstance(d, int) for d in v.type.shape):
            return False
        if storage.get(v.name, v.name) != v.name or v.name in parts or offset % ALIGNMENT:
            return False
        own = [name for name, (owner, _, _) in parts.items() if owner == v.name]
        if any(root == v.name and name not in own for name, root in storage.items()):
            return False  # a view or an in-place result lives in its buffer
        nbytes = math.prod(v.type.shape) * v.type.dtype.numpy.itemsize
        ranges.append((v, offset, nbytes, own))
        offset += nbytes
    for v, at, nbytes, own in ranges:
        for name in own:  # its own ranges move along with it
            _, inner, size = parts[name]
            parts[name] = (out.name, at + inner, size)
            storage[name] = out.name
            sharing.join(out.name, name)
        parts[v.name] = (out.name, at, nbytes)
        storage[v.name] = out.name
        sharing.join(out.name, v.name)
    return True


def _buffers(graph: Graph, steps: list[Step], storage: dict[str, str], input_symbols: set[str],
             parts: dict[str, tuple[str, int, int]] | None = None) -> tuple[list[BufferSpec], set[str]]:
    """Arena buffers: intermediate values (not inputs, constants, outputs or views), with
    their lifetimes extended over the views that read their storage (a Concat written in
    place: from its first input's kernel on); and the values whose size depends on dims
    that only their producer learns (allocated when it runs)."""
    parts = parts or {}
    outside = {v.name for v in graph.inputs} | {v.name for v in graph.outputs}
    dynamic: set[str] = set()
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    sizes: dict[str, object] = {}
    for k, step in enumerate(steps):
        for name in reads(step.node):
            root = storage.get(name, name)
            last[root] = max(last.get(root, k), k)
        if step.kind == "view":
            continue
        for v in step.node.outputs:
            if v is not None and v.name in parts:  # written in place into a Concat's buffer
                owner = parts[v.name][0]
                first[owner] = min(first.get(owner, k), k)
                last[owner] = max(last.get(owner, k), k)
                continue
            if v is not None and step.kind == "placed":
                first[v.name] = min(first.get(v.name, k), k)
                last[v.name] = max(last.get(v.name, k), k)
                sizes[v.name] = _nbytes(v)
                continue
            if v is None or v.name in storage:
                continue  # in place: it lives in an input's buffer
            size = _nbytes(v)
            if size is None or not dim_symbols([size]) <= input_symbols:
                dynamic.add(v.name)  # unknown rank or data-dependent size: allocated when produced
                continue
            if v.name in outside:
                continue
            first[v.name] = k
            last.setdefault(v.name, k)
            sizes[v.name] = size
    buffers = [BufferSpec(name, sizes[name], first[name], last[name]) for name in sorted(first, key=first.get)]
    return buffers, dynamic


def compile_lowered(lowered: Lowered, use_cache: bool = True, early: early_compile.Session | None = None):
    """Compile the lowered module and wrap it as a runnable model (``early``: the session of
    the model whose control-flow body ``lowered`` is; by default, ``lowered``'s own)."""
    from egraft.kernels.cpu.llvm import compile_objects
    from egraft.kernels.cpu.sgemm import SGEMM, library, library_loaded, library_module
    from egraft.lowering.runtime import CompiledModel

    start = time.perf_counter()
    modules = [lowered.kernels.stubs_text(), *lowered.kernels.modules.values()]
    compiled = None
    session = early or lowered.early  # the helper compiling the kernels since lowering emitted them
    try:
        if any(SGEMM in text for text in modules[1:]):  # the kernels call egraft_sgemm: load it first
            if use_cache and not library_loaded():  # compile it beside the kernels, into the disk cache
                objects, hits = compile_objects([library_module(), *modules], early=session)
                compiled = objects[1:], hits[1:]
            library()
        jit = JitModule(modules, use_cache=use_cache, compiled=compiled, early=session) \
            if lowered.kernels.calls else None
        bodies = {index: {attr: compile_lowered(sub, use_cache, session) for attr, sub in subs.items()}
                  for index, subs in lowered.bodies.items()}
    finally:
        if early is None:  # the outermost: its bodies' kernels were in the same session
            early_compile.end(session)
            lowered.early = None
    lowered.seconds["llvm"] = time.perf_counter() - start
    return CompiledModel(lowered, jit, bodies)


def compile_graph(graph: Graph, use_cache: bool = True):
    """Lower and compile ``graph`` for this CPU (see :func:`egraft.compile` for the whole
    pipeline with rewriting first)."""
    return compile_lowered(lower(graph), use_cache=use_cache)


__all__ = ["Step", "Lowered", "lower", "compile_lowered", "compile_graph", "VIEW_OPS", "llvm"]
