"""Float8 training of one linear (torchao's ``Float8Linear``): what it costs against bf16.

``layer_cost`` prices the linears of a layer with ``precision: fp8`` by these terms -- those
the runtime converts (runtime/apply_fp8.py: both weight dims divisible by 16,
``FP8_DIM_MULTIPLE``) -- at the plan's ``fp8_recipe``; the fp8 all-gather goes into the layer's
FSDP terms and the fp8 copies into its memory (``layer_cost._float8``).  Tensor parallelism's
collectives stay bf16 (the runtime splits float8 linears with the plain DTensor styles).

Mechanism (torchao.float8, README "float8 training"; Micikevicius et al. 2022, "FP8 Formats
for Deep Learning"): each of the linear's three GEMMs -- forward ``y = x W^T``, input
gradient ``dx = dy W``, weight gradient ``dW = dy^T x`` -- runs on fp8 operands (e4m3 for
x and W, e5m2 for dy) scaled into fp8's range by ``amax``:

* **GEMMs** at the device's fp8 rate: the profile's ``peak_flops["fp8"]`` where it has one,
  else twice bf16's (NVIDIA H100 datasheet: 1,979 dense fp8 against 989 dense bf16 TFLOPS on
  SXM5; the same 2x on H200 and L40S), times the profile's linear efficiency.
* **Casts**: every GEMM operand is cast from bf16 (2 bytes) to fp8 (1 byte) in the layout its
  GEMM needs: x and W for the forward, dy and W^T for dx, dy^T and x^T for dW -- six casts.
  Tensorwise scaling first reduces the whole tensor's ``amax`` (a pass reading 2 bytes per
  element) and then casts (reading 2, writing 1): 5 bytes per element; rowwise scaling reduces
  each row's amax in the kernel that casts it: 3 bytes per element.  Each is memory-bound on
  the device, and under compile one kernel per cast (two for tensorwise: the reduction and the
  cast), each paying the launch floor.
* **FSDP2 float8 all-gather** (tensorwise only: torchao ``enable_fsdp_float8_all_gather``): the
  weight is all-gathered as fp8, 1 byte per element instead of bf16's 2; rowwise all-gathers bf16.
  The gathered weight is already fp8, so the layer casts neither W nor W^T (torchao skips an
  operand already in float8); instead each all-gather first casts this rank's fp32 shard with
  the scale precomputed after the optimizer step (torchao ``fsdp_pre_all_gather``: read 4
  bytes, write 1, one kernel), and the precompute reads every fp8 weight's shard once per step
  (``torch._foreach_norm`` for the amaxes; its one small all-reduce is not priced).
* **Memory** (what torchao keeps: ``matmul_with_hp_or_float8_args`` saves its high-precision
  input and weight for backward, so the activations kept are bf16's, and casts again there):
  the fp8 copies are transient -- the forward's W (1 byte per weight element) and, in backward,
  the operands of its two GEMMs alive together: dy and W^T for dx, dy^T and x^T for dW
  (``transient_bytes``: 2 m n + n k + m k bytes, the larger of the two passes).  Under the FSDP2
  float8 all-gather the gathered weight itself is the fp8 copy: the unsharded buffer holds 1
  byte per weight element instead of 2 (``allgather_bytes_per_weight``), and the weight is not
  cast again in the layer (torchao skips an operand already in float8).
"""
from __future__ import annotations

from dataclasses import dataclass

FP8_BYTES = 1
FP32_BYTES = 4                 # the FSDP2 master shard (mixed precision keeps fp32 parameters)
#: both dims of an fp8 GEMM operand in multiples of 16 (torch._scaled_mm's alignment; the
#: runtime converts only such linears, runtime/apply_fp8.py)
FP8_DIM_MULTIPLE = 16
BF16_BYTES = 2
FP8_OVER_BF16_PEAK = 2.0       # NVIDIA H100 datasheet (SXM5): 1,979 / 989.4 dense TFLOPS
RECIPES = ("tensorwise", "rowwise")
#: bytes per element a cast moves: tensorwise = amax pass (read 2) + cast (read 2, write 1);
#: rowwise = one pass reducing each row's amax and casting it (read 2, write 1)
CAST_BYTES = {"tensorwise": 2 * BF16_BYTES + FP8_BYTES, "rowwise": BF16_BYTES + FP8_BYTES}
CAST_KERNELS = {"tensorwise": 2, "rowwise": 1}


@dataclass(frozen=True)
class Float8LinearCost:
    """One linear of shape [m, k] x [k, n] (m tokens, k in, n out), fwd + bwd, on one device."""
    gemm_s: float                  # the three GEMMs at the fp8 rate
    cast_s: float                  # the six operand casts (amax reductions included)
    fwd_s: float                   # forward: its GEMM and the casts of x and W
    bf16_gemm_s: float             # the same three GEMMs in bf16 (for the summary)
    allgather_bytes_per_weight: int  # FSDP2 all-gather bytes per weight element
    transient_weight_bytes: int    # fp8 copies of the weight while the layer runs (W, then W^T)
    transient_bytes: int = 0       # fp8 operands alive at once (the backward's: dy, W^T, dy^T, x^T)
    shard_cast_s: float = 0.0      # FSDP2 float8 all-gather: the shard's cast before each all-gather

    @property
    def total_s(self) -> float:
        return self.gemm_s + self.cast_s

    @property
    def speedup(self) -> float:
        """bf16 GEMM time over float8's GEMMs and casts."""
        return self.bf16_gemm_s / self.total_s if self.total_s > 0 else 1.0


def fp8_peak(cm) -> float:
    return float(cm.peak_flops.get("fp8") or FP8_OVER_BF16_PEAK * cm.peak("bf16"))


def float8_linear_cost(m: int, k: int, n: int, cm, recipe: str = "tensorwise",
                       gathered_shard: float | None = None) -> Float8LinearCost:
    """``gathered_shard``: under the FSDP2 float8 all-gather, this rank's weight elements (n k /
    dp): the casts of W and W^T give way to the pre-all-gather cast of the shard (module docstring);
    ``shard_cast_s`` is that cast's time, per all-gather."""
    if recipe not in RECIPES:
        raise ValueError(f"float8 recipe {recipe!r}; one of {', '.join(RECIPES)}")
    eff = cm.efficiency.get("linear", cm.efficiency.get("matmul", 1.0))
    flops = 3 * 2.0 * m * n * k                  # forward, input gradient, weight gradient
    gemm_s = flops / (fp8_peak(cm) * eff)
    bf16_gemm_s = flops / (cm.peak("bf16") * eff)
    # the six casts: x, W (forward); dy, W^T (dx); dy^T, x^T (dW)
    elements = [m * k, n * k, m * n, n * k, m * n, m * k]
    floor = cm.overhead("op_launch_s")
    per_cast = [max(e * CAST_BYTES[recipe] / cm.achievable_memory_Bps, CAST_KERNELS[recipe] * floor)
                for e in elements]
    shard_cast_s = 0.0
    if gathered_shard is not None:
        per_cast[1] = per_cast[3] = 0.0          # W, W^T arrive in fp8
        shard_cast_s = max(gathered_shard * (FP32_BYTES + FP8_BYTES) / cm.achievable_memory_Bps, floor)
    return Float8LinearCost(gemm_s=gemm_s, cast_s=sum(per_cast), fwd_s=gemm_s / 3 + per_cast[0] + per_cast[1],
                            shard_cast_s=shard_cast_s,
                            bf16_gemm_s=bf16_gemm_s,
                            allgather_bytes_per_weight=FP8_BYTES if recipe == "tensorwise" else BF16_BYTES,
                            transient_weight_bytes=2 * FP8_BYTES * n * k,
                            transient_bytes=FP8_BYTES * max(m * k + n * k, 2 * m * n + n * k + m * k))


def converts(k: int, n: int, tp: int = 1) -> bool:
    """Whether the runtime converts a linear of ``k`` in and ``n`` out features, split over ``tp``
    tensor-parallel ranks (1: not split): both dims divisible by 16 x tp (runtime/apply_fp8.py)."""
    return k % (FP8_DIM_MULTIPLE * tp) == 0 and n % (FP8_DIM_MULTIPLE * tp) == 0
