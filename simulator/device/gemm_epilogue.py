"""The output write of a tiled GEMM that its main loop does not hide.

A GEMM kernel cuts its m x n output into tiles; each thread block runs a main loop over K
(load A and B slices, multiply-accumulate on the tensor cores) and then an epilogue that
converts the accumulators and stores the tile to global memory (NVIDIA, "Matrix
Multiplication Background User's Guide", Deep Learning Performance docs; CUTLASS
documentation, "Efficient GEMM in CUDA": the epilogue follows the main loop of a thread
block).  The model assumes, for a profile that says "exposed", what that implies for the
Ampere cuBLAS kernels: a 256 x 128 tile's fp32 accumulators take most of the register file
(128 fp32 registers per thread for 256 threads), so one block runs per SM and its epilogue is
not overlapped by tensor-core work; the blocks of a wave
share one K and reach their epilogues together, so the wave's output leaves at the HBM
bandwidth.  The cost a GEMM pays on top of its main loop is then its output bytes over the
memory bandwidth -- a fixed cost per output element, so a small K (hidden sizes 768-2048, or
tensor parallelism shrinking K) loses a larger share: relative to the main loop it is
out_bytes * peak * eff / (2 K * bandwidth), about 250 / K on an A100 in bf16 with the main
loop at 0.963 of peak and the stores at the profile's memory-bound 0.59 of the bandwidth (see
``main_loop_efficiency``).

Hopper's persistent warp-specialised kernels (CUTLASS 3.x "KernelTmaWarpSpecializedPingpong":
one consumer warp group's epilogue runs while the other's main loop keeps the tensor cores
busy; their TMA stores are asynchronous) hide most of it, so a profile says which it has
(``gemm_epilogue``: "exposed" or "overlapped", the default).  The tests check the model
against published whole-GEMM throughput, not against a kernel trace: no GPU was measured.

A profile whose GEMM efficiency comes from a measured whole GEMM and that prices the epilogue
exposed must take the epilogue out of that figure (``main_loop_efficiency``), or the epilogue
of the measured shape is paid twice.
"""
from __future__ import annotations


def gemm_output_elements(m: float, n: float, batch: float, flops: float, backward: bool) -> float:
    """Elements the GEMMs of one linear / matmul op write, forward or backward.

    (m, n, batch) is the forward's output per shard (``cost_model.gemm_shape``), ``flops`` the
    op's FLOPs in that pass.  Forward: one GEMM writes the m x n output of each batch entry, and
    k = flops / (2 m n batch).  Backward (``flops`` = the input- and weight-gradient GEMMs,
    2 x the forward's, so k = flops / (4 m n batch)): the input gradient writes m x k per batch
    entry and the other operand's gradient k x n per batch entry (a linear's weight gradient:
    batch is 1, its m counts every token).
    """
    if m <= 0 or n <= 0 or batch <= 0 or flops <= 0:
        return 0.0
    if not backward:
        return m * n * batch
    k = flops / (4.0 * m * n * batch)
    return (m * k + k * n) * batch


def exposed_epilogue_s(elements: float, element_bytes: float, memory_bandwidth_Bps: float,
                       memory_efficiency: float) -> float:
    """Seconds the output stores of a GEMM add after its main loop (exposed epilogue).

    The stored bytes at the bandwidth that memory-bound kernels reach (the profile's
    ``efficiency.memory_bound``); the stores of all SMs of a wave go out together.
    """
    if elements <= 0:
        return 0.0
    return elements * element_bytes / (memory_bandwidth_Bps * memory_efficiency)


def main_loop_efficiency(measured_flops_per_s: float, m: float, n: float, k: float, element_bytes: float,
                         peak_flops: float, wave_efficiency: float, memory_bandwidth_Bps: float,
                         memory_efficiency: float) -> float:
    """The main loop's fraction of peak implied by one measured whole GEMM of m x n x k.

    A published throughput (a best-shape sweep, for instance) times the whole kernel, its
    epilogue included; with the epilogue exposed, the main loop ran in the measured time less
    the output stores, on ``wave_efficiency`` of the SMs' tile slots.  Raises ValueError when
    the stores alone would take longer than the measured GEMM.
    """
    flops = 2.0 * m * n * k
    total_s = flops / measured_flops_per_s
    main_s = total_s - exposed_epilogue_s(m * n, element_bytes, memory_bandwidth_Bps, memory_efficiency)
    if main_s <= 0:
        raise ValueError(f"a {m:g} x {n:g} x {k:g} GEMM measured at {measured_flops_per_s:.3g} FLOP/s takes less "
                         f"time than storing its output at {memory_bandwidth_Bps * memory_efficiency:.3g} B/s; "
                         f"check the figure and the profile's memory bandwidth.")
    return flops / (peak_flops * wave_efficiency * main_s)
