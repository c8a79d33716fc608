"""CPU kernel generators, one module per op family, registered by op name.

A generator is ``fn(ctx: KernelContext) -> None``: it emits the body of the node's kernel
through ``ctx`` (see :mod:`egraft.kernels.cpu.emit`) or raises ``Unsupported``.

Example:
    >>> find_kernel("Relu") is not None
    True
"""

from __future__ import annotations

from collections.abc import Callable

_KERNELS: dict[tuple[str, str], Callable] = {}
_IN_PLACE: set[tuple[str, str]] = set()


def register_kernel(*ops: str, domain: str = "", in_place: bool = False) -> Callable[[Callable], Callable]:
    """Decorator: ``fn`` generates the kernels of ``ops`` (in ``domain``).

    ``in_place=True`` declares that the kernel reads each input element at the output
    index it writes, before writing it (elementwise): lowering may then give the output
    the buffer of an input of the same shape that no later step reads.
    """
    def wrap(fn: Callable) -> Callable:
        for op in ops:
            _KERNELS[(domain, op)] = fn
            if in_place:
                _IN_PLACE.add((domain, op))
        return fn
    return wrap


def in_place(op: str, domain: str = "") -> bool:
    """True when ``op``'s kernel may write over an input of its output's shape."""
    _load()
    return ("" if domain == "ai.onnx" else domain, op) in _IN_PLACE


def find_kernel(op: str, domain: str = "") -> Callable | None:
    """The generator of ``op``, or ``None`` (the op runs on its reference kernel)."""
    _load()
    return _KERNELS.get(("" if domain == "ai.onnx" else domain, op))


def kernel_ops() -> list[tuple[str, str]]:
    """(domain, op) of every op with a generator."""
    _load()
    return sorted(_KERNELS)


def _load() -> None:
    """Import every generator module of this package (each registers its ops on import)."""
    import importlib
    import pkgutil

    import egraft.kernels.cpu as package

    for info in pkgutil.iter_modules(package.__path__):
        if info.name not in ("emit", "llvm") and not info.name.startswith("_"):
            importlib.import_module(f"egraft.kernels.cpu.{info.name}")
