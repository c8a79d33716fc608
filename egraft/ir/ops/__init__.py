"""The op definitions, one module per family; importing this package registers them all."""

from egraft.ir.ops import (  # noqa: F401
    contrib,
    control,
    elementwise,
    fused,
    fused_elementwise,
    layout,
    nn_dense,
    nn_spatial,
    quantize,
    recurrent,
    reduce_index,
    shape,
    winograd,
    work,  # last: attaches work formulas to the ops registered above
)
