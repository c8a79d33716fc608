"""The IR: dims, types, the printed form (golden text), validation errors."""

from __future__ import annotations

import numpy as np
import pytest
import sympy
from conftest import symbolic_batch_model

import egraft
from egraft.errors import GraphError
from egraft.ir.dims import BroadcastError, broadcast_shapes, evaluate_dim, parse_dim, sym
from egraft.ir.dtypes import DType
from egraft.ir.graph import Graph, Node, Value, content_hash
from egraft.ir.types import TensorType

GOLDEN = """\
graph symbolic_mlp(%x: f32[batch, 2, 3]) {
  %0: i64[3] = Shape(%x)
  %1: i64[] = Gather(%0, @0) {axis=0}
  %2: i64[1] = Unsqueeze(%1, @1)
  %3: i64[2] = Concat(%2, @2) {axis=0}
  %4: f32[batch, 6] = Reshape(%x, %3)
  %5: f32[batch, 4] = MatMul(%4, @3)
  %6: f32[batch, 4] = Add(%5, @4)
  %7: f32[batch, 4] = Relu(%6)
  %y: f32[batch, 4] = Softmax(%7) {axis=-1}
  return %y
}
constants {
  @0: i64[] = [0]  # zero
  @1: i64[1] = [0]  # axes0
  @2: i64[1] = [-1]  # minus_one
  @3: f32[6, 4]  # W
  @4: f32[4] = [0.90347016, 0.0940123, -0.7434993, -0.9217254]  # B
}"""


def test_printed_form_is_the_golden_text():
    assert str(egraft.load(symbolic_batch_model())) == GOLDEN


def test_printing_is_deterministic_across_loads():
    assert str(egraft.load(symbolic_batch_model())) == str(egraft.load(symbolic_batch_model()))


def test_known_shape_values_carry_symbols():
    graph = egraft.load(symbolic_batch_model())
    shape_value = graph.known_values[graph.nodes[0].outputs[0].name]
    assert list(shape_value) == [sym("batch"), 2, 3]
    target = graph.known_values[graph.nodes[3].outputs[0].name]
    assert list(target) == [sym("batch"), -1]


def test_dims_simplify_parse_and_evaluate():
    b = sym("batch")
    assert sym("batch") is b
    assert parse_dim("2*batch") == 2 * b
    assert parse_dim("7") == 7
    assert evaluate_dim(2 * b + 1, {"batch": 3}) == 7
    assert broadcast_shapes((b, 1, 3), (4, 1)) == (b, 4, 3)
    with pytest.raises(BroadcastError, match="do not broadcast"):
        broadcast_shapes((2, 3), (4, 3))


def test_dims_equal_is_sound_and_refutes_different_dims():
    """``dims_equal`` says True only of dims equal at every size (a proof: it may miss some
    equal pairs), and False of dims that differ somewhere (refuted by a sample point before
    any proof runs)."""
    from egraft.ir.dims import dims_equal, evaluate_dim

    h, w = sym("h"), sym("w")
    pairs = [
        (sympy.floor((h - 1) / 2) + 1, sympy.ceiling(h / 2)),       # equal, proved by residues mod 2
        (sympy.floor((h - 1) / 2) + 1, sympy.floor(h / 2)),         # differ at odd h
        (sympy.Max(h, w) + sympy.floor(w / 32), sympy.Max(h, w)),   # differ from w = 32 on
        (2 * sympy.floor(h / 4), sympy.floor(h / 2)),               # differ at h = 2
        (h * w + h, h * (w + 1)),                                   # equal, proved
    ]
    for a, b in pairs:
        equal_everywhere = all(evaluate_dim(a, {"h": i, "w": j}) == evaluate_dim(b, {"h": i, "w": j})
                               for i in range(1, 70) for j in range(1, 70))
        if dims_equal(a, b):
            assert equal_everywhere, (a, b)
        else:
            assert not equal_everywhere, (a, b)
    assert dims_equal(h * w + h, h * (w + 1))
    assert dims_equal(sympy.floor((h - 1) / 2) + 1, sympy.ceiling(h / 2))


def test_a_maximum_of_canonical_dims_is_kept_as_simplify_would_keep_it():
    # ppocr_v4_det's nested maxima of feature-map sides: each argument canonical already, the
    # maximum is taken as sympy built it (no simplify); simplify gives the same expression
    import egraft.ir.dims as dims

    h = sym("h_max_test")
    side = [dims.simplify_dim(sympy.floor((h - 1) / s) + 1) for s in (4, 8, 16, 32)]
    inner = sympy.Max(2 * side[3] + 1, side[2])
    nested = sympy.Max(side[0], 2 * sympy.Max(side[1], 2 * inner))
    for expr in (inner, nested, 3 * nested + side[0], sympy.Min(side[1], side[2])):
        assert dims.simplify_dim(expr) == sympy.simplify(expr)
    assert dims._built_from_canonical(nested)
    assert not dims._built_from_canonical(sympy.Max(h, (h ** 2 - 1) / (h - 1), evaluate=False))  # h + 1 in disguise


def test_dims_equal_proves_a_detectors_upsampled_sides_by_residues():
    """A detector adds a feature map upsampled 2x to one downsampled once less: its sides
    ``2*floor((h - 1)/32) + 2`` and ``floor((h - 1)/16) + 1`` differ, and the broadcast keeps
    their maximum, which equals the first side. Residues mod 32 prove it (sympy's simplify
    took a second per pair and did not); the proof agrees with evaluation at every size."""
    from egraft.ir.dims import _zero_by_residues, dims_equal, evaluate_dim

    h, w = sym("h"), sym("w")
    up = 2 * sympy.floor((h - 1) / 32) + 2
    side = sympy.floor((h - 1) / 16) + 1
    cases = [
        (sympy.Max(up, side), up, True),
        (sympy.Max(sympy.floor((h - 1) / 8) + 1, 2 * sympy.Max(up, side)), 2 * up, True),
        (sympy.Max(up, side + 1), up, False),                    # side + 1 exceeds up when (h-1) % 32 >= 16
        (sympy.floor(h / 4) + sympy.floor((h + 2) / 4), sympy.floor((h + 1) / 2), False),
        (sympy.floor(h / 4) + sympy.floor((h + 2) / 4), sympy.floor(h / 2), True),
        (sympy.floor(h / 2) + w, sympy.ceiling((h - 1) / 2) + w, True),
    ]
    for a, b, equal in cases:
        everywhere = all(evaluate_dim(a, {"h": i, "w": 5}) == evaluate_dim(b, {"h": i, "w": 5}) for i in range(1, 200))
        assert everywhere == equal, (a, b)
        assert dims_equal(a, b) == equal, (a, b)
    assert _zero_by_residues(sympy.Max(up, side + 1) - up) is False  # decided: differs in half the classes
    assert _zero_by_residues(sympy.Max(h, 40) - h) is None  # the maximum crosses over at h = 40: undecided


def test_tensor_type_text_and_binding():
    t = TensorType(DType.FLOAT16, (sym("n"), 2 * sym("n"), 5))
    assert str(t) == "f16[n, 2*n, 5]"
    assert t.bind({"n": 3}).shape == (3, 6, 5)
    assert TensorType.of(np.zeros((2, 3), np.int64)) == TensorType(DType.INT64, (2, 3))
    assert isinstance(TensorType(DType.FLOAT32, (sympy.Integer(4),)).shape[0], int)


def test_content_hash_tells_shapes_and_dtypes_apart():
    assert content_hash(np.array(0, np.int64)) != content_hash(np.array([0], np.int64))
    assert content_hash(np.array([0], np.int32)) != content_hash(np.array([0], np.int64))
    assert content_hash(np.arange(3.0)) == content_hash(np.arange(3.0))


def _tiny_graph(nodes, inputs, outputs) -> Graph:
    return Graph("g", inputs, outputs, nodes, opsets={"": 17})


F3 = TensorType(DType.FLOAT32, (3,))


def test_validation_finds_a_dangling_value():
    x, ghost, y = Value("x", F3), Value("ghost", F3), Value("y", F3)
    g = _tiny_graph([Node("Add", (x, ghost), (y,), name="add1")], [x], [y])
    with pytest.raises(GraphError, match=r"Add 'add1' reads %ghost, which nothing defines \(a dangling value\)"):
        g.validate()


def test_validation_finds_a_cycle():
    x, a, b = Value("x", F3), Value("a", F3), Value("b", F3)
    g = _tiny_graph([Node("Add", (x, b), (a,), name="n1"), Node("Relu", (a,), (b,), name="n2")], [x], [b])
    with pytest.raises(GraphError, match="cycle"):
        g.validate()


def test_validation_finds_a_type_mismatch():
    x = Value("x", F3)
    y = Value("y", TensorType(DType.FLOAT32, (4,)))
    g = _tiny_graph([Node("Relu", (x,), (y,), name="r")], [x], [y])
    with pytest.raises(GraphError, match=r"Relu 'r': output %y is declared f32\[4\], but the op gives f32\[3\]"):
        g.validate()


def test_validation_finds_a_double_definition():
    x, y = Value("x", F3), Value("y", F3)
    g = _tiny_graph([Node("Relu", (x,), (y,), name="r1"), Node("Relu", (x,), (y,), name="r2")], [x], [y])
    with pytest.raises(GraphError, match="value %y is defined twice: by Relu 'r1' and by Relu 'r2'"):
        g.validate()


def test_imported_models_validate():
    egraft.load(symbolic_batch_model()).validate()
