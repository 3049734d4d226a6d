"""The planner offers a plan kind only where the runtime applies it: kinds are checked by
running the runtime's own transformations on fake ranks (planner/runtime_check.py, through the
runtime's dry run, runtime/dry_run.py).  The breakages below are ones the runtime really raises
on these models; the positive control (a GPT the runtime handles in every kind) must keep every
kind."""
from __future__ import annotations

from pathlib import Path

import pytest

from autopar.core.capture import capture_model_file
from autopar.core.modelfile import load_model_file
from autopar.planner.runtime_check import find_executable

ROOT = Path(__file__).resolve().parents[2]
ZOO = ROOT / "tests" / "zoo"
MODELS = ROOT / "tests" / "plan_models"


def _executable(path: Path, args=None, degrees=(2,)):
    graph = capture_model_file(path, dict(args or {}), 2)
    return graph, find_executable(graph, load_model_file(path), tp_degrees=degrees)


def _left(ex) -> dict[str, str]:
    return {x.kind: x.reason for x in ex.left_out}


@pytest.fixture(scope="module")
def gpt_checked():
    """The positive control's check, shared by the tests that read it."""
    return _executable(ROOT / "examples" / "gpt.py", {"layers": 4, "hidden": 64, "heads": 4, "seq": 16, "vocab": 128},
                       degrees=(2, 4))


def test_gpt_keeps_every_kind(gpt_checked):
    graph, ex = gpt_checked
    assert ex.left_out == ()
    assert ex.tp_degrees == (2, 4) and all(ex.splittable)
    assert ex.pipeline and ex.cuttable == frozenset(range(1, len(graph.layers)))
    assert ex.fsdp and ex.offload and ex.sequence_parallel and ex.recompute == ("none", "selective", "full")


def test_large_model_path_on_fake_tensors_keeps_every_kind(monkeypatch):
    """Models over REAL_TENSOR_BYTES are checked under FakeTensorMode (no storage): the same GPT
    forced onto that path must keep every kind too (a materialisation the fake mode refuses
    would leave a 175B model with plain data parallelism only)."""
    from autopar.runtime import dry_run

    monkeypatch.setattr(dry_run, "REAL_TENSOR_BYTES", 0)
    dry_run._TEMPLATES.clear()
    graph, ex = _executable(ROOT / "examples" / "gpt.py", {"layers": 4, "hidden": 64, "heads": 4, "seq": 16,
                                                             "vocab": 128}, degrees=(2,))
    assert ex.left_out == (), _left(ex)
    assert ex.fsdp and ex.offload and ex.pipeline and all(ex.splittable)


def test_nanogpt_fused_qkv_split_and_pipeline_are_left_out():
    from autopar.core.sharding import megatron_styles

    graph, ex = _executable(ZOO / "nanogpt.py")
    left = _left(ex)
    blocks = [i for i, layer in enumerate(graph.layers) if layer.name.startswith("transformer.h.")]
    # c_attn's output is split(n_embd) into q, k, v: the split analysis offers it split per
    # part, but nanoGPT views q/k/v with C read from its input (the whole hidden size), so a
    # rank's share of the heads does not fit and the runtime fails; the blocks keep their MLP
    # split, drop the fused pair, and say why
    assert blocks and all(ex.splittable[i] for i in blocks)
    assert all(megatron_styles(graph, i)[f"{graph.layers[i].name}.attn.c_attn"] == "colwise:3" for i in blocks)
    assert ex.whole_fused == {f"{graph.layers[i].name}.attn.c_attn" for i in blocks}
    assert all(set(ex.styles(graph, i)) == {f"{graph.layers[i].name}.mlp.c_fc",
                                            f"{graph.layers[i].name}.mlp.c_proj"} for i in blocks)
    fused = left["tp of fused projections in transformer.h.0"]
    assert "transformer.h.0.attn.c_attn" in fused and "fails in the runtime" in fused, left
    # forward(idx, targets): the targets are an input every stage would need
    assert "pipeline" in left and not ex.pipeline


def test_two_tower_pipeline_and_one_wide_column_split_are_left_out():
    graph, ex = _executable(MODELS / "two_tower.py")
    left = _left(ex)
    assert not ex.pipeline and "pipeline" in left
    assert "does not divide over tp = 2" in left["tensor parallel"]   # head = Linear(32 -> 1)
    assert ex.tp_degrees == ()


def test_t5_pipeline_left_out():
    pytest.importorskip("transformers")
    graph, ex = _executable(ZOO / "hf_t5.py", degrees=())      # the pipeline is checked, not tp's splits
    names = [layer.name for layer in graph.layers]
    assert "encoder.block.0" in names and "decoder.block.0" in names
    assert not ex.pipeline and "pipeline" in _left(ex)


def test_sequence_parallel_left_out_where_an_attention_is_not_split():
    """mha_dict's nn.MultiheadAttention lies outside the feed-forward pair its styles split: under
    sequence parallelism it would attend over one rank's half of the sequence.  That plan runs
    (no crash check sees it) and trained another model, 0.014 off the plain loop at step 3, so
    the planner must leave it out by the rule (core/sharding.sequence_mixing_outside_pairs)."""
    graph, ex = _executable(ZOO / "mha_dict.py")
    left = _left(ex)
    assert not ex.sequence_parallel and "mixes sequence positions" in left["sequence parallel"], left
    assert all(ex.splittable)                        # tensor parallelism itself stays offered


def test_sequence_parallel_kept_where_attention_is_inside_the_pairs(gpt_checked):
    # the GPT's attention runs between its column-split qkv and row-split proj
    graph, ex = gpt_checked
    assert ex.sequence_parallel, _left(ex)


def test_pipeline_check_merges_a_zero_dim_output_over_micro_batches(monkeypatch):
    """moe_aux returns {"logits", "aux_loss": 0-d}: the schedule merges the last stage's outputs
    of the micro-batches at the end of a step, where torch's default merge (concatenation along
    dim 0) crashed at run time.  The check runs the runtime's merge: it keeps the pipeline, and
    with torch's default merge in its place it would have left the pipeline out."""
    from torch.distributed.pipelining.microbatch import merge_chunks

    from autopar.runtime import apply_pp

    _, ex = _executable(ZOO / "moe_aux.py", degrees=())       # the pipeline is checked, not tp's splits
    assert ex.pipeline, _left(ex)
    monkeypatch.setattr(apply_pp, "merge_microbatch_outputs", lambda chunks: merge_chunks(chunks, None))
    _, ex = _executable(ZOO / "moe_aux.py", degrees=())
    assert not ex.pipeline and "zero-dimensional tensor" in _left(ex)["pipeline"], _left(ex)


def test_merge_microbatch_outputs_joins_batches_and_averages_zero_dim_tensors():
    import torch

    from autopar.runtime.apply_pp import merge_microbatch_outputs

    a = (torch.ones(2, 3), torch.tensor(1.0))
    b = (torch.zeros(1, 3), torch.tensor(4.0))
    logits, aux = merge_microbatch_outputs([a, b])
    assert torch.equal(logits, torch.cat([a[0], b[0]])) and aux.item() == 2.5
