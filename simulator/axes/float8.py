"""Float8 training of one linear (torchao's ``Float8Linear``): what it costs against bf16.

``layer_cost`` prices the linears of a layer with ``precision: fp8`` by these terms -- those
the runtime converts (runtime/apply_fp8.py: both weight dims divisible by 16,
``FP8_DIM_MULTIPLE``) -- at the plan's ``fp8_recipe``; the fp8 all-gather goes into the layer's
FSDP terms and the fp8 copies into its memory (``float8_work``).  Tensor parallelism's
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

from autopar.core.dtypes import FP8_DIM_MULTIPLE
from autopar.core.op_costs import FP32_BYTES      # the FSDP2 master shard (mixed precision keeps fp32)
from autopar.core.graph import OpGraph
from autopar.core.plan import LayerPlan, Mesh
from autopar.core.sharding import TPLayout
from autopar.simulator.device.cost_model import CostModel
from autopar.simulator.axes.sharded_dp import effective_zero

FP8_BYTES = 1
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


def fp8_all_gather(lp: LayerPlan, mesh: Mesh, recipe: str) -> bool:
    """Whether FSDP2 all-gathers this layer's float8 weights in fp8 (runtime/apply_fp8.py:
    tensorwise, sharded by FSDP2, not offloaded, no tensor parallelism)."""
    return (lp.precision == "fp8" and recipe == "tensorwise" and effective_zero(lp.zero, mesh) >= 2
            and lp.offload == "none" and mesh.tp == 1)


def float8_work(graph: OpGraph, layer_index: int, w: "OpWork", layout: TPLayout, cm: CostModel, scale: float,
            recipe: str = "tensorwise", gathered_dp: int | None = None) -> None:
    """A layer with ``precision: fp8``: each linear with a weight that the runtime converts (both
    dims divisible by 16: float8.converts) costs torchao's float8 GEMMs and casts
    (simulator/float8.py) at the plan's recipe instead of its bf16 time; on this device's share
    of the GEMM (the tp split divides its output or input features).  Its weight elements and
    fp8 copies go to ``w`` for the FSDP all-gather and memory terms.  ``gathered_dp``: FSDP2
    all-gathers the weights in fp8 over that many ranks (``fp8_all_gather``): the shard's cast
    runs before each all-gather (forward, and backward again under ZeRO-3) and the scales'
    precompute reads the fp32 shard once per step (simulator/float8.py)."""
    for op in graph.layer_ops(layer_index):
        if op.kind != "linear" or not op.params or op.name not in w.op_fwd_s or not op.input_shapes:
            continue
        n, k = op.output_shape[-1], op.input_shapes[0][-1]
        shard = layout.compute_shard.get(op.name, 1)
        if not converts(k, n, int(shard)):
            continue                     # left in bf16 by the runtime (runtime/apply_fp8.py)
        m = max(1.0, op.fwd_flops / (2.0 * n * k)) * scale
        n_local = n / shard
        shard = None if gathered_dp is None else n_local * k / gathered_dp
        c = float8_linear_cost(int(round(m)), k, n_local, cm, recipe, gathered_shard=shard)
        if shard is not None:
            w.fp8_shard_cast_s += c.shard_cast_s
            w.fp8_precompute_s += shard * FP32_BYTES / cm.achievable_memory_Bps
        w.fp8_weight_numel += n_local * k
        w.fp8_transient_bytes = max(w.fp8_transient_bytes, c.transient_bytes)
        w.fwd_s += c.fwd_s - w.op_fwd_s[op.name]
        w.bwd_s += (c.total_s - c.fwd_s) - w.op_bwd_s.get(op.name, 0.0)
        w.op_fwd_s[op.name], w.op_bwd_s[op.name] = c.fwd_s, c.total_s - c.fwd_s
