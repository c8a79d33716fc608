"""LSTM, GRU and RNN: egraft's kernels against onnxruntime, and shape inference."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from conftest import SATURATING_REFERENCE, onnxruntime_saturates_integer_products, reference_options
from onnx import helper

import egraft
from egraft.errors import ShapeInferenceError

SEQ, BATCH, INPUT, HIDDEN = 5, 3, 4, 6
GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
INPUT_NAMES = ["X", "W", "R", "B", "sequence_lens", "initial_h", "initial_c", "P"]


def _inputs(op: str, num_dir: int, layout: int, rng, *, dtype=np.float32, with_b=True, seq_lens=False,
            initial=False, peephole=False) -> dict[str, np.ndarray]:
    """Random inputs of one recurrent node, keyed by their ONNX input names."""
    g = GATES[op]
    x_shape = (BATCH, SEQ, INPUT) if layout else (SEQ, BATCH, INPUT)
    state_shape = (BATCH, num_dir, HIDDEN) if layout else (num_dir, BATCH, HIDDEN)
    feeds = {
        "X": rng.standard_normal(x_shape),
        "W": rng.standard_normal((num_dir, g * HIDDEN, INPUT)) * 0.5,
        "R": rng.standard_normal((num_dir, g * HIDDEN, HIDDEN)) * 0.5,
    }
    if with_b:
        feeds["B"] = rng.standard_normal((num_dir, 2 * g * HIDDEN)) * 0.5
    if seq_lens:
        feeds["sequence_lens"] = np.array([SEQ, 2, 4][:BATCH], dtype=np.int32)
    if initial:
        feeds["initial_h"] = rng.standard_normal(state_shape)
        if op == "LSTM":
            feeds["initial_c"] = rng.standard_normal(state_shape)
    if peephole:
        feeds["P"] = rng.standard_normal((num_dir, 3 * HIDDEN)) * 0.5
    return {k: v if v.dtype.kind == "i" else v.astype(dtype) for k, v in feeds.items()}


def _model(op: str, feeds: dict[str, np.ndarray], outputs: list[str], opset: int,
           dims: dict[str, list] | None = None, **attrs) -> onnx.ModelProto:
    names = INPUT_NAMES if op == "LSTM" else INPUT_NAMES[:6]
    last = max(i for i, n in enumerate(names) if n in feeds)
    node_inputs = [n if n in feeds else "" for n in names[: last + 1]]
    node = helper.make_node(op, node_inputs, outputs, **attrs)
    dims = dims or {}
    graph_inputs = [
        helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), dims.get(n, list(a.shape)))
        for n, a in feeds.items()
    ]
    elem = helper.np_dtype_to_tensor_dtype(feeds["X"].dtype)
    graph_outputs = [helper.make_tensor_value_info(o, elem, None) for o in outputs if o]
    graph = helper.make_graph([node], "g", graph_inputs, graph_outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _check_against_ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray], tol: float = 1e-5) -> dict:
    graph = egraft.load(model)
    got = graph.run(feeds)
    sess = onnxruntime.InferenceSession(model.SerializeToString(), reference_options(),
                                        providers=["CPUExecutionProvider"])
    names = [o.name for o in model.graph.output]
    want = dict(zip(names, sess.run(names, feeds)))
    for name in names:
        assert got[name].dtype == want[name].dtype, name
        assert got[name].shape == want[name].shape, name
        np.testing.assert_allclose(got[name], want[name], rtol=tol, atol=tol, err_msg=name)
    return got


DIRECTIONS = {"forward": 1, "reverse": 1, "bidirectional": 2}


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
def test_all_inputs_against_onnxruntime(op, direction):
    rng = np.random.default_rng(0)
    num_dir = DIRECTIONS[direction]
    feeds = _inputs(op, num_dir, 0, rng, seq_lens=True, initial=True, peephole=op == "LSTM")
    outputs = ["Y", "Y_h", "Y_c"] if op == "LSTM" else ["Y", "Y_h"]
    model = _model(op, feeds, outputs, 14, direction=direction, hidden_size=HIDDEN)
    got = _check_against_ort(model, feeds)
    # padding steps past each sequence's end are zero in Y
    assert np.all(got["Y"][2:, :, 1] == 0)


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_layout_1_against_onnxruntime_layout_0(op):
    # onnxruntime has no batch-major kernels: run it on the transposed (layout 0) problem
    rng = np.random.default_rng(1)
    feeds = _inputs(op, 2, 0, rng, initial=True, seq_lens=True)
    outputs = ["Y", "Y_h", "Y_c"] if op == "LSTM" else ["Y", "Y_h"]
    model0 = _model(op, feeds, outputs, 14, direction="bidirectional", hidden_size=HIDDEN)
    want = _check_against_ort(model0, feeds)
    batch_major = {k: np.swapaxes(v, 0, 1) if k in ("X", "initial_h", "initial_c") else v for k, v in feeds.items()}
    model1 = _model(op, batch_major, outputs, 14, direction="bidirectional", hidden_size=HIDDEN, layout=1)
    got = egraft.load(model1).run(batch_major)
    np.testing.assert_allclose(got["Y"], np.transpose(want["Y"], (2, 0, 1, 3)), rtol=1e-6, atol=1e-6)
    for name in outputs[1:]:
        np.testing.assert_allclose(got[name], np.swapaxes(want[name], 0, 1), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_clip_and_no_bias(op):
    rng = np.random.default_rng(2)
    feeds = _inputs(op, 1, 0, rng, with_b=False)
    feeds["X"] = feeds["X"] * 4
    model = _model(op, feeds, ["Y", "Y_h"], 7, hidden_size=HIDDEN, clip=0.7)
    _check_against_ort(model, feeds)


def test_lstm_input_forget_and_peepholes():
    rng = np.random.default_rng(3)
    feeds = _inputs("LSTM", 1, 0, rng, initial=True, peephole=True)
    model = _model("LSTM", feeds, ["Y", "Y_h", "Y_c"], 14, hidden_size=HIDDEN, input_forget=1, clip=1.5)
    _check_against_ort(model, feeds)


@pytest.mark.parametrize("lbr", [0, 1])
def test_gru_linear_before_reset(lbr):
    rng = np.random.default_rng(4)
    feeds = _inputs("GRU", 2, 0, rng, initial=True, seq_lens=True)
    model = _model("GRU", feeds, ["Y", "Y_h"], 14, hidden_size=HIDDEN, direction="bidirectional",
                   linear_before_reset=lbr)
    _check_against_ort(model, feeds)


@pytest.mark.parametrize(
    ("op", "activations", "alpha", "beta"),
    [
        ("LSTM", ["HardSigmoid", "LeakyRelu", "ScaledTanh"], [0.3, 0.05, 1.2], [0.4, 0.7]),
        ("LSTM", ["Sigmoid", "Softsign", "Elu"], [0.8], []),
        ("GRU", ["Affine", "ThresholdedRelu"], [0.5, 0.1], [0.2]),
        ("GRU", ["Sigmoid", "Softplus", "Sigmoid", "Relu"], [], []),
        ("RNN", ["Relu", "LeakyRelu"], [0.2], []),
        ("RNN", ["HardSigmoid"], [], []),
    ],
)
def test_activations_against_onnxruntime(op, activations, alpha, beta):
    rng = np.random.default_rng(5)
    per_dir = {"LSTM": 3, "GRU": 2, "RNN": 1}[op]
    direction = "bidirectional" if len(activations) == 2 * per_dir else "forward"
    feeds = _inputs(op, DIRECTIONS[direction], 0, rng)
    attrs = {"activations": activations}
    if alpha:
        attrs["activation_alpha"] = alpha
    if beta:
        attrs["activation_beta"] = beta
    model = _model(op, feeds, ["Y", "Y_h"], 14, hidden_size=HIDDEN, direction=direction, **attrs)
    _check_against_ort(model, feeds)


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_optional_outputs_and_hidden_size_from_r(op):
    rng = np.random.default_rng(6)
    feeds = _inputs(op, 1, 0, rng)
    outputs = ["", "Y_h"] if op != "LSTM" else ["", "", "Y_c"]
    graph = egraft.load(_model(op, feeds, outputs, 22))  # no hidden_size attribute: taken from R
    assert [str(v.type) for v in graph.outputs] == [f"f32[1, {BATCH}, {HIDDEN}]"]
    want = _check_against_ort(_model(op, feeds, outputs, 22, hidden_size=HIDDEN), feeds)
    got = graph.run(feeds)
    np.testing.assert_array_equal(got[outputs[-1]], want[outputs[-1]])


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize(("dtype", "tol"), [(np.float64, 1e-5), (np.float16, 2e-2)])
def test_other_float_types_match_float32_onnxruntime(op, dtype, tol):
    # onnxruntime's CPU kernels are float32-only: compare at the accuracy of the narrower type
    rng = np.random.default_rng(7)
    feeds = _inputs(op, 2, 0, rng, dtype=dtype, initial=True, seq_lens=True)
    outputs = ["Y", "Y_h", "Y_c"] if op == "LSTM" else ["Y", "Y_h"]
    got = egraft.load(_model(op, feeds, outputs, 14, direction="bidirectional", hidden_size=HIDDEN)).run(feeds)
    feeds32 = {k: v.astype(np.float32) if v.dtype.kind == "f" else v for k, v in feeds.items()}
    want = _check_against_ort(_model(op, feeds32, outputs, 14, direction="bidirectional", hidden_size=HIDDEN),
                              feeds32)
    for name in outputs:
        assert got[name].dtype == dtype
        np.testing.assert_allclose(got[name].astype(np.float32), want[name], rtol=tol, atol=tol)


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("layout", [0, 1])
def test_shape_inference_matches_onnx(op, layout):
    rng = np.random.default_rng(8)
    feeds = _inputs(op, 2, layout, rng)
    outputs = ["Y", "Y_h", "Y_c"] if op == "LSTM" else ["Y", "Y_h"]
    model = _model(op, feeds, outputs, 14, direction="bidirectional", hidden_size=HIDDEN, layout=layout)
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    onnx_types = {}
    for vi in inferred.graph.output:
        onnx_types[vi.name] = [d.dim_value for d in vi.type.tensor_type.shape.dim]
    graph = egraft.load(model)
    for v in graph.outputs:
        assert list(v.type.shape) == onnx_types[v.name]


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_symbolic_seq_and_batch(op):
    rng = np.random.default_rng(9)
    feeds = _inputs(op, 2, 0, rng, initial=True, seq_lens=True)
    dims = {"X": ["seq", "batch", INPUT], "initial_h": [2, "batch", HIDDEN], "initial_c": [2, "batch", HIDDEN],
            "sequence_lens": ["batch"]}
    outputs = ["Y", "Y_h", "Y_c"] if op == "LSTM" else ["Y", "Y_h"]
    model = _model(op, feeds, outputs, 14, dims=dims, direction="bidirectional", hidden_size=HIDDEN)
    graph = egraft.load(model)
    assert str(graph.outputs[0].type) == f"f32[seq, 2, batch, {HIDDEN}]"
    assert str(graph.outputs[1].type) == f"f32[2, batch, {HIDDEN}]"
    _check_against_ort(model, feeds)


def test_symbolic_layout_1():
    rng = np.random.default_rng(10)
    feeds = _inputs("GRU", 1, 1, rng)
    model = _model("GRU", feeds, ["Y", "Y_h"], 14, dims={"X": ["batch", "seq", INPUT]}, hidden_size=HIDDEN,
                   layout=1)
    graph = egraft.load(model)
    assert [str(v.type) for v in graph.outputs] == [f"f32[batch, seq, 1, {HIDDEN}]", f"f32[batch, 1, {HIDDEN}]"]


@pytest.mark.parametrize("name", ["W", "R", "B"])
def test_wrong_weight_shape_is_reported(name):
    rng = np.random.default_rng(11)
    feeds = _inputs("LSTM", 1, 0, rng)
    feeds[name] = feeds[name][:, :-1]
    model = _model("LSTM", feeds, ["Y"], 14, hidden_size=HIDDEN)
    with pytest.raises(ShapeInferenceError, match=f"{name}.shape"):
        egraft.load(model)



# ---- onnxruntime's DynamicQuantizeLSTM -----------------------------------------------------------
@pytest.mark.parametrize(("seq", "batch", "inputs", "hidden", "direction", "per_column", "states"), [
    (5, 2, 8, 4, "forward", False, False),
    (7, 3, 16, 8, "bidirectional", False, True),
    (6, 1, 12, 8, "bidirectional", True, False),
    (4, 2, 8, 4, "reverse", True, True),
])
def test_dynamic_quantize_lstm_computes_what_onnxruntime_computes(seq, batch, inputs, hidden, direction, per_column,
                                                                  states):
    """int8 weights (onnxruntime refuses uint8 ones), activations quantized to uint8 as
    the layer runs: both backends agree with onnxruntime to float rounding, not to a
    quantization step."""
    if onnxruntime_saturates_integer_products():
        pytest.skip(SATURATING_REFERENCE)
    from onnx import TensorProto, helper, numpy_helper

    import egraft
    from egraft.lowering.compile import compile_graph
    from egraft.testing.corpus.compare import judge_session

    rng = np.random.default_rng(seq * 100 + hidden)
    num_dir = 2 if direction == "bidirectional" else 1
    w = rng.integers(-127, 128, size=(num_dir, inputs, 4 * hidden)).astype(np.int8)
    r = rng.integers(-127, 128, size=(num_dir, hidden, 4 * hidden)).astype(np.int8)
    scale_shape = (num_dir, 4 * hidden) if per_column else (num_dir,)
    zero = lambda: np.zeros(scale_shape, np.int8)  # noqa: E731
    arrays = {"W": w, "R": r, "B": rng.normal(size=(num_dir, 8 * hidden)).astype(np.float32),
              "ws": rng.uniform(0.001, 0.01, size=scale_shape).astype(np.float32), "wz": zero(),
              "rs": rng.uniform(0.001, 0.01, size=scale_shape).astype(np.float32), "rz": zero()}
    state_inputs = ["h0", "c0"] if states else ["", ""]
    node = helper.make_node("DynamicQuantizeLSTM", ["x", "W", "R", "B", "", *state_inputs, "", "ws", "wz", "rs", "rz"],
                            ["y", "y_h", "y_c"], domain="com.microsoft", hidden_size=hidden, direction=direction)
    graph_inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["s", "b", inputs])]
    feeds = {"x": rng.normal(size=(seq, batch, inputs)).astype(np.float32)}
    if states:
        for name in ("h0", "c0"):
            graph_inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, [num_dir, "b", hidden]))
            feeds[name] = rng.normal(size=(num_dir, batch, hidden)).astype(np.float32)
    model = helper.make_model(helper.make_graph(
        [node], "dq_lstm", graph_inputs, [helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
                                          for n in ("y", "y_h", "y_c")],
        [numpy_helper.from_array(a, n) for n, a in arrays.items()]),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    # One thread: with more, onnxruntime cuts the batch into chunks and quantizes each
    # chunk's hidden state with its own range (its result depends on the thread count).
    session = judge_session(model)
    want = dict(zip(["y", "y_h", "y_c"], session.run(["y", "y_h", "y_c"], feeds)))
    first = 0 if direction == "forward" else seq - 1  # the step that reads only X and the initial state
    for got in (egraft.load(model).run(feeds), compile_graph(egraft.load(model)).run(feeds)):
        for name, value in want.items():
            assert got[name].shape == value.shape
        # The first step quantizes the same floats as onnxruntime: equal to float rounding
        # (a one-quantum difference would be about 1e-3 here).
        np.testing.assert_allclose(got["y"][first, -1 if direction == "reverse" else 0],
                                   want["y"][first, -1 if direction == "reverse" else 0], rtol=0, atol=1e-5)
        # Later steps quantize hidden states computed with other tanh/sigmoid roundings:
        # a value on a rounding edge may move one quantum (1/255 of the state's range).
        assert np.abs(got["y"] - want["y"]).max() <= 1e-2 * np.abs(want["y"]).max()
    exported = egraft.to_onnx(egraft.load(model))  # exports as onnxruntime's op
    np.testing.assert_array_equal(judge_session(exported).run(["y"], feeds)[0], want["y"])
