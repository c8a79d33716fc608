"""The op definitions, one module per family; importing this package registers them all."""

from egraft.ir.ops import elementwise, shape  # noqa: F401
