"""Every zoo model under every plan kind the runtime runs for it trains like a plain PyTorch loop.

For each model of ``tests/zoo`` one ``torchrun`` on 2 gloo ranks runs its plans one after
another (``zoo_worker.py``); each plan's losses over ``STEPS`` steps must match
``plain_loop.train_plain`` -- a single-process loop that never enters autopar's runtime, on
the same initial weights and batches -- within ``LOSS_ATOL`` (fp32).  Plans are uniform plans
(``core.plan.uniform_plan``) over the captured layers, global batch 4.

``REFUSED`` lists the kinds a model cannot take, with the reason; each is run too and must be
refused by the runtime with a message naming the reason (never a crash or a wrong result).
``LEFT_OUT`` lists kinds not run at all, with the reason.
"""
from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import pytest
import torch

from runtime_support import ROOT, failure_summary, torchrun

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import plain_loop  # noqa: E402

ZOO = ROOT / "tests" / "zoo"
WORKER = Path(__file__).resolve().parents[1] / "zoo_worker.py"
GLOBAL_BATCH = 4
MICRO_BATCH = 2        # every plan below captures the model with the same micro-batch (one capture per rank)
STEPS = 3
LOSS_ATOL = 1e-5

# plan kinds: uniform_plan arguments (dp * micro_batch * num_microbatches = 4)
DDP = dict(dp=2, micro_batch=2)
ZERO1 = dict(dp=2, micro_batch=2, zero=1)
ZERO3 = dict(dp=2, micro_batch=2, zero=3)
RECOMPUTE = dict(dp=2, micro_batch=2, zero=2, recompute="full")
OFFLOAD = dict(dp=2, micro_batch=2, zero=3, offload="cpu")
TP = dict(tp=2, micro_batch=2, num_microbatches=2)
TP_SP = dict(tp=2, micro_batch=2, num_microbatches=2, sequence_parallel=True)
PP = dict(pp=2, micro_batch=2, num_microbatches=2, schedule="gpipe")
PP_1F1B = dict(pp=2, micro_batch=2, num_microbatches=2, schedule="1f1b")
PP_INTERLEAVED = dict(pp=2, micro_batch=2, num_microbatches=2, schedule="interleaved", virtual_stages=2)
PP_ZERO3 = dict(pp=2, micro_batch=2, num_microbatches=2, schedule="gpipe", zero=3)
PP_RECOMPUTE = dict(pp=2, micro_batch=2, num_microbatches=2, schedule="gpipe", recompute="full")
# every model: ZeRO-0 (DDP), ZeRO-3, recompute; ZeRO-1 and CPU offload on the tied models
CORE = {"ddp": DDP, "zero3": ZERO3, "recompute": RECOMPUTE}
TIED_EXTRA = {"zero1": ZERO1, "offload": OFFLOAD}

LLAMA_TP = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
            "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
            "mlp.down_proj": "rowwise"}

# model -> {"kinds": {kind: plan kwargs}, "tp": per-block TP styles (relative to the block),
#           kind: {layer name: TP styles} for kinds that split "pre"/"post" modules,
#           "file", "args": the zoo file and model arguments, when not tests/zoo/<model>.py with its defaults}
MODELS: dict[str, dict] = {
    # sequence parallelism: Hugging Face layers take hidden_states= by keyword, norms are LlamaRMSNorm
    # pp_interleaved: four stages of one layer each, so the rotary tables and the mask that
    # transformers 5 makes before the first block are relayed through stage 1 to stage 2
    "hf_llama": dict(kinds={**CORE, "tp": TP, "tp_sp": TP_SP, "pp": PP, "pp_interleaved": PP_INTERLEAVED},
                     tp=LLAMA_TP),
    "hf_qwen2": dict(kinds={**CORE, **TIED_EXTRA, "tp": TP, "tp_vocab": TP, "pp": PP, "pp_zero3": PP_ZERO3},
                     tp=LLAMA_TP, tp_vocab={"pre": {"model.embed_tokens": "rowwise"}, "post": {"lm_head": "colwise"}}),
    "hf_bert": dict(kinds={**CORE, "tp": TP, "pp": PP, "pp_recompute": PP_RECOMPUTE},
                    tp={"attention.self.query": "colwise", "attention.self.key": "colwise",
                        "attention.self.value": "colwise", "attention.output.dense": "rowwise",
                        "intermediate.dense": "colwise", "output.dense": "rowwise"}),
    "hf_opt": dict(kinds={**CORE, "tp": TP, "pp": PP},
                   tp={"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
                       "self_attn.out_proj": "rowwise", "fc1": "colwise", "fc2": "rowwise"}),
    "hf_gpt_neox": dict(kinds={**CORE, "tp": TP, "pp": PP},
                        tp={"attention.query_key_value": "colwise", "attention.dense": "rowwise",
                            "mlp.dense_h_to_4h": "colwise", "mlp.dense_4h_to_h": "rowwise"}),
    # T5's feed-forward is layer.1 of an encoder block and layer.2 of a decoder block
    "hf_t5": dict(kinds={**CORE, "tp": TP},
                  tp_by_prefix={"encoder.block.": {"layer.1.DenseReluDense.wi": "colwise",
                                                   "layer.1.DenseReluDense.wo": "rowwise"},
                                "decoder.block.": {"layer.2.DenseReluDense.wi": "colwise",
                                                   "layer.2.DenseReluDense.wo": "rowwise"}}),
    "nanogpt": dict(kinds={**CORE, **TIED_EXTRA, "tp": TP, "tp_vocab": TP},
                    tp={"mlp.c_fc": "colwise", "mlp.c_proj": "rowwise"},
                    tp_vocab={"pre": {"transformer.wte": "rowwise"}, "post": {"lm_head": "colwise"}},
                    tp_head_only={"post": {"lm_head": "colwise"}}),
    # the tied embedding on the first stage, the tied head on the last
    "tied_lm": dict(kinds={**CORE, "pp": PP, "pp_1f1b": PP_1F1B, "pp_interleaved": PP_INTERLEAVED,
                           "pp_zero3": PP_ZERO3, "pp_recompute": PP_RECOMPUTE, "tp_vocab": TP, "tp": TP,
                           "tp_sp": TP_SP},
                    tp={"fc": "colwise", "proj": "rowwise"},
                    tp_vocab={"pre": {"embed": "rowwise"}, "post": {"head": "colwise"}}),
    "mha_dict": dict(kinds={**CORE, "tp": TP, "pp": PP}, tp={"ff.0": "colwise", "ff.2": "rowwise"}),
    # transformers' Conv1D (weight [in, out]): attention and MLP split; c_attn is a fused q/k/v
    # projection, split per part ("colwise:3", runtime/fused_tp.py: each rank holds its half of
    # q, of k and of v); tp_sp: the attention runs inside the pair, on the whole sequence
    "hf_gpt2": dict(kinds={"tp": TP, "tp_sp": TP_SP},
                    tp={"attn.c_attn": "colwise:3", "attn.c_proj": "rowwise", "mlp.c_fc": "colwise",
                        "mlp.c_proj": "rowwise"}),
    # fused qkv_proj sliced into q, k, v (its query width read from the config: the attention
    # gets its own config with the head counts divided, runtime/apply_tp._divide_config_heads)
    # and fused gate_up_proj chunked in two: both split per part, with and without SP
    "hf_phi3": dict(kinds={"tp": TP, "tp_sp": TP_SP},
                    tp={"self_attn.qkv_proj": "colwise:3", "self_attn.o_proj": "rowwise",
                        "mlp.gate_up_proj": "colwise:2", "mlp.down_proj": "rowwise"}),
    # transformers 5 Mixtral: attention split, the stacked experts (MixtralExperts.gate_up_proj /
    # down_proj) split by expert (runtime/expert_tp.py: 2 of the 4 experts per rank, outputs
    # summed over tp), the router replicated on every tp rank
    # a pipeline cut from its torch.export graph keeps the experts as a module call
    # (runtime/expert_calls.py; inlined, they counted tokens with an int32 histc the CPU refuses)
    # tp_sp: the router runs on the sequence shards, its gradient summed over tp
    # (runtime/apply_tp._sum_replicated_grads); the experts gather the shards and reduce-scatter
    # their output (runtime/expert_tp.ExpertShard)
    "hf_mixtral": dict(kinds={"tp": TP, "tp_sp": TP_SP, "pp": PP}, tp={**{k: v for k, v in LLAMA_TP.items() if k.startswith("self_attn.")},
                                            "mlp.experts": "expert"}),
    # per-head q/k RMSNorm inside the split attention: its replicated weight's gradient is summed
    # over the tp ranks (runtime/apply_tp._region_norms)
    # (at the default learning rate AdamW's near-sign updates hide a per-rank gradient: 1e-2 shows it)
    "hf_qwen3": dict(kinds={"tp": TP, "tp_sp": TP_SP}, tp=LLAMA_TP, lr=1e-2),
    # one layer holding the embedding (row-wise, vocabulary-parallel) and the decoder (column-wise,
    # logits gathered): no Linear pair, so neither pairs with the other
    "lstm_lm": dict(kinds={"ddp": DDP, "tp_vocab": TP}, tp_vocab={"model": {"encoder": "rowwise", "decoder": "colwise"}}),
    # the stacked experts split by expert (runtime/expert_tp.py: the zoo's Experts module is
    # called as transformers 5 calls its experts), and the pre/post splits; tp_sp: the block runs
    # on sequence shards (its norm, its router: gradient summed over tp) around the experts
    "moe": dict(kinds={**CORE, "pp": PP, "tp": TP, "tp_sp": TP_SP, "tp_prepost": TP}, tp={"moe.experts": "expert"},
                tp_prepost={"pre": {"embed": "rowwise"}, "post": {"head": "colwise"}}),
    "two_tower": dict(kinds={**CORE, "tp": TP, "tp_prepost": TP},
                      tp={"0": "colwise"}, tp_prepost={"post": {"head.0": "colwise", "head.2": "rowwise"}}),
    "cnn_bn": dict(kinds={**CORE, "pp": PP, "tp_prepost": TP}, tp_prepost={"post": {"fc": "colwise"}}),
    # LoRA: only the adapters train; base weights, embedding, norms and head are frozen.  Each
    # adapter pair is split (lora_A column-wise, lora_B row-wise) beside its replicated frozen
    # base layer; tp_vocab also splits the frozen embedding row-wise (no gradient, no hook:
    # runtime/apply_tp.keep_embedding_grads_sharded) and the frozen head column-wise
    "lora_gpt": dict(kinds={"tp": TP, "tp_vocab": TP},
                     tp={f"{p}.lora_{ab}": s for p in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj",
                                                        "mlp.fc_in", "mlp.fc_out")
                         for ab, s in (("A", "colwise"), ("B", "rowwise"))},
                     tp_vocab={"pre": {"wte": "rowwise"}, "post": {"lm_head": "colwise"}}),
    # the same adapters in MLP-only blocks with the head tied to the frozen embedding, under
    # sequence parallelism: the frozen norms stay frozen under SequenceParallel, the base
    # layers run on the sequence shards and each adapter pair gathers the sequence itself
    "lora_mlp": dict(file="lora_gpt", args={"attention": False, "tied": True},
                     kinds={"tp_sp": TP_SP, "tp_vocab_sp": TP_SP},
                     tp={f"mlp.{p}.lora_{ab}": s for p in ("fc_in", "fc_out") for ab, s in (("A", "colwise"),
                                                                                          ("B", "rowwise"))},
                     tp_vocab_sp={"pre": {"wte": "rowwise"}, "post": {"lm_head": "colwise"}}),
    # {"logits", "aux_loss": 0-d}: the pipeline schedules merge a 0-d output over micro-batches
    "moe_aux": dict(kinds={**CORE, "tp": TP, "pp": PP, "pp_1f1b": PP_1F1B, "pp_interleaved": PP_INTERLEAVED,
                           "pp_zero3": PP_ZERO3},
                    tp={"fc": "colwise", "proj": "rowwise"}),
}

# kinds the runtime refuses for a model: (plan kwargs, a fragment of the refusal, the reason)
REFUSED: dict[str, dict[str, tuple[dict, str, str]]] = {
    "nanogpt": {"pp": (PP, "pipeline", "forward(idx, targets): the last stage needs the targets, an input of "
                                       "the first stage -- the layers do not pass one activation"),
                "tp_head_only": (TP, "splits them differently", "lm_head column-wise with wte not split: one tied "
                                                               "parameter cannot hold two layouts")},
    "two_tower": {"pp": (PP, "pipeline", "two towers: the layers do not pass one activation")},
    # it ran and trained another model (loss 0.014 off the plain loop at step 3) before plan_check refused it
    "mha_dict": {"tp_sp": (TP_SP, "mixes sequence positions", "nn.MultiheadAttention is not split by the tp "
                                                               "styles: on a sequence shard it attends to half "
                                                               "the sequence")},
    "hf_t5": {"pp": (PP, "pipeline", "the decoder blocks take the encoder's output besides their own input: "
                                     "the layers do not pass one activation")},
}

# kinds not run, with the reason
LEFT_OUT = {
    ("nanogpt", "tp of c_attn"): "c_attn's output is split with n_embd and viewed with C read from its input (the "
                                 "whole hidden size): split per part, a rank's share of the heads does not fit the "
                                 "view (the runtime crashes in the forward); the planner's runtime check finds it "
                                 "and keeps c_attn whole (planner/runtime_check._unfuse)",
    ("hf_t5", "tp of attention"): "the relative position bias of block 0 holds every head and is passed on to "
                                  "the next blocks (the runtime crashes in the forward: the planner must not "
                                  "offer it)",
    ("cnn_bn", "tp of the stages"): "convolutions: no column/row split of nn.Linear",
    ("lora_gpt", "sequence parallel"): "the attention (scaled_dot_product_attention) sits outside the adapter "
                                       "pairs, so on sequence shards it would see part of the sequence; the "
                                       "planner's runtime check leaves it out",
    ("hf_*", "tp + pp"): "needs 4 ranks; the runtime refuses it (parallelize_export_stage): stages of a model "
                         "torch.fx cannot trace are cut from its torch.export graph, which calls no nn.Linear",
}


def _file(name: str) -> Path:
    return ZOO / f"{MODELS.get(name, {}).get('file', name)}.py"


def _args(name: str) -> dict:
    return dict(MODELS.get(name, {}).get("args", {}))


@functools.lru_cache(maxsize=None)
def _graph(name: str):
    from capture_memo import captured   # the ranks' plan checks read this capture (tests/capture_memo.py)

    return captured(str(_file(name)), _args(name), MICRO_BATCH)


def _plan(name: str, kind: str, kw: dict, path: Path) -> Path:
    from autopar.core.plan import ModelRef, save_plan, uniform_plan

    g = _graph(name)
    kw = dict(kw)
    spec = MODELS[name]
    if kw.get("tp", 1) > 1:
        block_styles = spec.get("tp", {})
        extra = spec.get(kind, {}) if kind.startswith("tp_") and kind != "tp_sp" else {}
        block_styles = {} if kind in ("tp_head_only", "tp_prepost") else block_styles
        styles = {}
        for i, layer in enumerate(g.layers):
            if layer.name in extra:
                styles[i] = dict(extra[layer.name])
            elif layer.name not in ("pre", "post"):
                by_prefix = [v for p, v in spec.get("tp_by_prefix", {}).items() if layer.name.startswith(p)]
                own = by_prefix[0] if by_prefix and kind != "tp_head_only" else block_styles
                styles[i] = {f"{layer.name}.{k}": v for k, v in own.items()}
        kw["tp_styles_per_layer"] = styles
    ref = ModelRef(file=str(_file(name)), args=_args(name), name=name, fingerprint=g.fingerprint)
    plan = uniform_plan(model=ref, num_layers=len(g.layers), **kw)
    assert plan.global_batch == GLOBAL_BATCH and plan.micro_batch == MICRO_BATCH, kw
    save_plan(plan, path)
    return path


def chunks_for(name: str, kw: dict) -> int:
    """Row blocks the plain loop splits the global batch into: BatchNorm's statistics and the
    router's load-balancing loss are computed over each rank's micro-batch."""
    if name not in ("cnn_bn", "moe_aux"):
        return 1
    return kw.get("dp", 1) * kw.get("num_microbatches", 1)


def run_models(names: list[str], tmp: Path) -> dict[str, dict[str, dict]]:
    """One torchrun for the plans of all ``names`` (one process start and import for all)."""
    cases = []
    for name in names:
        kinds = {**MODELS[name]["kinds"], **{k: v[0] for k, v in REFUSED.get(name, {}).items()}}
        (tmp / name).mkdir(exist_ok=True)
        for kind, kw in kinds.items():
            base = tmp / name / kind
            cases.append({"model": name, "kind": kind, "plan": str(_plan(name, kind, kw, base.with_suffix(".json"))),
                          "measured": f"{base}.measured.json", "result": f"{base}.result.json", "steps": STEPS,
                          **({"lr": MODELS[name]["lr"]} if "lr" in MODELS[name] else {})})
    spec = tmp / "cases.json"
    spec.write_text(json.dumps(cases))
    out = torchrun(2, str(WORKER), str(spec), timeout_s=900)
    results: dict[str, dict] = {name: {"_log": out.stdout + out.stderr, "_rc": out.returncode} for name in names}
    for c in cases:
        if Path(c["result"]).exists():
            results[c["model"]][c["kind"]] = json.loads(Path(c["result"]).read_text())
            if Path(c["measured"]).exists():
                state = json.loads(Path(c["measured"]).read_text()).get("model_state_bytes_per_rank") or []
                results[c["model"]][c["kind"]]["params_bytes"] = [r["params_bytes"] for r in state]
    return results


def run_model(name: str, tmp: Path) -> dict[str, dict]:
    return run_models([name], tmp)[name]


@functools.lru_cache(maxsize=None)
def plain(name: str, chunks: int):
    return plain_loop.train_plain(_file(name), _args(name), GLOBAL_BATCH, STEPS, chunks=chunks,
                                  lr=MODELS[name].get("lr", plain_loop.LR))


@pytest.fixture(scope="module")
def zoo_runs(tmp_path_factory):
    """All the zoo's plans in one launch, run on first use."""
    runs: dict[str, dict] = {}

    def get(name: str) -> dict:
        if not runs:
            pytest.importorskip("transformers")
            runs.update(run_models(list(MODELS), tmp_path_factory.mktemp("zoo")))
        return runs[name]
    return get


CASES = [(m, k) for m, spec in MODELS.items() for k in spec["kinds"]]
REFUSED_CASES = [(m, k) for m, kinds in REFUSED.items() for k in kinds]


@pytest.mark.multiproc
@pytest.mark.parametrize("name,kind", CASES, ids=[f"{m}-{k}" for m, k in CASES])
def test_zoo_kind_matches_plain_loop(zoo_runs, name, kind):
    runs = zoo_runs(name)
    got = runs.get(kind)
    assert got is not None, f"{name} {kind}: no result\n" + failure_summary(runs["_log"])
    assert "losses" in got, f"{name} {kind}: {got}"
    want = plain(name, chunks_for(name, MODELS[name]["kinds"][kind])).losses
    diff = max(abs(a - b) for a, b in zip(got["losses"], want))
    assert len(got["losses"]) == STEPS and diff <= LOSS_ATOL, \
        f"{name} {kind}: losses {got['losses']} vs plain loop {want} (max diff {diff:.3g})"


@pytest.mark.multiproc
def test_hf_mixtral_tp_holds_its_share_of_the_experts(zoo_runs):
    """The tp run holds, per rank, half of each split module's parameters (attention and the
    stacked experts: 2 of 4 experts) and all of the others -- counted on the plain model."""
    got = zoo_runs("hf_mixtral").get("tp") or {}
    want = _mixtral_tp2_param_bytes()
    assert got.get("params_bytes") == [want, want], f"hf_mixtral tp: {got}, want {want} bytes of parameters per rank"


def _mixtral_tp2_param_bytes() -> int:
    """Parameter bytes per rank of tiny Mixtral at tp 2, counted on the plain model: half of
    each module the zoo's tp styles split, all of the others."""
    model = plain_loop.load(ZOO / "hf_mixtral.py").build_model()
    split = tuple(MODELS["hf_mixtral"]["tp"])
    total = 0
    for name, p in model.named_parameters():
        module = name.rpartition(".")[0]
        halves = any(module.endswith(f"layers.{i}.{m}") for m in split for i in range(len(model.model.layers)))
        total += p.numel() * p.element_size() // (2 if halves else 1)
    return total


DP2_TP2_KINDS = {"dp2_tp2": dict(dp=2, tp=2, micro_batch=2), "dp2_tp2_zero3": dict(dp=2, tp=2, micro_batch=2, zero=3)}
DP2_TP2_MODELS = ("hf_mixtral", "hf_gpt2")
INIT_FROM_SEED = 7          # the saved weights' own seed, not the runtime's init seed


@pytest.fixture(scope="module")
def dp2_tp2_runs(tmp_path_factory):
    """(cases, launch output): each of ``DP2_TP2_MODELS`` at dp 2 x tp 2 under DDP and ZeRO-3, all
    four plans trained in one 4-rank torchrun launch (tests/zoo_worker.py)."""
    pytest.importorskip("transformers")
    tmp = tmp_path_factory.mktemp("dp2_tp2")
    cases = []
    for model in DP2_TP2_MODELS:
        for kind, kw in DP2_TP2_KINDS.items():
            base = tmp / f"{model}_{kind}"
            cases.append({"model": model, "kind": kind, "steps": STEPS,
                          "plan": str(_plan(model, "tp", kw, base.with_suffix(".json"))),
                          "measured": f"{base}.measured.json", "result": f"{base}.result.json"})
    # GPT-2 from a save_pretrained folder (--init-from): each rank reads its ZeRO-3 x tp blocks,
    # c_attn's per-part rows of its FSDP2 columns included (runtime/weights_in.py)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(INIT_FROM_SEED)
        plain_loop.load(ZOO / "hf_gpt2.py").build_model().save_pretrained(tmp / "gpt2_weights")
    base = tmp / "hf_gpt2_init_from"
    cases.append({"model": "hf_gpt2_init_from", "kind": "dp2_tp2_zero3", "steps": STEPS,
                  "plan": str(_plan("hf_gpt2", "tp", DP2_TP2_KINDS["dp2_tp2_zero3"], base.with_suffix(".json"))),
                  "measured": f"{base}.measured.json", "result": f"{base}.result.json",
                  "options": {"init_from": str(tmp / "gpt2_weights")}})
    (tmp / "cases.json").write_text(json.dumps(cases))
    return cases, torchrun(4, str(WORKER), str(tmp / "cases.json"), timeout_s=900)


def _dp2_tp2_matches_plain_loop(runs, model: str, tp2_param_bytes: int) -> None:
    """Each of ``model``'s dp 2 x tp 2 runs trained like the plain loop, and every rank holds
    ``tp2_param_bytes`` of parameters (ZeRO-3: half of that, sharded over dp)."""
    cases, out = runs
    want = plain(model, 1).losses
    for c in (c for c in cases if c["model"] == model):
        assert Path(c["result"]).exists(), f"{c['kind']}: no result\n" + failure_summary(out.stdout + out.stderr)
        got = json.loads(Path(c["result"]).read_text())
        assert "losses" in got, f"{c['kind']}: {got}"
        diff = max(abs(a - b) for a, b in zip(got["losses"], want))
        assert diff <= LOSS_ATOL, f"{c['kind']}: losses {got['losses']} vs plain loop {want} (max diff {diff:.3g})"
        state = json.loads(Path(c["measured"]).read_text())["model_state_bytes_per_rank"]
        per_rank = tp2_param_bytes // (2 if "zero3" in c["kind"] else 1)
        assert [r["params_bytes"] for r in state] == [per_rank] * 4, (c["kind"], state, per_rank)


@pytest.mark.multiproc
def test_hf_mixtral_experts_split_on_a_tp_group_off_rank_0(dp2_tp2_runs):
    """dp 2 x tp 2 on 4 ranks: the second tp group is ranks {2, 3}, so the experts' all-reduces
    must address their group, not global ranks; once with DDP and once with ZeRO-3 (FSDP2
    wraps the experts' Shard(0) DTensors).  Both train like the plain loop; each rank holds its
    tp share of the parameters (ZeRO-3: half of that, sharded over dp)."""
    _dp2_tp2_matches_plain_loop(dp2_tp2_runs, "hf_mixtral", _mixtral_tp2_param_bytes())


def _gpt2_tp2_param_bytes() -> int:
    """Parameter bytes per rank of tiny GPT-2 at tp 2, counted on the plain model: half of each
    split weight and of the column-wise c_fc's bias; whole: the row-wise biases (added once
    after the sum), c_attn's bias (replicated, runtime/fused_tp.py) and every unsplit module."""
    model = plain_loop.load(ZOO / "hf_gpt2.py").build_model()
    split = tuple(MODELS["hf_gpt2"]["tp"])
    total = 0
    for name, p in model.named_parameters():
        module, _, leaf = name.rpartition(".")
        halves = any(module.endswith(f"h.{i}.{m}") for m in split for i in range(len(model.transformer.h))) and \
            (leaf == "weight" or module.endswith("mlp.c_fc"))
        total += p.numel() * p.element_size() // (2 if halves else 1)
    return total


@pytest.mark.multiproc
def test_hf_gpt2_tp_splits_attention_and_mlp(zoo_runs):
    """tp and tp_sp hold, per rank, half of c_attn's (per part), c_proj's, c_fc's and the MLP
    c_proj's weights -- the attention is split, not only the MLP."""
    runs = zoo_runs("hf_gpt2")
    want = _gpt2_tp2_param_bytes()
    for kind in ("tp", "tp_sp"):
        got = runs.get(kind) or {}
        assert got.get("params_bytes") == [want, want], f"hf_gpt2 {kind}: {got}, want {want} bytes per rank"


def test_hf_gpt2_tp_parameters_predicted_as_held(tmp_path):
    """The simulator's parameter bytes per rank for the zoo's GPT-2 tp plan are what the run
    holds (``_gpt2_tp2_param_bytes``, which test_hf_gpt2_tp_splits_attention_and_mlp checks
    against the measured bytes): c_attn's replicated bias included."""
    pytest.importorskip("transformers")
    from autopar.core.plan import load_plan
    from autopar.simulator.device.cost_model import CostModel
    from autopar.simulator.evaluator import PlanEvaluator
    from sim_graphs import PROFILE, toy_cluster as _cluster

    plan = load_plan(_plan("hf_gpt2", "tp", TP, tmp_path / "tp.json"))
    memory = PlanEvaluator(_graph("hf_gpt2"), _cluster(), CostModel.from_profile(PROFILE)).evaluate(plan).memory
    assert memory[0].params_bytes == pytest.approx(_gpt2_tp2_param_bytes(), abs=0.5), memory[0]


@pytest.mark.multiproc
def test_hf_gpt2_fused_split_under_dp2_tp2(dp2_tp2_runs):
    """dp 2 x tp 2 on 4 ranks with c_attn split per part: with DDP (FSDP2's replicate, which
    sums the replicated c_attn bias's partial gradients over tp) and with ZeRO-3 (FSDP2 shards
    the strided c_attn weight on its other dim: runtime/fused_tp.fsdp_shard_placement).  Both
    train like the plain loop; each rank holds its tp share (ZeRO-3: half of it)."""
    _dp2_tp2_matches_plain_loop(dp2_tp2_runs, "hf_gpt2", _gpt2_tp2_param_bytes())


@pytest.mark.multiproc
def test_hf_gpt2_init_from_under_dp2_tp2_zero3(dp2_tp2_runs):
    """--init-from a save_pretrained folder at dp 2 x tp 2, ZeRO-3: trains like the plain loop
    started from the folder's values (read here with safetensors)."""
    from safetensors.torch import load_file

    cases, out = dp2_tp2_runs
    c = next(c for c in cases if c["model"] == "hf_gpt2_init_from")
    assert Path(c["result"]).exists(), failure_summary(out.stdout + out.stderr)
    got = json.loads(Path(c["result"]).read_text())
    initial = load_file(Path(c["options"]["init_from"]) / "model.safetensors")
    want = plain_loop.train_plain(ZOO / "hf_gpt2.py", {}, GLOBAL_BATCH, STEPS, initial=initial).losses
    assert "losses" in got, got
    diff = max(abs(a - b) for a, b in zip(got["losses"], want))
    assert len(got["losses"]) == STEPS and diff <= LOSS_ATOL, f"losses {got['losses']} vs plain loop {want}"
    assert "no one-block slice" not in out.stdout     # rank 0 read only its blocks (runtime/parallelize.py's note)


@pytest.mark.multiproc
@pytest.mark.parametrize("name,kind", REFUSED_CASES, ids=[f"{m}-{k}" for m, k in REFUSED_CASES])
def test_zoo_kind_refused_with_reason(zoo_runs, name, kind):
    runs = zoo_runs(name)
    got = runs.get(kind)
    assert got is not None, f"{name} {kind}: no result\n" + failure_summary(runs["_log"])
    _, fragment, _ = REFUSED[name][kind]
    assert "refused" in got and fragment in got["refused"], f"{name} {kind}: {got}"


@pytest.mark.multiproc
def test_batch_norm_under_data_parallelism_warns(zoo_runs):
    log = zoo_runs("cnn_bn")["_log"]
    assert "warning: the model has" in log and "BatchNorm" in log and "per rank" in log, log[-3000:]
    # once per cnn_bn plan (each splits the batch over ranks or micro-batches), for no other model
    assert log.count("BatchNorm module(s)") == len(MODELS["cnn_bn"]["kinds"]), log[-3000:]


def test_plain_loop_uses_the_runtimes_documented_defaults():
    """The plain loop hard-codes the runtime's documented seed rule and AdamW settings (it never
    imports the runtime); this checks that they still agree."""
    from autopar.runtime import options, train

    assert (plain_loop.SEED, plain_loop.LR, plain_loop.BETAS, plain_loop.EPS, plain_loop.WEIGHT_DECAY) == \
        (options.DEFAULT_SEED, options.DEFAULT_LR, options.ADAM_BETAS, options.ADAM_EPS, options.WEIGHT_DECAY)
    assert all(plain_loop.batch_seed(7, s) == train.step_seed(7, s) for s in range(3))
