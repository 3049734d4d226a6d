"""The cost model: seconds for an op, a collective or a host transfer on one GPU type.

Built from a profile (profiles/<gpu>.json, docs/profiles.md).  Measured tables win where
they cover the question; otherwise an analytic model answers:

* ops: a roofline, max(FLOPs / (peak * efficiency[kind]), bytes / (bandwidth * efficiency
  [memory_bound])) (Williams et al. 2009, "Roofline", CACM 52(4)).  A measured op table is
  interpolated in log-log space per (kind, variant, dtype) -- compute kinds on FLOPs,
  memory-bound kinds on bytes -- and made non-decreasing with a running maximum, so a larger
  op never costs less than a smaller one.  The variant (layer_norm / rms_norm, gelu / add)
  comes from the op's traced target (``op_variant``).
* fused attention (``fused_attention_s``): where the profile holds published or measured
  forward + backward rates of flash-attention kernels by head dimension and sequence length
  (``attention_kernels``), a ``scaled_dot_product_attention`` in bf16/fp16 is priced from the
  kernel the run uses (``code.attention_kernel``) in that table's own FLOP convention: a causal
  kernel skips the masked half of the score square and its backward is 2.5 forwards
  (FlashAttention recomputes the scores; Dao 2023, "FlashAttention-2", arXiv 2307.08691,
  Sec. 4.1).  The graph's FLOP counts keep the full square (MFU as Megatron counts it).
* framework overheads (``overhead``): no op takes less than one eager dispatch
  (``op_launch_s``; its autograd node ``op_backward_launch_s`` in backward); a tensor-parallel
  module, an FSDP unit and every optimizer parameter tensor add their measured fixed costs
  (profiling/overheads.py measures them; GPU profiles without them use ``GPU_OVERHEADS``).
* collectives: alpha-beta (Hockney 1994) per link level.  Ring algorithms (Thakur et al. 2005,
  "Optimization of Collective Communication Operations in MPICH", IJHPCA 19(1); Patarasuk &
  Yuan 2009, "Bandwidth optimal all-reduce algorithms", JPDC 69(2)): all-reduce sends
  2(N-1)/N * M bytes per rank in 2(N-1) steps, reduce-scatter and all-gather (N-1)/N * M in
  N-1 steps; a tree all-reduce pays 2 log2 N latencies and about 2M bytes.  Measured
  collective tables are interpolated on message size per (op, group size, level), from the
  rows measured with as many processes busy at once as the plan keeps on a node (a row's
  ``processes``; on a CPU the processes share the cores, profiling/collectives.py).
* host <-> device copies: latency + bytes / bandwidth of the host link.

Every public ``*_ex`` method returns (seconds, measured) so callers can count which figures
came from measurements and which were estimated.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from autopar.core.cluster import Link
from autopar.core.dtypes import precision_bytes
from autopar.core.errors import UserError
from autopar.profiles import OVERHEAD_KEYS
from autopar.core.clocks import clock_ratio, peak_flops_at_clock
from autopar.simulator.device.cpu_meeting_waits import MeetingWaits
from autopar.simulator.device.calibration import FITTED, Calibration
from autopar.simulator.device.training_code import AUTOPAR, TrainingCode
from autopar.simulator.device.gemm_epilogue import exposed_epilogue_s, gemm_output_elements

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "p2p")

# Op kind -> efficiency key of the profile; kinds not listed are memory-bound.
_COMPUTE_KINDS = {"linear": "linear", "matmul": "matmul", "attention": "attention", "conv": "conv",
                  "rnn": "matmul"}     # a recurrent module's work is its gate GEMMs (op_costs._rnn)
_DTYPE_KEY = {"float32": "fp32", "fp32": "fp32", "tf32": "tf32", "bfloat16": "bf16", "bf16": "bf16",
              "float16": "fp16", "fp16": "fp16", "float64": "fp32"}
#: kinds whose measured rows are looked up by FLOPs; every other kind by bytes moved
FLOPS_AXIS_KINDS = frozenset({"linear", "matmul", "attention", "attention_math", "conv"})
#: the profiler's default variant of each kind (profiling/op_sweeps.py), used when a captured
#: op's target names no measured variant
DEFAULT_VARIANT = {"linear": "linear", "matmul": "bmm", "attention": "sdpa", "conv": "conv2d_3x3",
                   "norm": "layer_norm", "softmax": "softmax", "elementwise": "add", "embedding": "embedding",
                   "copy": "copy"}
#: framework overheads in seconds (a profile's ``framework_overheads``, keys in
#: autopar.profiles.OVERHEAD_KEYS).  Defaults for a
#: GPU profile that did not measure them: a CUDA kernel launch costs about 5 us of host time
#: (NVIDIA Developer Blog, "Getting Started with CUDA Graphs", 2019: "a few microseconds" per
#: launch), the floor of any kernel; the other host-side costs (DTensor dispatch, FSDP hooks,
#: per-tensor optimizer work) overlap the GPU's queue while it runs ahead, so they default to 0.
#: A CPU profile without measurements defaults to 0 everywhere (nothing assumed).
GPU_OVERHEADS = {"op_launch_s": 5e-6, "op_backward_launch_s": 5e-6}
#: backward / forward work of a flash-attention kernel in the convention of its published rates:
#: five matmuls (the scores recomputed, dV, dP, dQ, dK) against the forward's two (Dao 2023, Sec.
#: 4.1; flash-attention benchmarks/benchmark_flash_attention.py, ``flops``: bwd = 2.5 x fwd)
FLASH_BWD_OVER_FWD = 2.5
#: collective names of the profiler's table -> the cost model's
_COLLECTIVE_ALIASES = {"send_recv": "p2p"}
#: one AdamW parameter tensor of the profiler's optimizer rows holds at most this many elements
#: (profiling/op_sweeps.py, OPTIMIZER_TENSOR_NUMEL)
_OPTIMIZER_ROW_TENSOR_NUMEL = 1 << 20


def op_variant(kind: str, target: str) -> str | None:
    """The profiler variant that prices a captured op of ``kind`` traced as ``target``."""
    t = target.lower()
    if kind == "norm":
        return "rms_norm" if "rms" in t else "layer_norm"
    if kind == "elementwise":
        # transcendental activations cost like gelu; masked fills have their own rows (a broadcast
        # boolean mask); arithmetic and the rest like add
        if "masked_fill" in t:
            return "masked_fill"
        return "gelu" if any(a in t for a in ("gelu", "silu", "swish", "tanh", "sigmoid", "erf", "exp")) else "add"
    return DEFAULT_VARIANT.get(kind)


def dtype_key(dtype: str) -> str:
    return _DTYPE_KEY.get(dtype.replace("torch.", ""), "fp32")


@dataclass
class _Curve:
    """log-log interpolation of seconds on a size axis, non-decreasing (running max)."""
    log_x: np.ndarray
    log_y: np.ndarray
    x: np.ndarray
    y: np.ndarray

    @classmethod
    def build(cls, xs: list[float], ys: list[float]) -> "_Curve":
        best: dict[float, float] = {}
        for x, y in zip(xs, ys):           # a size measured twice: keep the slower figure
            best[x] = max(y, best.get(x, 0.0))
        x = np.maximum(np.asarray(sorted(best), dtype=float), 1e-30)
        y = np.maximum.accumulate(np.maximum([best[k] for k in sorted(best)], 1e-30))  # cummax
        return cls(np.log(x), np.log(y), x, y)

    def __call__(self, size: float) -> float:
        if size <= self.x[0]:
            # below the table: scale the smallest entry down linearly (never below zero)
            return float(self.y[0] * max(size, 0.0) / self.x[0]) if size > 0 else 0.0
        if size >= self.x[-1]:
            # above the table: constant throughput of the largest measured entry
            return float(self.y[-1] * size / self.x[-1])
        return float(math.exp(np.interp(math.log(size), self.log_x, self.log_y)))


@dataclass
class CostModel:
    """Seconds for ops and collectives on one GPU type (built from a profile dict)."""
    name: str
    peak_flops: Mapping[str, float]
    memory_bandwidth_Bps: float
    efficiency: Mapping[str, float]
    collective_efficiency: Mapping[str, float]
    memory_bytes: float = 0.0
    host_adam_params_per_s: float = 1.0e9
    num_sms: int = 0                      # streaming multiprocessors (0: no wave model)
    gemm_tile: tuple[int, int] = (256, 128)
    gemm_epilogue: str = "overlapped"     # "exposed": a GEMM's output stores follow its main loop
    profile: Mapping[str, Any] = field(default_factory=dict, repr=False)
    overheads: Mapping[str, float] = field(default_factory=dict)
    #: CPU ranks: the waits at meetings of the ranks (a profile's ``sync_wait`` rows; empty on a GPU)
    meeting_waits: MeetingWaits = field(default_factory=MeetingWaits)
    host_dispatch_bound: bool = False     # CPU: the device is the host thread, views cost a dispatch too
    optimizer_element_s: float = 0.0      # AdamW seconds per parameter element (0: roofline)
    #: kernel -> ("causal" | "full") -> head dim -> ((seq, FLOP/s fwd+bwd), ...) (``fused_attention_s``)
    attention_kernels: Mapping[str, Any] = field(default_factory=dict)
    #: the training code priced (simulator/training_code.py): autopar's runtime unless a caller
    #: prices a run made with other code; set it before an evaluator first prices with this model
    code: TrainingCode = AUTOPAR
    #: sustained / boost clock of a GPU variant (core/clocks.py): scales the peaks (done in
    #: ``from_profile``) and the published flash-attention rates, measured at the boost part's clock
    clock_ratio: float = 1.0
    #: the fitted constants priced with (simulator/calibration.py): the last fit unless a caller
    #: (benchmarks/published_runs.py --fit, a test) prices another value
    calibration: Calibration = FITTED
    _op_curves: dict = field(default_factory=dict, repr=False)
    _coll_curves: dict = field(default_factory=dict, repr=False)
    _chain_curves: dict = field(default_factory=dict, repr=False)     # rows timed as chains of calls

    # --------------------------------------------------------------- construction
    @classmethod
    def from_profile(cls, name_or_dict: str | Mapping[str, Any]) -> "CostModel":
        prof = _load_profile(name_or_dict) if isinstance(name_or_dict, (str, Path)) else dict(name_or_dict)
        try:
            cm = cls(
                name=str(prof["name"]),
                peak_flops=peak_flops_at_clock(prof),             # core/clocks.py: the clock it holds
                memory_bandwidth_Bps=float(prof["memory_bandwidth_Bps"]),
                efficiency={k: float(v) for k, v in prof.get("efficiency", {}).items()},
                collective_efficiency={k: float(v) for k, v in prof.get("collective_efficiency", {}).items()},
                memory_bytes=float(prof.get("memory_bytes", 0)),
                host_adam_params_per_s=float(prof.get("host_adam_params_per_s", 1.0e9)),
                num_sms=int(prof.get("num_sms", 0) or 0),
                gemm_tile=tuple(int(x) for x in prof.get("gemm_tile", (256, 128))),
                gemm_epilogue=str(prof.get("gemm_epilogue", "overlapped")),
                attention_kernels=_attention_kernels(prof.get("attention_kernels") or {}),
                clock_ratio=clock_ratio(prof),
                profile=prof,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise UserError(f"profile {prof.get('name', name_or_dict)!r}: field {e} is missing or malformed; a "
                            f"profile needs name, peak_flops{{fp32,bf16,...}}, memory_bandwidth_Bps, efficiency "
                            f"and collective_efficiency (see docs/profiles.md or 'autopar profile').") from None
        gpu = prof.get("device", "gpu") != "cpu"
        measured = {k: float(v) for k, v in (prof.get("framework_overheads") or {}).items() if k in OVERHEAD_KEYS}
        cm.overheads = {**(GPU_OVERHEADS if gpu else {}), **measured}
        cm.host_dispatch_bound = not gpu
        cm.meeting_waits = MeetingWaits.from_rows(prof.get("sync_wait"))
        groups: dict[tuple[str, str | None, str], tuple[list, list]] = {}
        for row in prof.get("op_table", []) or []:
            kind = str(row["kind"])
            variant = row.get("variant") or DEFAULT_VARIANT.get(kind)
            x = float(row["flops"]) if kind in FLOPS_AXIS_KINDS else float(row.get("bytes", 0))
            if x <= 0:
                x = float(row.get("bytes", 0)) or float(row.get("flops", 0))
            xs, ys = groups.setdefault((kind, variant, dtype_key(str(row.get("dtype", "fp32")))), ([], []))
            xs.append(x)
            ys.append(float(row["seconds"]))
        cm._op_curves = {k: _Curve.build(*v) for k, v in groups.items() if v[0]}
        cm.optimizer_element_s = _optimizer_element_s(prof.get("op_table", []) or [],
                                                      cm.overheads.get("optimizer_tensor_s", 0.0))
        cgroups: dict[tuple[str, int, str, int], tuple[list, list]] = {}
        for row in prof.get("collective_table", []) or []:
            op = _COLLECTIVE_ALIASES.get(str(row["op"]), str(row["op"]))
            key = (op, int(row["group_size"]), str(row["level"]), int(row.get("processes", row["group_size"])),
                   row.get("timing") == "chained")
            xs, ys = cgroups.setdefault(key, ([], []))
            xs.append(float(row["bytes"]))
            ys.append(float(row["seconds"]))
        for (op, n, level, procs, chained), v in cgroups.items():
            if v[0]:
                curves = cm._chain_curves if chained else cm._coll_curves
                curves.setdefault((op, n, level), {})[procs] = _Curve.build(*v)
        return cm

    @property
    def achievable_memory_Bps(self) -> float:
        """Device memory bytes per second a memory-bound kernel reaches: the datasheet bandwidth
        times the profile's ``memory_bound`` efficiency."""
        return self.memory_bandwidth_Bps * self.efficiency.get("memory_bound", 1.0)

    def for_code(self, code: TrainingCode) -> "CostModel":
        """The same device priced for another training code (simulator/training_code.py).  The
        curves built from the profile's tables depend on the device only and are shared."""
        return replace(self, code=code)

    def for_calibration(self, calibration: Calibration) -> "CostModel":
        """The same device priced with other fitted constants (simulator/calibration.py); the
        profile's curves are shared, as in ``for_code``."""
        return replace(self, calibration=calibration)

    # ------------------------------------------------------------------------ ops
    def peak(self, dtype: str) -> float:
        key = dtype_key(dtype)
        if key in self.peak_flops:
            return self.peak_flops[key]
        return self.peak_flops.get("fp32", max(self.peak_flops.values()))

    def wave_efficiency(self, m: float, n: float, batch: float = 1.0) -> float:
        """Fraction of the GPU a GEMM with an m x n output keeps busy over its waves.

        A GEMM runs as ceil(m/tm) * ceil(n/tn) output tiles, scheduled on the SMs in waves;
        the last wave is partly empty (NVIDIA, "Matrix Multiplication Background User's
        Guide", Deep Learning Performance docs, sections "Tile Quantization" and "Wave
        Quantization").  Useful work / work issued = (m n) / (tiles_in_full_waves tm tn).
        """
        if self.num_sms <= 0 or m <= 0 or n <= 0:
            return 1.0
        tm, tn = self.gemm_tile
        tiles = math.ceil(m / tm) * math.ceil(n / tn) * max(1.0, math.ceil(batch))
        waves = math.ceil(tiles / self.num_sms)
        return min(1.0, (m * n * max(1.0, batch)) / (waves * self.num_sms * tm * tn))

    def waits_at_meetings(self, processes: int) -> bool:
        """Whether the profile measured meeting waits for ``processes`` busy ranks (CPU profiles)."""
        return self.meeting_waits.measured(processes)

    def meeting_wait(self, processes: int, gap_s: float) -> float:
        """Seconds a rank waits at one meeting after ``gap_s`` of its own work (cpu_meeting_waits.py)."""
        return self.meeting_waits.wait(processes, gap_s)

    def overhead(self, key: str) -> float:
        """A framework overhead in seconds (``OVERHEAD_KEYS``; 0 when neither measured nor defaulted)."""
        return float(self.overheads.get(key, 0.0))

    def _curve(self, kind: str, variant: str | None, dkey: str):
        curve = self._op_curves.get((kind, variant, dkey))
        if curve is None and variant != DEFAULT_VARIANT.get(kind):
            curve = self._op_curves.get((kind, DEFAULT_VARIANT.get(kind), dkey))
        return curve

    def compute_time_ex(self, kind: str, flops: float, bytes_moved: float, dtype: str,
                        gemm_mnb: tuple[float, float, float] | None = None,
                        variant: str | None = None, backward: bool = False) -> tuple[float, bool]:
        """Seconds of one op of ``kind`` doing ``flops`` and moving ``bytes_moved``; measured?

        ``gemm_mnb`` = (m, n, batch) of a matmul's output enables the wave-quantisation
        factor on top of the kind's efficiency (which is measured at full waves) and, on a
        profile whose ``gemm_epilogue`` is "exposed", the output stores after the main loop
        (simulator/gemm_epilogue.py; ``backward``: the gradient GEMMs' outputs).  ``variant``
        picks the measured rows (``op_variant``); compute kinds are looked up by FLOPs, the
        others by bytes.
        """
        dkey = dtype_key(dtype)
        curve = self._curve(kind, variant if variant is not None else DEFAULT_VARIANT.get(kind), dkey)
        if curve is not None:
            size = flops if kind in FLOPS_AXIS_KINDS else bytes_moved
            if size <= 0:
                size = bytes_moved or flops
            return curve(size), True
        eff_key = _COMPUTE_KINDS.get(kind)
        mem_s = bytes_moved / self.achievable_memory_Bps
        if eff_key is None:
            # memory-bound kinds: vector units at the dtype's peak bound the arithmetic side
            return max(flops / self.peak(dkey), mem_s), False
        eff = self.efficiency.get(eff_key, self.efficiency.get("matmul", 1.0))
        epilogue_s = 0.0
        if gemm_mnb is not None:
            eff *= self.wave_efficiency(*gemm_mnb)
            if self.gemm_epilogue == "exposed":
                epilogue_s = exposed_epilogue_s(gemm_output_elements(*gemm_mnb, flops, backward),
                                                float(precision_bytes(dkey)),
                                                self.memory_bandwidth_Bps, self.efficiency.get("memory_bound", 1.0))
        # the output write is part of mem_s already: an exposed epilogue adds to the main loop,
        # never beyond the memory roofline
        return max(flops / (self.peak(dkey) * eff) + epilogue_s, mem_s), False

    def op_time_ex(self, op, dtype: str, shard: int = 1, *, backward: bool = False,
                   scale: float = 1.0, bytes_scale: float = 1.0, out_shard: int = 1) -> tuple[float, bool]:
        """Seconds of an OpNode on 1/shard of its data, ``scale`` x its captured batch.

        Backward moves about twice the forward's bytes (it reads the saved activations and the
        output gradient and writes the input gradient, plus the weight gradient for linears).
        An op autograd records no backward for (``requires_grad`` False: a mask or a position
        built from shapes, an op on raw inputs only) runs nothing in backward.
        """
        if backward and not getattr(op, "requires_grad", True):
            return 0.0, False
        flops = (op.bwd_flops if backward else op.fwd_flops) * scale / shard
        nbytes = op.bytes_moved * bytes_scale * scale / shard * (2.0 if backward else 1.0)
        floor = self.overhead("op_backward_launch_s" if backward else "op_launch_s")
        copied = 0.0 if backward else getattr(op, "copy_bytes", 0.0) * scale / shard
        if flops <= 0 and nbytes <= 0 and copied <= 0:
            # a view or a metadata op: no kernel, but on a CPU the host thread still dispatches it
            return (floor if self.host_dispatch_bound else 0.0), False
        variant = op_variant(op.kind, str(getattr(op, "target", "")))
        flash = (self.fused_attention_s(op, flops, dtype, backward)
                 if op.kind == "attention" and "scaled_dot_product" in str(getattr(op, "target", "")) and
                 flops > 0 and self._curve(op.kind, variant, dtype_key(dtype)) is None else None)
        if flash is not None:
            mem_s = nbytes / self.achievable_memory_Bps
            t, m = max(flash, mem_s), False
        else:
            t, m = (self.compute_time_ex(op.kind, flops, nbytes, dtype, gemm_shape(op, scale, shard, out_shard, backward),
                                         variant=variant, backward=backward)
                    if flops > 0 or nbytes > 0 else (0.0, True))
        if copied > 0:
            # copies the operands' strides force (core/copies.py): a read and a write of each byte,
            # priced like the profile's copy rows (their bytes axis counts both)
            tc, mc = self.compute_time_ex("copy", 0.0, 2.0 * copied, dtype)
            t, m = t + tc, m and mc
        return max(t, floor), m

    def fused_attention_s(self, op, flops: float, dtype: str, backward: bool) -> float | None:
        """Seconds of a fused attention op doing ``flops`` (the graph's full-square count, forward
        or backward, on this device) with the run's flash kernel, or None where the profile holds
        no rate for it (fp32, another kernel, no table: the roofline prices it).

        The published rates count a forward as 4 b h s_q s_k d, halved under a causal mask, and a
        backward as 2.5 of it (``FLASH_BWD_OVER_FWD``); fwd + bwd time = 3.5 x forward / rate.
        One rate prices both passes (the tables hold their sum); the rate is interpolated in
        log(seq) at the nearest tabled head dimension, flat beyond the table's ends."""
        if dtype_key(dtype) not in ("bf16", "fp16"):
            return None
        by_mask = self.attention_kernels.get(self.code.attention_kernel)
        causal = bool(getattr(op, "causal", False))
        table = (by_mask or {}).get("causal" if causal else "full")
        q = op.input_shapes[0] if getattr(op, "input_shapes", None) else ()
        if not table or len(q) != 4:            # q is [batch, heads, seq, head_dim]
            return None
        seq, head_dim = float(q[-2]), float(q[-1])
        dims = sorted(table)
        near = min(dims, key=lambda d: (abs(math.log(d / head_dim)), d))
        seqs, rates = table[near]
        # a compute-bound kernel at another SM clock runs at its rate times the clock ratio (clocks.py)
        rate = float(np.interp(math.log(seq), np.log(seqs), rates)) * self.clock_ratio
        # the graph counts a forward as the full square and a backward as 2 forwards
        fwd_full = flops / 2.0 if backward else flops
        fwd_kernel = fwd_full / 2.0 if causal else fwd_full
        return fwd_kernel * (FLASH_BWD_OVER_FWD if backward else 1.0) / rate

    def op_time(self, op, dtype: str, shard: int = 1, *, backward: bool = False, scale: float = 1.0) -> float:
        return self.op_time_ex(op, dtype, shard, backward=backward, scale=scale)[0]

    # ---------------------------------------------------------------- collectives
    def _collective_curve(self, kind: str, n: int, level: str, processes: int | None, chained: bool = False):
        by_procs = (chained and self._chain_curves.get((kind, n, level))) or self._coll_curves.get((kind, n, level))
        if not by_procs:
            return None
        want = n if processes is None else processes
        # the rows measured with the nearest number of busy processes (fewer on a tie)
        return by_procs[min(by_procs, key=lambda p: (abs(p - want), p))]

    def collective_time_ex(self, kind: str, message_bytes: float, group_size: int, link: Link,
                           level: str = "intra", algorithm: str = "ring",
                           processes: int | None = None, chained: bool = False) -> tuple[float, bool]:
        """Seconds for one collective over ``group_size`` ranks; ``message_bytes`` = M.

        M is the full buffer: the all-reduced tensor, the gathered output of all-gather, the
        input of reduce-scatter, the broadcast tensor, the whole all-to-all buffer of one
        rank, or the sent tensor for p2p.  ``processes``: how many processes of the plan are
        busy on the node at once (picks the measured rows taken under the same sharing).
        ``chained``: one call of a chain issued asynchronously and waited together (the
        profile's ``chained`` rows where it has them, the ordinary rows otherwise).
        """
        if kind not in COLLECTIVES:
            raise ValueError(f"unknown collective {kind!r}; one of {COLLECTIVES}")
        n = int(group_size)
        if message_bytes <= 0 or (n <= 1 and kind != "p2p"):
            return 0.0, False
        curve = self._collective_curve(kind, n, level, processes, chained)
        if curve is not None:
            return curve(message_bytes), True
        alpha = link.latency_s
        beta = 1.0 / (link.bandwidth_Bps * self.collective_efficiency.get(level, 1.0))
        m = float(message_bytes)
        if kind == "p2p":
            return alpha + m * beta, False
        if algorithm == "tree" and kind in ("all_reduce", "broadcast"):
            # binary-tree reduce + broadcast, pipelined: log2 N latencies each way
            steps = math.ceil(math.log2(n))
            factor = 2.0 if kind == "all_reduce" else 1.0
            return factor * steps * alpha + factor * m * beta, False
        if kind == "all_reduce":          # ring: reduce-scatter then all-gather
            return 2 * (n - 1) * alpha + 2.0 * (n - 1) / n * m * beta, False
        if kind in ("all_gather", "reduce_scatter", "all_to_all"):
            return (n - 1) * alpha + (n - 1) / n * m * beta, False
        # broadcast, pipelined along a ring: (N-1) latencies, each rank receives M once
        return (n - 1) * alpha + m * beta, False

    def collective_time(self, kind: str, message_bytes: float, group_size: int, link: Link,
                        level: str = "intra", algorithm: str = "ring", processes: int | None = None,
                        chained: bool = False) -> float:
        return self.collective_time_ex(kind, message_bytes, group_size, link, level, algorithm, processes, chained)[0]

    # -------------------------------------------------------------- host transfers
    def h2d_time(self, nbytes: float, link: Link) -> float:
        """Host <-> device copy of ``nbytes`` over the PCIe link (either direction)."""
        if nbytes <= 0:
            return 0.0
        return link.latency_s + nbytes / link.bandwidth_Bps

    def host_optimizer_time(self, num_params: float) -> float:
        """CPU Adam on ``num_params`` fp32 parameters on one node's host, all its cores (the
        profile's host_adam_params_per_s, a per-node rate; simulator/axes/offload.py shares it
        among the node's ranks)."""
        return num_params / self.host_adam_params_per_s if num_params > 0 else 0.0

    def optimizer_time(self, num_params: float, num_tensors: float = 0.0, num_dtensor_tensors: float = 0.0) -> float:
        """AdamW step on the device over ``num_params`` elements in that many parameter tensors.

        Per element: the measured optimizer rows' rate (``optimizer_element_s``), else memory
        bound over the state -- Adam (Kingma & Ba 2015, Alg. 1) reads parameter, gradient, m
        and v and writes parameter, m and v: 7 fp32 words = 28 bytes per parameter.  Per
        tensor: the measured fixed cost of one more plain (``optimizer_tensor_s``) or DTensor
        (``optimizer_dtensor_tensor_s``) parameter.  Plus, memory bound, the passes the training
        code priced runs around AdamW (``code.optimizer``, simulator/optimizer_step.py; none for
        autopar's runtime).
        """
        if num_params <= 0:
            return 0.0
        hbm_Bps = self.achievable_memory_Bps
        per_element = self.optimizer_element_s or 28.0 / hbm_Bps
        extra = self.code.optimizer.extra_bytes_per_param
        if extra:
            per_element += extra / hbm_Bps
        return (num_params * per_element + num_tensors * self.overhead("optimizer_tensor_s")
                + num_dtensor_tensors * self.overhead("optimizer_dtensor_tensor_s"))


def _attention_kernels(raw: Mapping[str, Any]) -> dict:
    """A profile's ``attention_kernels`` (docs/profiles.md) as kernel -> mask -> head dim ->
    (sequence lengths, FLOP/s), sorted by sequence length; entries that are not tables ("unit") skipped."""
    out: dict = {}
    for kernel, by_mask in raw.items():
        if not isinstance(by_mask, Mapping):
            continue
        for mask in ("causal", "full"):
            for head_dim, points in (by_mask.get(mask) or {}).items():
                pts = sorted((float(sq), float(tf) * 1e12) for sq, tf in points if tf is not None)
                if any(sq <= 0 or tf <= 0 for sq, tf in pts) or float(head_dim) <= 0:
                    raise ValueError(f"attention_kernels.{kernel}.{mask}.{head_dim}: sequence lengths, "
                                     f"rates and head dims must be positive")
                if pts:
                    out.setdefault(kernel, {}).setdefault(mask, {})[float(head_dim)] = \
                        (np.array([p[0] for p in pts]), np.array([p[1] for p in pts]))
    return out


def _optimizer_element_s(op_rows: list, tensor_s: float) -> float:
    """Seconds per parameter element of the measured AdamW rows, their per-tensor cost taken out.

    Each row of n elements holds ceil(n / 2^20) tensors (profiling/op_sweeps.py); the median
    over the rows of at least 2^18 elements (where the per-element work dominates) of
    (seconds - tensors * tensor_s) / n.  0 when the profile has no such rows.
    """
    rates = []
    for row in op_rows:
        if row.get("kind") != "optimizer":
            continue
        n = float(row["shape"][0]) if row.get("shape") else float(row.get("bytes", 0)) / 28.0
        if n < (1 << 18):
            continue
        tensors = math.ceil(n / _OPTIMIZER_ROW_TENSOR_NUMEL)
        rates.append(max(0.0, float(row["seconds"]) - tensors * tensor_s) / n)
    return float(np.median(rates)) if rates else 0.0


def gemm_shape(op, scale: float, shard: int, out_shard: int, backward: bool) -> tuple[float, float, float] | None:
    """(m, n, batch) of the output GEMM of a linear / matmul op on its shard, or None.

    The batch dims scale with the micro-batch; a split of the output's last dim (colwise) or
    of the heads (batched matmul) shrinks n or the batch; a rowwise split shrinks k only.
    Backward runs two GEMMs of the same size class; the forward's output shape stands for them.
    """
    shape = op.output_shape
    if op.kind not in ("linear", "matmul") or len(shape) < 2:
        return None
    if op.kind == "matmul" and "einsum" in str(getattr(op, "target", "")):
        # an einsum's output dims come in the equation's order ("bhts,bshd->bthd" puts the
        # batch between m and n), which the graph does not keep: no wave model, full waves
        return None
    if op.kind == "linear":
        m = scale
        for d in shape[:-1]:
            m *= d
        return (m, shape[-1] / out_shard, 1.0)
    batch = scale / (shard if out_shard > 1 else 1)
    for d in shape[:-2]:
        batch *= d
    return (float(shape[-2]), float(shape[-1]), batch)


def _load_profile(name: str | Path) -> dict[str, Any]:
    """A profile by name or by path to a JSON file, read and validated by autopar.profiles."""
    from autopar.profiles import load_profile

    return load_profile(str(name))
