"""Recurrent modules (nn.LSTM, nn.GRU, nn.RNN) are captured as one op with their parameters,
FLOPs and kept activations (issue 32: an LSTM's weights were reported "not used by the forward"
and its FLOPs and activations were missing).

References, independent of the capture: ``torch.utils.flop_counter.FlopCounterMode`` counts the
GEMMs the cells run on a real CPU module, forward and backward, and a saved-tensors hook sums
the bytes autograd keeps -- both with oneDNN off, so the cells run their autograd
decomposition (aten lstm_cell / gru_cell / rnn_tanh_cell), the path the capture's count follows.
The pointwise part (gate sums, biases, the cell's sigmoids and tanh) is our per-element
convention (op_costs.FLOPS_PER_ELEMENT), which FlopCounterMode does not count.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn

from autopar.core.capture import capture_model_file
from autopar.core.op_costs import RNN_CELL_FLOPS, RNN_GATES

pytestmark = pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")
MODEL = Path(__file__).resolve().parents[1] / "plan_models" / "lstm_lm.py"
B, T, H = 2, 8, 32               # the fixture's batch, sequence and hidden (its input width is H too)
MODES = {"lstm": ("LSTM", nn.LSTM), "gru": ("GRU", nn.GRU), "rnn": ("RNN_TANH", nn.RNN)}


def _reference(cls, layers: int):
    """(forward GEMM FLOPs, backward GEMM FLOPs, bytes kept for backward) of a real module."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    mod = cls(H, H, num_layers=layers, batch_first=True)
    x = torch.randn(B, T, H, requires_grad=True)
    weights = {p.data_ptr() for p in mod.parameters()}
    kept: dict = {}

    def pack(t):
        if t.data_ptr() not in weights and t.is_floating_point():
            kept[(t.data_ptr(), tuple(t.shape), tuple(t.stride()))] = t.numel() * t.element_size()
        return t

    with torch.backends.mkldnn.flags(enabled=False):
        fwd = FlopCounterMode(display=False)
        with fwd, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out, _ = mod(x)
        bwd = FlopCounterMode(display=False)
        with bwd:
            out.sum().backward()
    return fwd.get_total_flops(), bwd.get_total_flops(), sum(kept.values())


@pytest.mark.parametrize("cell", ["lstm", "gru", "rnn"])
@pytest.mark.parametrize("layers", [1, 2])
def test_rnn_flops_and_activations_against_a_real_module(cell, layers):
    mode, cls = MODES[cell]
    g = capture_model_file(str(MODEL), {"cell": cell, "layers": layers, "hidden": H, "seq": T}, B)
    (op,) = [o for o in g.ops if o.kind == "rnn"]
    gates = RNN_GATES[mode]
    # closed form: per step, layer and direction the G gates as two GEMMs, 2*B*T*G*H*(I + H)
    gemm = layers * 2 * B * T * gates * H * (H + H)
    pointwise = layers * B * T * H * (RNN_CELL_FLOPS[mode] + 3 * gates)
    assert op.fwd_flops == gemm + pointwise
    ref_fwd, ref_bwd, ref_kept = _reference(cls, layers)
    assert op.fwd_flops - pointwise == ref_fwd
    assert op.bwd_flops - pointwise == ref_bwd
    assert op.saved_bytes == ref_kept


def test_rnn_parameters_belong_to_the_forward():
    g = capture_model_file(str(MODEL), {}, B)
    (op,) = [o for o in g.ops if o.kind == "rnn"]
    lstm = nn.LSTM(H, H, num_layers=2)
    assert op.param_numel == sum(p.numel() for p in lstm.parameters())
    assert sum(o.param_numel for o in g.ops) == g.params_total
    assert not any("not used by the forward" in n for n in g.notes), g.notes
    # the head reads the LSTM's output: an activation, which the head keeps for its backward
    (head,) = [o for o in g.ops if o.module_path == "head"]
    assert head.inputs == ("rnn",) and head.saved_bytes == B * T * H * 4


def test_bidirectional_gru_flops():
    g = capture_model_file(str(MODEL), {"cell": "gru", "bidirectional": True}, B)
    (op,) = [o for o in g.ops if o.kind == "rnn"]
    # layer 1 reads H, layer 2 the two directions' 2H; 3 gates; 2 directions
    gemm = 2 * (2 * B * T * 3 * H * (H + H)) + 2 * (2 * B * T * 3 * H * (2 * H + H))
    assert op.fwd_flops == gemm + 2 * 2 * B * T * H * (RNN_CELL_FLOPS["GRU"] + 3 * 3)
    assert op.output_shape == (B, T, 2 * H)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("args", [{}, {"cell": "gru"}, {"cell": "rnn", "bidirectional": True}])
def test_export_path_prices_the_aten_op_alike(args):
    """A model fx cannot trace is captured through torch.export, where the module is one
    ``aten.lstm`` / ``gru`` / ``rnn_tanh`` op: the same parameters, FLOPs and kept bytes."""
    from autopar.core.modelfile import load_model_file
    from autopar.core.op_costs import cost
    from autopar.core.trace_export import trace_export
    from autopar.core.trace_walk import ParamIndex

    mf = load_model_file(MODEL)
    with torch.device("meta"):
        model = mf.build(**args)
        inputs, _ = mf.make_batch(B, **args)
    model.train()
    walk = trace_export(model, tuple(inputs), ParamIndex(model))
    (exported,) = [o for o in walk.ops if o.facts.canon == "rnn"]
    c = cost(exported.facts)
    (traced,) = [o for o in capture_model_file(str(MODEL), args, B).ops if o.kind == "rnn"]
    assert (c.fwd_flops, c.bwd_flops, sum(b for _, b in c.saved)) == \
        (traced.fwd_flops, traced.bwd_flops, traced.saved_bytes)
    assert sorted(exported.params) == sorted(traced.params)
