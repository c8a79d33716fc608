"""CUDA kernel generators, one module per op family, registered by op name: the CUDA
sibling of :mod:`egraft.kernels.cpu`. A generator is ``fn(ctx: CudaContext) -> None``: it
writes the node's functions through ``ctx`` (:mod:`egraft.kernels.cuda.emit`) or raises
``Unsupported``. :mod:`egraft.kernels.cuda.nvrtc` compiles the result for an explicit
architecture, with no GPU needed.

Example:
    >>> find_kernel("Relu") is not None
    True
"""

from __future__ import annotations

from collections.abc import Callable

_KERNELS: dict[tuple[str, str], Callable] = {}


def register_kernel(*ops: str, domain: str = "") -> Callable[[Callable], Callable]:
    """Decorator: ``fn`` generates the CUDA kernels of ``ops`` (in ``domain``)."""
    def wrap(fn: Callable) -> Callable:
        for op in ops:
            _KERNELS[(domain, op)] = fn
        return fn
    return wrap


def find_kernel(op: str, domain: str = "") -> Callable | None:
    """The CUDA generator of ``op``, or ``None``."""
    _load()
    return _KERNELS.get(("" if domain == "ai.onnx" else domain, op))


def kernel_ops() -> list[tuple[str, str]]:
    """(domain, op) of every op with a CUDA generator."""
    _load()
    return sorted(_KERNELS)


def generate(node, graph, opset: int = 21):
    """The :class:`~egraft.kernels.cuda.emit.CudaKernel` of ``node`` (a node of ``graph``);
    ``Unsupported`` when no generator takes it."""
    from egraft.kernels.cuda.emit import CudaContext, Unsupported

    generator = find_kernel(node.op, node.domain)
    if generator is None:
        raise Unsupported(f"no CUDA kernel for {node.op}")
    ctx = CudaContext(node, graph, opset)
    generator(ctx)
    return ctx.finish()


def _load() -> None:
    import importlib
    import pkgutil

    import egraft.kernels.cuda as package

    for info in pkgutil.iter_modules(package.__path__):
        if info.name not in ("emit", "nvrtc"):
            importlib.import_module(f"{package.__name__}.{info.name}")


__all__ = ["register_kernel", "find_kernel", "kernel_ops", "generate"]
