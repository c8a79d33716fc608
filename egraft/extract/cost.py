"""Cost models: what an e-node costs, so that extraction can pick the cheapest program.

Three models, each named (``--cost-model``) and described by its parameters:

- ``nodes``: every op costs 1 (inputs, constants and output projections 0). The fewest ops win.
- ``flops``: an op costs its arithmetic (``Work.flops``) plus 1, so among programs with the
  same arithmetic the one with fewer ops wins.
- ``roofline``: an op costs its estimated time in microseconds on a target profile:
  ``max(flops / (peak * efficiency[family]), bytes moved / (bandwidth * bandwidth_efficiency[family]))
  + launches * (launch_us + call_us[family])``.
  A fused op pays memory traffic only for its own (external) inputs and outputs, a layout
  transform pays its copy, a view (Reshape, Squeeze...) pays nothing.

Shapes come from the e-class types (the op registry's inference); symbolic dims take the
values of ``bindings`` (``--shape batch=8``) or :func:`egraft.ir.work.default_dim`.

Example:
    >>> model = cost_model("roofline", profile="cuda-h200")
    >>> model.name
    'roofline'
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from egraft.errors import EgraftError
from egraft.extract.profiles import Profile, load_profile
from egraft.ir.graph import Graph, Node
from egraft.ir.registry import get_op
from egraft.ir.work import Work, op_work
from egraft.rewrite.egraph import ABSENT, CONST, INPUT, OUT, ENode, Snapshot

#: E-nodes that cost nothing under every model: leaves and the projections of tuples.
FREE_OPS = (CONST, INPUT, OUT, ABSENT)
COST_MODELS = ("nodes", "flops", "roofline")


class CostModel:
    """The cost of e-nodes. Subclasses define :meth:`op_cost`; leaves are free."""

    name = "cost"
    unit = ""
    #: Whether :func:`unextractable` e-nodes may be picked too: the soundness checker runs a
    #: rule's replacement as the rule built it, before any fold (compiles never do).
    picks_unfolded = False

    def __init__(self, bindings: Mapping[str, int] | None = None):
        self.bindings = dict(bindings or {})

    def op_cost(self, work: Work, node: ENode) -> float:
        raise NotImplementedError

    def settings(self) -> dict:
        """The model's name and parameters (recorded in plans)."""
        return {"name": self.name, "unit": self.unit, "bindings": dict(sorted(self.bindings.items()))}

    def work(self, snapshot: Snapshot, c: int, node: ENode) -> Work:
        """The work of ``node`` (in e-class ``c``) at the shapes of its e-classes."""
        inputs = [None if snapshot.is_absent(ch) else snapshot.type_of(ch) for ch in node.children]
        own = snapshot.type_of(c)
        outputs = list(own) if isinstance(own, tuple) else [own]
        return op_work(node.op, node.domain, snapshot.attrs(node), inputs, outputs, self.bindings,
                       snapshot.state.opsets.get("", 21))

    def node_work(self, graph: Graph, node: Node) -> Work:
        """The work of ``node``, an op of ``graph`` (an extracted or compiled graph), at the
        types of its values: what :meth:`work` gives the e-node it was extracted from."""
        inputs = [None if v is None else v.type for v in node.inputs]
        outputs = [None if v is None else v.type for v in node.outputs]
        return op_work(node.op, node.domain, node.attrs, inputs, outputs, self.bindings, graph.opsets.get("", 21))

    def node_cost(self, graph: Graph, node: Node) -> float:
        """The cost of ``node``, an op of ``graph``, as extraction priced it.

        Example:
            >>> g = egraft.load("model.onnx")                                   # doctest: +SKIP
            >>> cost_model("roofline").node_cost(g, g.nodes[0])                 # doctest: +SKIP
            12.5
        """
        return self.op_cost(self.node_work(graph, node), None)

    def cost(self, snapshot: Snapshot, c: int, node: ENode) -> float:
        """The cost of e-node ``node`` of e-class ``c``."""
        if node.op in FREE_OPS:
            return 0
        return self.op_cost(self.work(snapshot, c, node), node)

    def table(self, snapshot: Snapshot) -> dict[int, list[float]]:
        """The cost of every e-node: class -> costs in the order of ``snapshot.classes[c]``
        (``math.inf`` for an :func:`unextractable` one)."""
        memo: dict[tuple, float] = {}
        input_keys: dict[int, object] = {}  # e-class -> its type as an input

        def input_key(ch: int):
            k = input_keys.get(ch)
            if k is None:
                k = input_keys[ch] = _type_key(None if snapshot.is_absent(ch) else snapshot.type_of(ch))
            return k

        out: dict[int, list[float]] = {}
        for c in sorted(snapshot.classes):
            costs = []
            own_key = None
            for n in snapshot.classes[c]:
                if n.op in FREE_OPS:
                    costs.append(0)
                    continue
                if not self.picks_unfolded and unextractable(n):
                    costs.append(math.inf)
                    continue
                if own_key is None:
                    own_key = _type_key(snapshot.type_of(c))
                key = (n.op, n.domain, n.attrs, own_key, tuple(input_key(ch) for ch in n.children))
                if key not in memo:
                    memo[key] = self.cost(snapshot, c, n)
                costs.append(memo[key])
            out[c] = costs
        return out


def unextractable(node: ENode) -> bool:
    """Whether extraction must not pick ``node``: an op that exists only to be folded
    (``OpDef.folded_only``, e.g. ``WinogradWeights``); its cost in :meth:`CostModel.table`
    is infinite and the extractors skip it.

    Example:
        >>> unextractable(ENode("WinogradWeights", "com.egraft", "", (4,)))
        True
    """
    op = get_op(node.op, node.domain)
    return op is not None and op.folded_only


def _type_key(t):
    """A memo key for a type: the type itself (hashable; printing its dims is slow)."""
    return t


class NodeCount(CostModel):
    """``nodes``: every op costs 1 (integers, so totals stay exact on any graph)."""

    name = "nodes"
    unit = "ops"

    def op_cost(self, work: Work, node: ENode | None) -> float:
        return 1

    def cost(self, snapshot: Snapshot, c: int, node: ENode) -> float:
        return 0 if node.op in FREE_OPS else 1


class FlopCount(CostModel):
    """``flops``: arithmetic operations of the op plus 1 (ties go to fewer ops)."""

    name = "flops"
    unit = "flop"

    def op_cost(self, work: Work, node: ENode) -> float:
        return work.flops + 1


class Roofline(CostModel):
    """``roofline``: estimated microseconds on ``profile``.

    Example:
        >>> from egraft.extract.profiles import Profile
        >>> r = Roofline(Profile("toy", "cpu", peak_gflops=1.0, bandwidth_gbs=1.0, launch_us=0.5))
        >>> r.op_cost(Work(2000.0, "gemm", reads=500.0, writes=500.0), None)   # 2 us of compute, 1 of traffic
        2.5
    """

    name = "roofline"
    unit = "us"

    def __init__(self, profile: Profile, bindings: Mapping[str, int] | None = None):
        super().__init__(bindings)
        self.profile = profile

    def op_cost(self, work: Work, node: ENode | None) -> float:
        p = self.profile
        if work.family in p.unavailable:
            return math.inf  # the target has no kernel of this family
        compute = work.flops / (p.peak_gflops * p.family_efficiency(work.family) * 1e3)
        traffic = ((work.reads or 0.0) + (work.writes or 0.0)) / (p.family_bandwidth(work.family) * 1e3)
        return max(compute, traffic) + work.launches * (p.launch_us + p.family_call_us(work.family))

    def settings(self) -> dict:
        return {**super().settings(), "profile": self.profile.settings()}


class PerOp(CostModel):
    """A cost given by a function of the e-node alone (tests and experiments)."""

    name = "custom"

    def __init__(self, fn: Callable[[ENode], float]):
        super().__init__()
        self.fn = fn

    def cost(self, snapshot: Snapshot, c: int, node: ENode) -> float:
        return self.fn(node)


def cost_model(name: str = "nodes", profile: str | Profile | None = None, target: str = "cpu",
               bindings: Mapping[str, int] | None = None) -> CostModel:
    """The cost model ``name`` (``nodes``, ``flops`` or ``roofline``); ``roofline`` reads
    ``profile`` (a name or TOML path; default: the target's profile)."""
    from egraft.extract.profiles import TARGET_PROFILES

    if name == "nodes":
        return NodeCount(bindings)
    if name == "flops":
        return FlopCount(bindings)
    if name == "roofline":
        if target not in TARGET_PROFILES:
            raise EgraftError(f"--target {target}: unknown target; known: {', '.join(sorted(TARGET_PROFILES))}")
        if not isinstance(profile, Profile):
            profile = load_profile(profile or TARGET_PROFILES[target])
        return Roofline(profile, bindings)
    raise EgraftError(f"--cost-model {name}: unknown cost model; known: {', '.join(COST_MODELS)}")


def as_cost_model(cost) -> CostModel:
    """A :class:`CostModel` from a model or from a plain ``ENode -> cost`` function."""
    if isinstance(cost, CostModel):
        return cost
    if callable(cost):
        return PerOp(cost)
    raise TypeError(f"not a cost model: {cost!r}")
