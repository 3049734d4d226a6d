"""Bytes per element: of a captured tensor's torch dtype, and of a training precision.

The one table of element sizes (IEEE 754 binary64/32/16, bfloat16, complex64 as two binary32,
and the integer types; TF32 is stored in 32 bits).  A dtype name the table does not know counts
as 4 bytes; the tracer (core/trace_walk.itemsize) asks torch for a torch dtype it does not know.
"""
from __future__ import annotations

#: torch dtype names as captured (``OpNode.dtype``, without the ``torch.`` prefix)
DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "int16": 2,
               "bool": 1, "uint8": 1, "int8": 1, "complex64": 8}
#: training precisions and profiled compute dtypes (plan.precision, profile peak_flops keys)
PRECISION_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2}
#: both dims of an fp8 GEMM operand in multiples of 16 (torch._scaled_mm's alignment; the runtime
#: converts only such linears, runtime/apply_fp8.py, and the simulator prices only those)
FP8_DIM_MULTIPLE = 16


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a torch dtype name (``"torch.bfloat16"`` or ``"bfloat16"``)."""
    return DTYPE_BYTES.get(dtype.replace("torch.", ""), 4)


def precision_bytes(precision: str) -> int:
    """Bytes per element of a precision name (``"bf16"``)."""
    return PRECISION_BYTES.get(precision, 4)
