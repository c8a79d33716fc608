"""The models that ship with the onnx package, and ways to make them prove something.

The "light" model zoo (``onnx/backend/test/data/light``) holds nine classic CNNs with
their expected outputs. Their weights are ``ConstantOfShape`` nodes (uniform values),
so those outputs prove little: :func:`reweight` replaces every such weight with seeded
random values of the right scale, and the tests compare egraft with onnxruntime on the
re-weighted model.

Example:
    >>> model = reweight(onnx.load(light_model_path("resnet50")), seed=0)  # doctest: +SKIP
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

LIGHT_MODELS = ("bvlc_alexnet", "densenet121", "inception_v1", "inception_v2", "resnet50",
                "shufflenet", "squeezenet", "vgg19", "zfnet512")


def light_dir() -> Path:
    """The folder of the onnx package's light models."""
    return Path(os.path.dirname(onnx.__file__)) / "backend" / "test" / "data" / "light"


def light_model_path(name: str) -> Path:
    """The path of ``light_<name>.onnx`` (``name`` as in :data:`LIGHT_MODELS`)."""
    path = light_dir() / f"light_{name}.onnx"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; the installed onnx package has no light model {name!r}")
    return path


def model_path(model: str) -> Path:
    """A model path, or the path of a bundled light model when ``model`` names one
    (``resnet50`` or ``light_resnet50``); ModelError otherwise.

    Example:
        >>> model_path("resnet50").name
        'light_resnet50.onnx'
    """
    from egraft.errors import ModelError

    path = Path(model)
    if path.exists() or path.suffix == ".onnx" or "/" in model:
        return path
    name = model.removeprefix("light_")
    if name in LIGHT_MODELS:
        return light_model_path(name)
    raise ModelError(f"{model}: no such file, and not a bundled model (bundled: {', '.join(LIGHT_MODELS)})")


def light_expected_output(name: str) -> np.ndarray:
    """The shipped expected output of a light model (``light_<name>_output_0.pb``)."""
    tensor = onnx.TensorProto()
    tensor.ParseFromString((light_dir() / f"light_{name}_output_0.pb").read_bytes())
    return numpy_helper.to_array(tensor)


def runtime_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """The graph inputs that are not initializers (old models list weights as inputs)."""
    inits = {t.name for t in model.graph.initializer}
    return [i for i in model.graph.input if i.name not in inits]


def backend_input(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """The input onnx's own backend runner makes: ``arange(n).reshape(shape) / n`` in float32."""
    feeds = {}
    for vi in runtime_inputs(model):
        shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        n = int(np.prod(shape))
        feeds[vi.name] = (np.arange(n).reshape(shape) / n).astype(np.float32)
    return feeds


def _role(model: onnx.ModelProto, name: str, consumers: dict) -> tuple[str, int, onnx.NodeProto | None]:
    """(op, input index, node) of the first consumer of ``name`` that is not a reshape-like op."""
    for _ in range(4):
        users = consumers.get(name, [])
        if not users:
            return "", -1, None
        node, index = users[0]
        if node.op_type in ("Unsqueeze", "Reshape", "Squeeze", "Identity", "Cast") and index == 0:
            name = node.output[0]
            continue
        return node.op_type, index, node
    return "", -1, None


def _random_weight(rng: np.random.Generator, shape: tuple, role: tuple, dtype) -> np.ndarray:
    op, index, node = role
    if op in ("Conv", "ConvTranspose") and index == 1:
        fan_in = int(np.prod(shape[1:])) or 1
        values = rng.normal(0.0, np.sqrt(2.0 / fan_in), shape)
    elif op in ("Gemm", "MatMul") and index == 1:
        trans_b = any(a.name == "transB" and a.i for a in node.attribute) if node is not None else False
        fan_in = shape[-1] if trans_b else shape[0]
        values = rng.normal(0.0, np.sqrt(2.0 / max(fan_in, 1)), shape)
    elif op == "BatchNormalization" and index == 1:
        values = rng.uniform(0.5, 1.5, shape)
    elif op == "BatchNormalization" and index == 4:
        values = rng.uniform(0.5, 1.5, shape)  # variances stay positive
    elif op == "Mul":
        values = rng.uniform(0.5, 1.5, shape)
    else:  # biases, means, shifts
        values = rng.normal(0.0, 0.1, shape)
    return values.astype(dtype)


def reweight(model: onnx.ModelProto, seed: int = 0) -> onnx.ModelProto:
    """A copy of ``model`` whose constant-filled weights hold seeded random values.

    Every ``ConstantOfShape`` node with a constant shape becomes an initializer: He-scaled
    normal values for Conv/Gemm weights, values in [0.5, 1.5] for BatchNormalization
    scales and variances (variances stay positive) and for Mul factors, small normal
    values for biases, means and shifts.
    """
    model = onnx.ModelProto.FromString(model.SerializeToString())
    rng = np.random.default_rng(seed)
    graph = model.graph
    inits = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    consts = {n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in graph.node
              if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"}
    consumers: dict[str, list] = {}
    for node in graph.node:
        for i, x in enumerate(node.input):
            consumers.setdefault(x, []).append((node, i))
    kept = []
    new_inits = []
    for node in graph.node:
        shape_name = node.input[0] if node.op_type == "ConstantOfShape" else None
        shape = inits.get(shape_name, consts.get(shape_name)) if shape_name else None
        if shape is None:
            kept.append(node)
            continue
        value = next((numpy_helper.to_array(a.t) for a in node.attribute if a.name == "value"),
                     np.zeros(1, np.float32))
        if value.dtype.kind != "f":
            kept.append(node)
            continue
        role = _role(model, node.output[0], consumers)
        array = _random_weight(rng, tuple(int(d) for d in shape), role, value.dtype)
        new_inits.append(numpy_helper.from_array(array, node.output[0]))
    del graph.node[:]
    graph.node.extend(kept)
    used = {x for node in kept for x in node.input} | {o.name for o in graph.output}
    unused = [t for t in graph.initializer if t.name not in used]
    for t in unused:
        graph.initializer.remove(t)
    unused_names = {t.name for t in unused}
    listed = [i for i in graph.input if i.name not in unused_names]
    del graph.input[:]
    graph.input.extend(listed)
    graph.initializer.extend(new_inits)
    return model


def softmax_logits(model: onnx.ModelProto) -> list[str]:
    """Names of the inputs of the Softmax nodes that produce graph outputs (the logits)."""
    outputs = {o.name for o in model.graph.output}
    return [n.input[0] for n in model.graph.node if n.op_type == "Softmax" and n.output[0] in outputs]


def with_outputs(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    """A copy of ``model`` that also returns the values ``names`` (typed by onnx inference)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    inferred = onnx.shape_inference.infer_shapes(model)
    infos = {vi.name: vi for vi in inferred.graph.value_info}
    present = {o.name for o in model.graph.output}
    for name in names:
        if name in present:
            continue
        vi = infos.get(name) or helper.make_empty_tensor_value_info(name)
        model.graph.output.append(vi)
    return model


def scale_relative_error(actual: np.ndarray, reference: np.ndarray) -> float:
    """max |actual - reference| / max |reference|: the project's standard comparison."""
    actual = np.asarray(actual, dtype=np.float64)
    reference = np.asarray(reference, dtype=np.float64)
    if actual.shape != reference.shape:
        raise AssertionError(f"shape {actual.shape} != reference shape {reference.shape}")
    scale = np.max(np.abs(reference)) if reference.size else 0.0
    err = np.max(np.abs(actual - reference)) if reference.size else 0.0
    return float(err / scale) if scale > 0 else float(err)


def reweighted_model_path(name: str) -> Path:
    """The bundled light model ``name`` as the benchmarks run it (:func:`reweight`ed, its
    softmax logits an extra output), written once into ``~/.cache/egraft/bundled/``
    (``$EGRAFT_BUNDLED_DIR`` overrides it) and reused: a zoo run needs a file.

    The shipped weights are constant fills that give logits near 1e10 whose softmax any
    rounding difference flips, so the shipped files cannot judge an engine.
    """
    import tempfile

    folder = Path(os.environ.get("EGRAFT_BUNDLED_DIR") or Path.home() / ".cache" / "egraft" / "bundled")
    path = folder / f"{name}-onnx{onnx.__version__}.onnx"
    if path.exists():
        return path
    source = onnx.load(light_model_path(name))
    model = with_outputs(reweight(source, seed=0), softmax_logits(source))
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=folder, suffix=".partial", delete=False) as f:
        f.write(model.SerializeToString())
    Path(f.name).replace(path)
    return path
