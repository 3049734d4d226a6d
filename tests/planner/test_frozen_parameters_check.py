"""Frozen parameters (``requires_grad=False``) under tensor parallelism: the planner's runtime
check runs the same path the runtime runs for them.

tests/zoo/lora_gpt.py freezes every base weight, the embedding and the LM head; only its LoRA
adapters train.  The runtime hooks a row-wise (vocabulary-parallel) embedding's gradient
(runtime/apply_tp.keep_embedding_grads_sharded); a frozen weight has no gradient to hook.  The
dry run (runtime/dry_run.py, which the planner's check calls) builds the model with the model
file's own flags and applies that hook as training does, so a runtime that hooked frozen
weights would fail the check -- shown here by putting such a hook back in its place.  The
runs' parity with the plain loop: tests/integration/test_zoo_parity.py (lora_gpt) and
tests/integration/test_zoo_plan_run.py.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[2]
LORA = ROOT / "tests" / "zoo" / "lora_gpt.py"


def _plan(graph, **kw):
    from autopar.core.plan import ModelRef, uniform_plan

    ref = ModelRef(file=str(LORA), args=dict(graph.model_args), name="lora_gpt", fingerprint=graph.fingerprint)
    return uniform_plan(model=ref, num_layers=len(graph.layers), micro_batch=2, **kw)


def _hook_every_row_split_embedding(module: nn.Module) -> None:
    """The hook without its frozen-parameter guard (what the runtime did before)."""
    from torch.distributed.tensor import DTensor, Shard

    for sub in module.modules():
        if isinstance(sub, nn.Embedding) and isinstance(sub.weight, DTensor) and Shard(0) in sub.weight.placements:
            sub.weight.register_post_accumulate_grad_hook(lambda p: None)


def test_runtime_check_catches_a_hook_on_a_frozen_embedding(monkeypatch):
    from autopar.core.capture import capture_model_file
    from autopar.core.modelfile import load_model_file
    from autopar.planner.runtime_check import plan_runs
    from autopar.runtime import parallelize

    graph = capture_model_file(LORA, {"tied": True}, 2)
    mf = load_model_file(LORA)
    names = [layer.name for layer in graph.layers]
    vocab = {names.index("pre"): {"wte": "rowwise"}, names.index("post"): {"lm_head": "colwise"}}
    for sp in (False, True):
        blocks = {i: {f"{n}.attn.{p}.lora_{ab}": s for p in ("q_proj", "k_proj", "v_proj", "o_proj")
                      for ab, s in (("A", "colwise"), ("B", "rowwise"))} for i, n in enumerate(names) if n.startswith("h.")}
        plan = _plan(graph, tp=2, sequence_parallel=sp, tp_styles_per_layer={**vocab, **blocks})
        assert plan_runs(plan, graph, mf) is None, sp
    plan = _plan(graph, tp=2, tp_styles_per_layer=vocab)
    monkeypatch.setattr(parallelize, "keep_embedding_grads_sharded", _hook_every_row_split_embedding)
    err = plan_runs(plan, graph, mf)
    assert err is not None and "cannot register a hook on a tensor that doesn't require gradient" in err, err


def test_tp_keeps_frozen_parameters_frozen():
    """After tensor (and sequence) parallelism on fake ranks, exactly the model file's trained
    parameters require gradients: torch's SequenceParallel re-registers a norm's weight as
    trainable, which the runtime undoes."""
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.core.modelfile import load_model_file
    from autopar.runtime.apply_tp import apply_tp
    from autopar.runtime.dry_run import fake_world

    model = load_model_file(LORA).build()
    want = {n for n, p in model.named_parameters() if p.requires_grad}
    assert want and all("lora_" in n for n in want)
    styles = [("h.0", {"h.0.mlp.fc_in.lora_A": "colwise", "h.0.mlp.fc_in.lora_B": "rowwise"}),
              ("h.1", {"h.1.mlp.fc_in.lora_A": "colwise", "h.1.mlp.fc_in.lora_B": "rowwise"})]
    with fake_world(2), torch.device("meta"):
        mesh = init_device_mesh("cpu", (2,))
        model = load_model_file(LORA).build()
        apply_tp(model, mesh, [("", {"wte": "rowwise", "lm_head": "colwise"}), *styles], sequence_parallel=True)
        got = {n for n, p in model.named_parameters() if p.requires_grad}
    assert got == want, sorted(got ^ want)
