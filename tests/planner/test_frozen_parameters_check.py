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


def _styles(graph, modules: tuple[str, ...]) -> dict[int, dict[str, str]]:
    """The frozen embedding row-wise, the frozen head column-wise and every adapter pair of
    ``modules`` in each block (lora_A column-wise, lora_B row-wise)."""
    names = [layer.name for layer in graph.layers]
    out = {names.index("pre"): {"wte": "rowwise"}, names.index("post"): {"lm_head": "colwise"}}
    for i, n in enumerate(names):
        if n.startswith("h."):
            out[i] = {f"{n}.{m}.lora_{ab}": s for m in modules for ab, s in (("A", "colwise"), ("B", "rowwise"))}
    return out


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

    mf = load_model_file(LORA)
    mlp = ("mlp.fc_in", "mlp.fc_out")
    gpt = capture_model_file(LORA, {}, 2)
    mlp_only = capture_model_file(LORA, {"attention": False, "tied": True}, 2)
    plans = [(gpt, _plan(gpt, tp=2, tp_styles_per_layer=_styles(gpt, ("attn.q_proj", "attn.o_proj", *mlp)))),
             (mlp_only, _plan(mlp_only, tp=2, sequence_parallel=True, tp_styles_per_layer=_styles(mlp_only, mlp)))]
    for graph, plan in plans:
        assert plan_runs(plan, graph, mf) is None, graph.model_args
    monkeypatch.setattr(parallelize, "keep_embedding_grads_sharded", _hook_every_row_split_embedding)
    for graph, plan in plans:
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

    args = {"attention": False}
    model = load_model_file(LORA).build(**args)
    want = {n for n, p in model.named_parameters() if p.requires_grad}
    assert want and all("lora_" in n for n in want)
    styles = [(f"h.{i}", {f"h.{i}.mlp.{m}.lora_{ab}": s for m in ("fc_in", "fc_out")
                          for ab, s in (("A", "colwise"), ("B", "rowwise"))}) for i in range(2)]
    with fake_world(2), torch.device("meta"):
        mesh = init_device_mesh("cpu", (2,))
        model = load_model_file(LORA).build(**args)
        apply_tp(model, mesh, [("", {"wte": "rowwise", "lm_head": "colwise"}), *styles], sequence_parallel=True)
        got = {n for n, p in model.named_parameters() if p.requires_grad}
    assert got == want, sorted(got ^ want)
