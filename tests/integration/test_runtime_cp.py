"""Context parallelism (runtime/apply_cp.py) trains like the single-process reference (fp32, gloo).

cp 2 on a GPT with learned position embeddings and SDPA attention (examples/gpt.py,
``attention="sdpa"``: its positions come from ``torch.arange`` in its forward) and on the
zoo's Hugging Face Llama (rotary positions from ``position_ids``, attention through
transformers' SDPA interface), both causal, with the load-balanced head-tail split.  Every
2-rank case runs in one torchrun launch, the 4-rank cases (dp 2 x cp 2, DDP-style replicate
and FSDP2 ZeRO-3 over dp x cp; cp 2 x tp 2 with Megatron's split, without and with sequence
parallelism) in another, full and selective recompute among the 2-rank ones; each must give,
over 2 steps, the losses of
``tests/plain_loop.py`` (which never enters the runtime) within 1e-5 and its final parameters.

The head-tail split itself is checked against its definition on a hand-written case.
"""
from __future__ import annotations

import functools
from pathlib import Path

import pytest

from runtime_support import ROOT, assert_matches_reference, run_cases

GPT = ROOT / "examples" / "gpt.py"
LLAMA = ROOT / "tests" / "zoo" / "hf_llama.py"
MODELS = {
    "gpt": (GPT, {"layers": 2, "hidden": 32, "heads": 4, "seq": 16, "vocab": 64, "dropout": 0.0,
                  "attention": "sdpa"}),
    "llama": (LLAMA, {"layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2, "ffn": 64, "seq": 8, "vocab": 64}),
}
GLOBAL_BATCH = 4
# 2 steps: the second loss is of parameters the first update moved, and the final parameters come
# from a second update with the optimizer state of the first (cp's gathers, the gradient-norm
# all-reduce and Adam's moments all enter)
STEPS = 2
# Megatron's split of each block (colwise in, rowwise out), as tests/integration/test_zoo_parity.py
TP_STYLES = {
    "gpt": {"attn.qkv": "colwise", "attn.proj": "rowwise", "mlp.fc": "colwise", "mlp.proj": "rowwise"},
    "llama": {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
              "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
              "mlp.down_proj": "rowwise"},
}

# name -> (model, uniform_plan arguments); dp * micro_batch * num_microbatches = GLOBAL_BATCH
TWO_RANK = {
    "gpt_cp2": ("gpt", dict(cp=2, micro_batch=4)),
    "llama_cp2": ("llama", dict(cp=2, micro_batch=4)),
    "gpt_cp2_grad_accum": ("gpt", dict(cp=2, micro_batch=2, num_microbatches=2)),
    # recompute: the rerun in backward attends over the whole sequence too (runtime/recompute.py)
    "gpt_cp2_recompute_full": ("gpt", dict(cp=2, micro_batch=4, recompute="full")),
    "llama_cp2_recompute_selective": ("llama", dict(cp=2, micro_batch=4, recompute="selective")),
}
FOUR_RANK = {
    "gpt_dp2_cp2": ("gpt", dict(dp=2, cp=2, micro_batch=2)),
    "gpt_dp2_cp2_zero3": ("gpt", dict(dp=2, cp=2, micro_batch=2, zero=3)),
    "llama_dp2_cp2_zero3": ("llama", dict(dp=2, cp=2, micro_batch=2, zero=3)),
    # cp x tp: each rank's heads of its tokens; K/V gathered over the cp group of its tp coordinate
    "gpt_cp2_tp2": ("gpt", dict(cp=2, tp=2, micro_batch=4)),
    "llama_cp2_tp2_sp_zero3": ("llama", dict(cp=2, tp=2, micro_batch=4, sequence_parallel=True, zero=3)),
    # cp x pp: the batch sliced before the schedule cuts micro-batches, every stage's forward in
    # cp's attention on its cp group; Llama's stages are cut from the torch.export graph (traced
    # on the rank's tokens, its traced causal mask taken by the mode), GPT's by torch.fx
    "gpt_cp2_pp2_1f1b": ("gpt", dict(cp=2, pp=2, micro_batch=2, num_microbatches=2, schedule="1f1b")),
    "llama_cp2_pp2_gpipe": ("llama", dict(cp=2, pp=2, micro_batch=2, num_microbatches=2, schedule="gpipe")),
    "llama_cp2_pp2_1f1b_recompute": ("llama", dict(cp=2, pp=2, micro_batch=2, num_microbatches=2, schedule="1f1b",
                                                   recompute="full")),
}


@functools.lru_cache(maxsize=None)
def _graph(model: str, micro_batch: int):
    from capture_memo import captured   # the ranks' plan checks read this capture (tests/capture_memo.py)

    path, args = MODELS[model]
    return captured(str(path), dict(args), micro_batch)


def _plan(path: Path, model: str, **kw) -> Path:
    from autopar.core.plan import ModelRef, save_plan, uniform_plan

    g = _graph(model, kw["micro_batch"])
    file, args = MODELS[model]
    if kw.get("tp", 1) > 1:
        kw["tp_styles_per_layer"] = {i: {f"{layer.name}.{k}": v for k, v in TP_STYLES[model].items()}
                                     for i, layer in enumerate(g.layers) if layer.name not in ("pre", "post")}
    plan = uniform_plan(model=ModelRef(str(file), dict(args), model, g.fingerprint), num_layers=len(g.layers), **kw)
    assert plan.global_batch == GLOBAL_BATCH
    save_plan(plan, path)
    return path


@functools.lru_cache(maxsize=None)
def _reference(model: str):
    from plain_loop import train_plain

    path, args = MODELS[model]
    return train_plain(path, dict(args), GLOBAL_BATCH, STEPS)


def _launch(tmp: Path, nproc: int, cases: dict) -> dict:
    specs = []
    for name, (model, kw) in cases.items():
        specs.append({"name": name, "model": model, "plan": str(_plan(tmp / f"{name}.json", model, **kw)),
                      "measured": str(tmp / f"{name}.measured.json"), "checkpoint_dir": str(tmp / f"{name}.ckpt"),
                      "grad_norms": str(tmp / f"{name}.norms.json"), "steps": STEPS})     # every step's Trainer.last_grad_norm
    run_cases(nproc, specs, tmp, timeout_s=300)
    return {c["name"]: c for c in specs}


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("cp2"), 2, TWO_RANK)


@pytest.fixture(scope="module")
def four_rank_runs(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("cp4"), 4, FOUR_RANK)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(TWO_RANK))
def test_cp2_matches_reference(two_rank_runs, name):
    case = two_rank_runs[name]
    assert_matches_reference(Path(case["measured"]), Path(case["checkpoint_dir"]), _reference(case["model"]), name,
                             steps=STEPS)
    _assert_grad_norms(case)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(FOUR_RANK))
def test_four_rank_cp_matches_reference(four_rank_runs, name):
    case = four_rank_runs[name]
    assert_matches_reference(Path(case["measured"]), Path(case["checkpoint_dir"]), _reference(case["model"]), name,
                             steps=STEPS)
    _assert_grad_norms(case)


def _assert_grad_norms(case: dict) -> None:
    """The global gradient norm of every step (the cp ranks' gradients are synchronised replicas:
    counted once) is the plain loop's."""
    import json

    norms = json.loads(Path(case["grad_norms"]).read_text())
    want = _reference(case["model"]).grad_norms
    assert norms == pytest.approx(want, rel=1e-5), (case["name"], norms, want)


def test_head_tail_split_is_chunks_i_and_2cp_minus_1_minus_i():
    from autopar.runtime.apply_cp import head_tail_positions

    # seq 16, cp 2: four chunks of 4; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert head_tail_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert head_tail_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    # every position exactly once, and every rank the same count of causal (query, key) pairs
    for cp in (2, 4):
        ranks = [head_tail_positions(32, cp, r) for r in range(cp)]
        assert sorted(sum((p.tolist() for p in ranks), [])) == list(range(32))
        pairs = {int((p + 1).sum()) for p in ranks}      # a query at position p sees p + 1 keys
        assert len(pairs) == 1, pairs
