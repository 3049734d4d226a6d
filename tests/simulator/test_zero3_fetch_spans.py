"""DeepSpeed ZeRO-3 of April 2021 priced fetch by fetch (simulator/zero3_fetch_spans.py, sharded_dp
item 4c) against closed forms worked by hand from the rules of its code: a drain at every fetch of
parameters not yet gathered, one weight prefetched after it, the reuse distance, the gradient
reduced in the span after its own."""
from pathlib import Path

import numpy as np
import pytest

from autopar.simulator.axes.sharded_dp_zero3_spans import (LayerUnits, drained_spans_s, kept_for_backward, layer_pass_times,
                                                 layer_units)

GPT = Path(__file__).resolve().parents[2] / "examples" / "gpt.py"


def test_each_span_takes_the_longer_of_its_compute_and_the_next_gather():
    # visit 0 computes 1 s under visit 1's 0.5 s gather, visit 1 computes 2 s under visit 0's 3 s
    assert drained_spans_s([1.0, 2.0], [3.0, 0.5], [0, 0], [0, 0], 0.0) == pytest.approx(1.0 + 3.0)
    # the overlapped part of the compute runs slower: 1 + 0.5 x 0.5, and 2 + 0.5 x 2 = 3 against 3
    assert drained_spans_s([1.0, 2.0], [3.0, 0.5], [0, 0], [0, 0], 0.5) == pytest.approx(1.25 + 3.0)
    # the zero fill of each prefetched parameter is exposed: visit 1's in span 0, visit 0's in span 1
    assert drained_spans_s([1.0, 2.0], [3.0, 0.5], [0.1, 0.2], [0, 0], 0.0) == pytest.approx(4.0 + 0.3)
    # the sum of the spans' maxima, not the max of the sums (3 s of compute, 3.5 s of gathers)
    assert drained_spans_s([1.0, 2.0], [3.0, 0.5], [0, 0], [0, 0], 0.0) > max(3.0, 3.5)


def test_a_gathered_visit_drains_nothing_and_a_reduction_lands_in_the_next_span():
    # visit 1's parameters are kept: it joins visit 0's span (1 + 2 s under visit 2's 1 s gather);
    # span 1: visit 2's 4 s under visit 0's 3 s gather
    assert drained_spans_s([1.0, 2.0, 4.0], [3.0, 0.0, 1.0], [0, 0, 0], [0, 0, 0], 0.0) == pytest.approx(3.0 + 4.0)
    # visit 1's 2 s reduction runs in span 1, beside visit 0's gather: 3 + 2 = 5 s > 4 s of compute
    assert drained_spans_s([1.0, 2.0, 4.0], [3.0, 0.0, 1.0], [0, 0, 0], [0, 2.0, 0], 0.0) == pytest.approx(3.0 + 5.0)
    # nothing to fetch: the compute alone
    assert drained_spans_s([1.0, 2.0], [0.0, 0.0], [0, 0], [0, 0], 0.5) == pytest.approx(3.0)


def test_reuse_distance_keeps_the_last_weight_of_a_wide_block():
    # a 12288-wide block's weights (QKV 3h^2, proj h^2, fc 4h^2, fc2 4h^2): between fc2's
    # recomputed forward and its backward no other visit (kept); between fc's, fc2's forward and
    # backward, 2 x 4h^2 = 1.21e9 elements > 1e9 (released), and more for proj and QKV
    h = 12288
    numel = np.array([3, 1, 4, 4], dtype=float) * h * h
    assert kept_for_backward(numel).tolist() == [False, False, False, True]
    # a 1024-wide block: 2 x (h^2 + 8h^2) = 18.9e6 elements at most, every weight kept
    h = 1024
    assert kept_for_backward(np.array([3, 1, 4, 4], dtype=float) * h * h).all()


def test_a_layer_communication_bound_reads_its_gathers_copies_and_reduction():
    # one unit, compute negligible: forward = the gather + its copy-out (2 passes) + zero fill (1);
    # backward with recompute: the recomputed forward gathers (and drains), the backward keeps the
    # unit (distance 0): one span, under the gather, its copies and the unit's reduction
    u = LayerUnits(numel=np.array([1e6]), fwd_share=np.array([1.0]), bwd_share=np.array([1.0]))
    G, R, P = 0.3, 0.2, 0.01
    fwd, back, comm = layer_pass_times(u, 1e-6, 1e-6, 2e-6, G, R, P, 0.0, recomputed=True)
    assert fwd == pytest.approx(G + 3 * P)
    assert back == pytest.approx(P + G + 2 * P + R)
    assert comm == pytest.approx(G + 2 * P + R)
    # compute-bound: the compute, slowed on its overlapped part, plus the exposed zero fills
    fwd, back, _ = layer_pass_times(u, 10.0, 10.0, 20.0, G, R, P, 0.5, recomputed=True)
    assert fwd == pytest.approx(10.0 + 0.5 * (G + 2 * P) + P)
    assert back == pytest.approx(30.0 + 0.5 * (G + 2 * P + R) + P)
    # no recompute: the backward gathers the unit again
    _, back, comm = layer_pass_times(u, 1e-6, 0.0, 2e-6, G, R, P, 0.0, recomputed=False)
    assert comm == pytest.approx(G + 2 * P + R)


def test_units_of_a_captured_block_are_its_linears_in_forward_order():
    from autopar.core.capture import capture_model_file

    graph = capture_model_file(str(GPT), {"layers": 2, "hidden": 64, "heads": 4, "seq": 32, "vocab": 128}, 1)
    block = next(i for i, layer in enumerate(graph.layers) if layer.kind not in ("pre", "post"))
    ops = graph.layer_ops(block)
    # norms (128 elements) stay gathered under a 1000-element threshold, the linears (>= 4160) do not
    u = layer_units(ops, threshold=1000)
    linears = [op for op in ops if op.kind == "linear"]
    assert u.numel.tolist() == [op.param_numel for op in linears]
    assert len(linears) == 4
    assert u.fwd_share.sum() == pytest.approx(1.0) and u.bwd_share.sum() == pytest.approx(1.0)
    # the first forward span holds QKV and the attention core: more than QKV's own FLOPs
    total_fwd = sum(op.fwd_flops for op in ops)
    assert u.fwd_share[0] > linears[0].fwd_flops / total_fwd
    # under DeepSpeed's default threshold (1e5 elements) a 64-wide block gathers nothing
    assert layer_units(ops) is None
