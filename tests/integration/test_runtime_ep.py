"""Expert parallelism (runtime/apply_ep.py) trains like the plain PyTorch loop.

Every MoE model of the zoo -- ``moe`` (top-2, stacked experts), ``moe_aux`` (Switch top-1 with
its load-balancing loss in a dict output), ``hf_mixtral`` (transformers 5 ``MixtralExperts``)
``deepseek_moe`` (shared expert + an ``nn.ModuleList`` of routed experts) and ``moe_grouped``
(torchtitan's ``GroupedExperts`` called on tokens sorted by expert) -- runs with
``mesh.ep = 2`` under ZeRO-0 (``replicate``), ZeRO-3 and recompute on 2 gloo ranks, and with
FSDP over the ranks left (dp 4, ep 2 and ep 4), with tensor parallelism (dp 2 x tp 2, ep 2) and
with context parallelism (cp 2, ep 2; dp 2 x cp 2, ep 4) on 2-4, with pipeline parallelism
(dp 2 x pp 2, ep 2 -- GPipe, 1F1B with ZeRO-3, interleaved, DualPipeV with its all-to-alls
overlapped; HF Mixtral's stages cut from its torch.export graph) on 4, and resumed from a DCP checkpoint.  Each run's losses and its final parameters (read back
from its DCP checkpoint by DCP's own converter) must match ``plain_loop.train_plain`` -- one process, no autopar runtime, the
same initial weights and batches -- within 1e-5 (``assert_matches_plain``; elements whose gradient
comes near zero at some step are held to steps x lr, see there).
The plans are the zoo's uniform plans with ``mesh.ep`` set, as a user edits a printed plan.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import sys
from pathlib import Path

import pytest
import torch

from runtime_support import (ADAM_EPS, DEFAULT_LR, LOSS_ATOL, PARAM_ATOL, ROOT, consolidated_params, failure_summary,
                             torchrun)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import plain_loop  # noqa: E402

ZOO = ROOT / "tests" / "zoo"
WORKER = Path(__file__).resolve().parents[1] / "runtime_worker.py"
GLOBAL_BATCH = 4
# the kinds that need another: dp x micro_batch x num_microbatches
GLOBAL_BATCHES = {"dp2_pp2_ep2_dualpipev_zero2_full": 8}
STEPS = 3
MODELS = ("moe", "moe_aux", "hf_mixtral", "deepseek_moe", "moe_grouped")

ATTENTION = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
             "self_attn.o_proj": "rowwise"}
DEEPSEEK_TP = {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "rowwise",
               "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise",
               "mlp.shared_experts.gate_proj": "colwise", "mlp.shared_experts.up_proj": "colwise",
               "mlp.shared_experts.down_proj": "rowwise"}
TP_STYLES = {"hf_mixtral": ATTENTION, "deepseek_moe": DEEPSEEK_TP}

# kind -> (uniform_plan arguments, ep); dp x micro_batch x num_microbatches = 4
TWO_RANKS = {"dp2_ep2": (dict(dp=2, micro_batch=2), 2),
             "dp2_ep2_zero1": (dict(dp=2, micro_batch=2, zero=1), 2),
             "dp2_ep2_zero3": (dict(dp=2, micro_batch=2, zero=3), 2),
             "dp2_ep2_recompute": (dict(dp=2, micro_batch=2, zero=2, recompute="full"), 2),
             # two micro-batches per step: an exchange per micro-batch, gradients accumulated
             "dp2_ep2_accumulate": (dict(dp=2, micro_batch=1, num_microbatches=2, zero=2), 2),
             # ep borrowed from the context-parallel ranks: each holds half of every sequence
             "cp2_ep2": (dict(cp=2, micro_batch=4), 2)}
FOUR_RANKS = {"dp4_ep2_zero3": (dict(dp=4, micro_batch=1, zero=3), 2),     # FSDP over the 2 ranks left
              "dp4_ep4": (dict(dp=4, micro_batch=1), 4),                   # one expert per rank, no replica
              "dp2_pp2_ep2_1f1b": (dict(dp=2, pp=2, micro_batch=1, num_microbatches=2, schedule="1f1b"), 2),
              "dp2_tp2_ep2": (dict(dp=2, tp=2, micro_batch=2), 2),
              "dp2_tp2_ep2_zero3": (dict(dp=2, tp=2, micro_batch=2, zero=3), 2),
              # sequence parallelism: the router and the ep-split experts, replicated over tp, read
              # the sequence shards; their gradients are summed over tp (apply_tp._sum_replicated_grads)
              "dp2_tp2_sp_ep2_zero3": (dict(dp=2, tp=2, micro_batch=2, zero=3, sequence_parallel=True), 2),
              # one expert per rank of dp 2 x cp 2, FSDP over nothing left
              "dp2_cp2_ep4_zero3": (dict(dp=2, cp=2, micro_batch=2, zero=3), 4),
              # ep borrowed from the dp ranks of each pipeline stage: ranks 0, 2 (stage 0) and 1, 3
              "dp2_pp2_ep2_gpipe": (dict(dp=2, pp=2, micro_batch=1, num_microbatches=2, schedule="gpipe"), 2),
              "dp2_pp2_ep2_1f1b_zero3": (dict(dp=2, pp=2, micro_batch=1, num_microbatches=2, schedule="1f1b",
                                              zero=3), 2),
              # two stages per rank, each exchanging over the same ep group
              "dp2_pp2_ep2_interleaved": (dict(dp=2, pp=2, micro_batch=1, num_microbatches=2,
                                               schedule="interleaved", virtual_stages=2), 2),
              # DualPipeV (at least a micro-batch per stage: a global batch of 8) with its
              # forward-backward pairs run in turns, each handing over at the all-to-alls in flight
              # (runtime/dualpipe_overlap.py), under FSDP2 and full recompute (the backward reruns
              # its forward's exchanges)
              "dp2_pp2_ep2_dualpipev_zero2_full": (dict(dp=2, pp=2, micro_batch=1, num_microbatches=4,
                                                        schedule="dualpipev", virtual_stages=2, zero=2,
                                                        recompute="full"), 2)}
CASES_2 = ([(m, k) for m in MODELS for k in ("dp2_ep2", "dp2_ep2_zero3", "dp2_ep2_recompute")]
           + [("moe", "dp2_ep2_zero1"), ("moe", "dp2_ep2_accumulate")]
           # cp needs F.scaled_dot_product_attention (core/cp_support.py): the attention models
           + [("hf_mixtral", "cp2_ep2"), ("deepseek_moe", "cp2_ep2")]
           # resumed from a DCP checkpoint: a stacked form (DTensor experts) and a list form (each
           # rank saves only its own experts' entries)
           + [("hf_mixtral", "dp2_ep2_resumed"), ("deepseek_moe", "dp2_ep2_zero3_resumed")])
# model arguments of a case (default: the zoo's): 8 experts, 4 per ep rank
ARGS = {("deepseek_moe", "cp2_ep2"): {"experts": 8},
        # the real-size models the planner plans with ep (tests/planner/test_ep_real_sizes.py),
        # their width and expert count shrunk (the suite's time), their routing kept: the
        # Qwen3-30B-A3B slice (top 8 of many
        # experts -- 16 here, 64 in the model --, 2 query heads per K/V head), DeepSeek-V3 (top 8
        # routed experts -- of 32 here, 256 in the model --, a shared expert, dense first layers)
        # -- at ep 4, and DeepSeek-V3's ep inside pipeline stages
        ("hf_mixtral", "dp4_ep4"): {"layers": 2, "experts": 16, "top_k": 8, "heads": 4, "kv_heads": 2, "ffn": 16},
        ("deepseek_moe", "dp2_pp2_ep2_1f1b"): {"layers": 4, "dense_layers": 2, "experts": 32, "top_k": 8,
                                               "expert_ffn": 8},
        # two layers per stage (the embedding or the head and a block at the ends): every pair's
        # forward and backward exchange tokens
        ("moe", "dp2_pp2_ep2_dualpipev_zero2_full"): {"layers": 6}}
CASES_4 = ([("moe", "dp4_ep2_zero3"), ("moe", "dp4_ep4"), ("moe_aux", "dp4_ep2_zero3"),
            ("deepseek_moe", "dp4_ep4"), ("moe_grouped", "dp4_ep2_zero3"), ("hf_mixtral", "dp2_cp2_ep4_zero3")]
           + [(m, k) for m in ("hf_mixtral", "deepseek_moe") for k in ("dp2_tp2_ep2", "dp2_tp2_ep2_zero3")]
           # with a pipeline: the stacked form cut by torch.fx (moe) and by torch.export (hf_mixtral:
           # its experts stay module calls, runtime/expert_calls.py), the list form (deepseek_moe),
           # and a 0-d router loss in a dict output merged over the micro-batches (moe_aux)
           + [("moe", "dp2_pp2_ep2_gpipe"), ("hf_mixtral", "dp2_pp2_ep2_1f1b_zero3"),
              ("deepseek_moe", "dp2_pp2_ep2_1f1b_zero3"), ("moe_aux", "dp2_pp2_ep2_gpipe"),
              ("moe", "dp2_pp2_ep2_interleaved"), ("moe", "dp2_pp2_ep2_dualpipev_zero2_full")]
           # the real-size models' structure, shrunk (``ARGS``)
           + [("hf_mixtral", "dp4_ep4"), ("deepseek_moe", "dp2_pp2_ep2_1f1b")]
           + [("hf_mixtral", "dp2_tp2_sp_ep2_zero3")])


@functools.lru_cache(maxsize=None)
def _graph(name: str, micro_batch: int, args_json: str = "{}"):
    from capture_memo import captured   # the ranks' plan checks read this capture (tests/capture_memo.py)

    return captured(str(ZOO / f"{name}.py"), json.loads(args_json), micro_batch)


def ep_plan(name: str, kw: dict, ep: int, path: Path, args: dict | None = None,
            global_batch: int = GLOBAL_BATCH) -> Path:
    """The uniform plan of ``kw`` with ``mesh.ep = ep``."""
    from autopar.core.plan import ModelRef, save_plan, uniform_plan

    kw = dict(kw)
    args = dict(args or {})
    g = _graph(name, kw["micro_batch"], json.dumps(args, sort_keys=True))
    if kw.get("tp", 1) > 1:
        modules = {n for n, _ in plain_loop.load(ZOO / f"{name}.py").build_model().named_modules()}
        kw["tp_styles_per_layer"] = {i: {f"{l.name}.{k}": v for k, v in TP_STYLES[name].items()
                                         if f"{l.name}.{k}" in modules}
                                     for i, l in enumerate(g.layers) if l.name not in ("pre", "post")}
    ref = ModelRef(file=str(ZOO / f"{name}.py"), args=args, name=name, fingerprint=g.fingerprint)
    plan = uniform_plan(model=ref, num_layers=len(g.layers), **kw)
    plan = dataclasses.replace(plan, mesh=dataclasses.replace(plan.mesh, ep=ep))
    assert plan.global_batch == global_batch
    save_plan(plan, path)
    return path


def _launch(nproc: int, cases: list[tuple[str, str]], kinds: dict, tmp: Path) -> dict:
    """One torchrun for ``cases``; a kind ending in ``_resumed`` stops after ``STEPS - 1`` steps
    (a DCP checkpoint) and a second run resumes it for the last step."""
    specs = []
    for name, kind in cases:
        kw, ep = kinds[kind.removesuffix("_resumed")]
        base = tmp / f"{name}-{kind}"
        plan = str(ep_plan(name, kw, ep, base.with_suffix(".json"), ARGS.get((name, kind)),
                           GLOBAL_BATCHES.get(kind.removesuffix("_resumed"), GLOBAL_BATCH)))
        if kind.endswith("_resumed"):
            specs.append({"model": name, "kind": kind + "_first", "steps": STEPS - 1, "plan": plan,
                          "measured": f"{base}.first.json", "checkpoint_dir": f"{base}.ckpt",
                          "grad_norms": f"{base}.first.norms.json"})
        # every step's global gradient norm (Trainer.last_grad_norm): each expert counted once
        specs.append({"model": name, "kind": kind, "steps": STEPS, "plan": plan,
                      "measured": f"{base}.measured.json", "checkpoint_dir": f"{base}.ckpt",
                      "grad_norms": f"{base}.norms.json"})
    (tmp / "cases.json").write_text(json.dumps(specs))
    out = torchrun(nproc, str(WORKER), str(tmp / "cases.json"), timeout_s=900)
    return {"_log": out.stdout + out.stderr, "_rc": out.returncode,
            **{(s["model"], s["kind"]): s for s in specs}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The 2-rank cases in one launch and the 4-rank cases in another, each on first use."""
    done: dict[int, dict] = {}

    def get(nproc: int) -> dict:
        if nproc not in done:
            pytest.importorskip("transformers")
            cases, kinds = (CASES_2, TWO_RANKS) if nproc == 2 else (CASES_4, FOUR_RANKS)
            done[nproc] = _launch(nproc, cases, kinds, tmp_path_factory.mktemp(f"ep{nproc}"))
        return done[nproc]
    return get


@functools.lru_cache(maxsize=None)
def plain(name: str, chunks: int, args_json: str = "{}", global_batch: int = GLOBAL_BATCH):
    return plain_loop.train_plain(ZOO / f"{name}.py", json.loads(args_json), global_batch, STEPS, chunks=chunks)


# AdamW's update m / (sqrt(v) + eps) (Kingma & Ba 2015) changes by lr x eps / (|g| + eps)^2 per
# unit of gradient: for an element whose gradient at some step is a near-cancellation of
# O(1e-3) terms down to a few eps (deepseek_moe's blocks.0.mlp.gate_proj has one at -3e-8 on
# step 0), the ~1e-9 that fp32 rounding leaves in such a sum moves its update by ~1e-5 under any
# layout (plain cp 2, no ep: 1.4e-5).  Such elements (0 < |g| < NEAR_ZERO_GRAD at some step) are
# held to steps x lr; at 10 eps the same rounding moves the update by < 2e-6.  Every other
# element -- one whose gradient is exactly zero at a step included (an expert no token chose:
# zero under every layout) -- is held to PARAM_ATOL.
NEAR_ZERO_GRAD = 10 * ADAM_EPS


def assert_matches_plain(measured: Path, ckpt: Path, ref, label: str) -> None:
    m = json.loads(measured.read_text())
    assert len(m["losses"]) == STEPS, (label, m["losses"])
    assert max(abs(a - b) for a, b in zip(m["losses"], ref.losses)) <= LOSS_ATOL, \
        f"{label}: losses {m['losses']} vs plain loop {ref.losses}"
    params = consolidated_params(ckpt)
    assert set(ref.params) <= set(params), (label, sorted(set(ref.params) - set(params)))
    for name, want in ref.params.items():
        got = params[name].float()
        assert got.shape == want.shape, (label, name, got.shape, want.shape)
        diff = (got - want).abs()
        near = ref.grad_abs_min[name] < NEAR_ZERO_GRAD
        err = diff[~near].max().item() if (~near).any() else 0.0
        assert err <= PARAM_ATOL, f"{label}: parameter {name} differs from the plain loop by {err:.3g}"
        if near.any():
            bound = STEPS * DEFAULT_LR * 1.01
            assert diff[near].max().item() <= bound, f"{label}: {name} (near-zero-gradient elements) off by > {bound}"


def _check(got: dict, log: str, name: str, kind: str, dp: int) -> None:
    measured, ckpt = Path(got["measured"]), Path(got["checkpoint_dir"])
    assert measured.exists(), f"{name} {kind}: no result\n" + failure_summary(log)
    # moe_aux's load-balancing loss is computed over each rank's micro-batch, as the plain
    # loop's row blocks (plain_loop chunks) compute it
    chunks = dp * {**TWO_RANKS, **FOUR_RANKS}[kind.removesuffix("_resumed")][0].get("num_microbatches", 1)
    ref = plain(name, chunks if name == "moe_aux" else 1, json.dumps(ARGS.get((name, kind), {}), sort_keys=True),
                GLOBAL_BATCHES.get(kind.removesuffix("_resumed"), GLOBAL_BATCH))
    assert_matches_plain(measured, ckpt, ref, f"{name} {kind}")
    norms = json.loads(Path(got["grad_norms"]).read_text())
    if kind.endswith("_resumed"):
        norms = json.loads(Path(got["grad_norms"].replace(".norms.json", ".first.norms.json")).read_text()) + norms
    assert norms == pytest.approx(ref.grad_norms, rel=1e-5), (name, kind, norms, ref.grad_norms)


@pytest.mark.multiproc
@pytest.mark.parametrize("name,kind", CASES_2, ids=[f"{m}-{k}" for m, k in CASES_2])
def test_ep2_on_two_ranks_matches_plain_loop(runs, name, kind):
    r = runs(2)
    _check(r[(name, kind)], r["_log"], name, kind, TWO_RANKS[kind.removesuffix("_resumed")][0].get("dp", 1))
    if kind.endswith("_resumed"):
        assert "resumed from" in r["_log"], failure_summary(r["_log"])


@pytest.mark.multiproc
@pytest.mark.parametrize("name,kind", CASES_4, ids=[f"{m}-{k}" for m, k in CASES_4])
def test_ep_with_fsdp_and_tp_on_four_ranks_matches_plain_loop(runs, name, kind):
    r = runs(4)
    _check(r[(name, kind)], r["_log"], name, kind, FOUR_RANKS[kind][0]["dp"])


@pytest.mark.multiproc
def test_dualpipev_pairs_hand_over_at_each_all_to_all(runs):
    """The DualPipeV case above ran its pairs in turns (runtime/dualpipe_overlap.py).  The logging
    rank, pp rank 0 (stages 0 and 3: the embedding or the head, and a block), runs 2m - 3p + 1 = 3
    pairs a step (torch's ScheduleDualPipeV; simulator/axes/pp_zero_bubble.dualpipev_pairs), 9 in 3
    steps.  A pair's forward launches 3 exchanges (the counts, the rows, the rows back), its
    backward 5 (the recomputed forward's 3, then the two reverse exchanges); the passes alternate
    at each launch and a hand-over to a finished pass does not count, so a pair hands over
    2 min(3, 5) = 6 times: 54."""
    r = runs(4)
    assert "dualpipev: 9 forward-backward pairs ran in turns, handing over 54 times" in r["_log"], \
        failure_summary(r["_log"])


def _expert_bytes(name: str) -> tuple[int, int]:
    """(all parameter bytes, the routed experts' bytes) of the plain model, by parameter name:
    the zoo names its routed experts ``...experts.*`` (the shared expert is ``shared_experts``)."""
    model = plain_loop.load(ZOO / f"{name}.py").build_model()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in f".{n}")
    return total, experts


@pytest.mark.multiproc
@pytest.mark.parametrize("name", MODELS)
def test_each_rank_holds_half_of_the_experts(runs, name):
    """Under ZeRO-0 (nothing sharded by data parallelism) with ep 2, every rank holds all the
    dense parameters and half of the routed experts' -- counted on the plain model."""
    r = runs(2)
    got = r[(name, "dp2_ep2")]
    assert Path(got["measured"]).exists(), failure_summary(r["_log"])
    state = json.loads(Path(got["measured"]).read_text())["model_state_bytes_per_rank"]
    total, experts = _expert_bytes(name)
    assert experts > 0
    assert [s["params_bytes"] for s in state] == [total - experts // 2] * 2, (state, total, experts)


# ------------------------------------------------------------------ refusals (no process group)
def _refusal(tmp_path, name: str, kw: dict, ep: int, args: dict | None = None) -> str:
    from autopar.core.errors import PlanFileError
    from autopar.core.plan import ModelRef, save_plan, uniform_plan
    from autopar.core.capture import capture_model_file
    from autopar.runtime.plan_check import check_plan

    path = ZOO / f"{name}.py"
    g = capture_model_file(str(path), dict(args or {}), kw["micro_batch"])
    plan = uniform_plan(model=ModelRef(file=str(path), args=dict(args or {}), name=name, fingerprint=g.fingerprint),
                        num_layers=len(g.layers), **kw)
    plan = dataclasses.replace(plan, mesh=dataclasses.replace(plan.mesh, ep=ep))
    save_plan(plan, tmp_path / "plan.json")
    with pytest.raises(PlanFileError) as e:
        check_plan(tmp_path / "plan.json", plan.world_size)
    return str(e.value)


def test_a_model_without_experts_is_refused(tmp_path):
    msg = _refusal(tmp_path, "tied_lm", dict(dp=2, micro_batch=2), 2)
    assert "ep = 2" in msg and "no routed experts" in msg and "Plan with ep = 1" in msg, msg


def test_an_expert_count_ep_does_not_divide_is_refused(tmp_path):
    msg = _refusal(tmp_path, "moe", dict(dp=2, micro_batch=2), 2, args={"experts": 3})
    assert "3 experts" in msg and "ep = 2" in msg, msg


def test_ep_with_a_pipeline_passes_the_plan_check(tmp_path):
    """ep borrows the dp ranks of each pipeline stage (the parity cases above run it)."""
    from autopar.core.capture import capture_model_file
    from autopar.core.plan import ModelRef, save_plan, uniform_plan
    from autopar.runtime.plan_check import check_plan

    path = ZOO / "moe.py"
    g = capture_model_file(str(path), {}, 1)
    plan = uniform_plan(model=ModelRef(file=str(path), args={}, name="moe", fingerprint=g.fingerprint),
                        num_layers=len(g.layers), dp=2, pp=2, ep=2, micro_batch=1, num_microbatches=2,
                        schedule="gpipe")
    save_plan(plan, tmp_path / "plan.json")
    assert check_plan(tmp_path / "plan.json", 4).plan.mesh.ep == 2


# a model whose forward torch.fx cannot trace (a branch on the tokens' rank) with an nn.ModuleList
# of experts that its blocks call one by one on every token (static shapes, so torch.export
# traces it): its pipeline stages are cut from the export graph, which inlines the block's calls
LIST_EXPERTS_UNTRACEABLE = """\
import torch
import torch.nn as nn
import torch.nn.functional as F


class MoE(nn.Module):
    def __init__(self, hidden, experts):
        super().__init__()
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(experts))

    def forward(self, x):
        scores = F.softmax(self.router(x), dim=-1)
        top, chosen = scores.topk(2, dim=-1)
        w = torch.zeros_like(scores).scatter(-1, chosen, top)          # top-2 gates, zero elsewhere
        return x + sum(w[..., i:i + 1] * e(x) for i, e in enumerate(self.experts))


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.blocks = nn.ModuleList(MoE(16, 4) for _ in range(2))
        self.head = nn.Linear(16, 64)

    def forward(self, tokens):
        if tokens.dim() != 2:
            raise ValueError("tokens must be [batch, seq]")
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def build_model():
    return LM()


def make_batch(batch_size):
    t = torch.randint(0, 64, (batch_size, 9))
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def loss_fn(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())
"""


def test_list_experts_in_an_export_cut_stage_are_refused(tmp_path):
    """The runtime (its dry run on fake ranks) refuses ep x pp for list-form experts in a stage
    cut from the torch.export graph with a PlanFileError (exit 2) saying why; the planner's
    runtime check leaves ep x pp out, and ``autopar plan --ep 2 --pp 2`` exits 2 with that reason
    while ep and pp alone are kept."""
    from cli_inprocess import run_cli

    from autopar.core.capture import capture_model_file
    from autopar.core.modelfile import load_model_file
    from autopar.core.plan import ModelRef, uniform_plan
    from autopar.planner.runtime_check import find_executable
    from autopar.runtime.dry_run import dry_run

    path = tmp_path / "list_moe.py"
    path.write_text(LIST_EXPERTS_UNTRACEABLE)
    g = capture_model_file(str(path), {}, 1)
    plan = uniform_plan(model=ModelRef(file=str(path), args={}, name="list_moe", fingerprint=g.fingerprint),
                        num_layers=len(g.layers), dp=2, pp=2, ep=2, micro_batch=1, num_microbatches=2,
                        schedule="gpipe")
    err = dry_run(plan, g, load_model_file(path))
    assert err and err.startswith("PlanFileError") and "blocks.0.experts (list form) as a module" in err \
        and "torch.export" in err, err
    ex = find_executable(capture_model_file(str(path), {}, 2), load_model_file(path))
    assert ex.ep and ex.pipeline and not ex.ep_pipeline, ex.left_out
    cluster = tmp_path / "four-cpu.yaml"
    cluster.write_text((ROOT / "examples" / "clusters" / "local-cpu.yaml").read_text())
    r = run_cli("plan", path, "--cluster", cluster, "--global-batch", "4", "--ep", "2", "--pp", "2",
                "--time-budget", "1", "-o", tmp_path / "plan.json")
    said = " ".join(r.stderr.split())
    assert r.returncode == 2 and "--ep 2 with --pp 2" in said and "list form" in said, r.stderr[-2000:]
    assert not (tmp_path / "plan.json").exists()


def test_export_cut_stages_call_the_experts_modules():
    """HF Mixtral's forward is cut from its torch.export graph (torch.fx cannot trace it): each
    stage calls its layer's experts module -- the model's own, its parameters not read by any op
    of the stage -- so expert parallelism can replace its forward (runtime/expert_calls.py)."""
    pytest.importorskip("transformers")
    from autopar.core.capture import capture_model_file
    from autopar.core.experts import expert_sites
    from autopar.core.modelfile import load_model_file
    from autopar.runtime.apply_pp import split_into_stages
    from autopar.runtime.materialize import build_meta_model

    path = ZOO / "hf_mixtral.py"
    mf, g = load_model_file(path), capture_model_file(str(path), {}, 1)
    meta = build_meta_model(mf, {})
    with torch.device("meta"):
        example, _ = mf.make_batch(1)
    stage_of = [0, 0, 1, 1]
    assert [layer.name for layer in g.layers] == ["pre", "model.layers.0", "model.layers.1", "post"]
    split = split_into_stages(meta, [layer.module_paths for layer in g.layers], stage_of, 2, example_inputs=example)
    assert split.cut_by == "export"
    for i, stage in enumerate(split.stages):
        want = f"model.layers.{i}.mlp.experts"
        assert [n.target for n in stage.graph.nodes if n.op == "call_module"] == [want]
        assert stage.get_submodule(want) is meta.get_submodule(want)
        assert [s.path for s in expert_sites(stage)] == [want]
        read = {str(n.target) for n in stage.graph.nodes if n.op == "get_attr"}
        assert not any(r.startswith(want + ".") for r in read), read


def test_refusal_exits_2_from_the_cli(tmp_path):
    """``autopar run`` of such a plan exits 2 with the reason, before starting any rank."""
    import subprocess

    from runtime_support import worker_env

    _refusal(tmp_path, "moe", dict(dp=2, micro_batch=2), 2, args={"experts": 3})
    out = subprocess.run([sys.executable, "-m", "autopar.cli", "run", str(tmp_path / "plan.json"), "--steps", "1"],
                         capture_output=True, text=True, timeout=300, env=worker_env(), cwd=ROOT)
    said = " ".join(out.stderr.split())       # the CLI wraps its message to the terminal's width
    assert out.returncode == 2 and "do not divide" in said, (out.returncode, out.stderr[-2000:])


# ------------------------------------------------------------------ recognition (meta)
def test_recognises_each_form_of_routed_experts():
    from autopar.core.experts import GROUPED, LIST, STACKED, expert_sites

    def sites(name):
        with torch.device("meta"):
            model = plain_loop.load(ZOO / f"{name}.py").build_model()
        return [(s.path, s.form, s.num_experts, s.router) for s in expert_sites(model)]

    assert sites("moe") == [(f"blocks.{i}.moe.experts", STACKED, 4, f"blocks.{i}.moe.router") for i in range(2)]
    assert sites("moe_aux") == [("moe.experts", STACKED, 4, "moe.router")]
    assert sites("hf_mixtral") == [(f"model.layers.{i}.mlp.experts", STACKED, 4, f"model.layers.{i}.mlp.gate")
                                   for i in range(2)]
    # block 0 is dense; the shared expert is not a routed one
    assert sites("deepseek_moe") == [(f"blocks.{i}.mlp.experts", LIST, 4, f"blocks.{i}.mlp.gate") for i in (1, 2)]
    assert sites("moe_grouped") == [(f"blocks.{i}.moe.experts", GROUPED, 4, f"blocks.{i}.moe.router")
                                    for i in range(2)]
    # a stack of identical blocks is no expert list (no router beside it)
    for dense in ("tied_lm", "hf_llama", "nanogpt"):
        assert sites(dense) == [], dense


def test_recognises_transformers_qwen2_moe_and_deepseek_v3_experts():
    """transformers 5's Qwen2-MoE (shared expert + gate beside the routed experts) and
    DeepSeek-V3 (first layer dense, a top-k router module) stack their routed experts too."""
    pytest.importorskip("transformers")
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

    from autopar.core.experts import STACKED, expert_sites

    with torch.device("meta"):
        qwen = Qwen2MoeForCausalLM(Qwen2MoeConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
            shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            num_experts=4, num_experts_per_tok=2))
        deepseek = DeepseekV3ForCausalLM(DeepseekV3Config(
            vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
            first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
            n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1, q_lora_rank=16, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8))
    assert [(s.path, s.form, s.num_experts, s.router) for s in expert_sites(qwen)] == [
        (f"model.layers.{i}.mlp.experts", STACKED, 4, f"model.layers.{i}.mlp.gate") for i in range(2)]
    assert [(s.path, s.form, s.num_experts, s.router) for s in expert_sites(deepseek)] == [
        ("model.layers.1.mlp.experts", STACKED, 8, "model.layers.1.mlp.gate")]


# ------------------------------------------------------------------ the planner's dry run
def test_runtime_check_applies_ep_on_fake_ranks():
    """planner/runtime_check builds and runs ep = 2 with the runtime's own code on fake ranks:
    kept for the MoE models, not probed for a dense one."""
    from autopar.core.capture import capture_model_file
    from autopar.core.modelfile import load_model_file
    from autopar.planner.runtime_check import find_executable

    for name, experts in (("moe", (4, 4)), ("deepseek_moe", (4, 4)), ("moe_grouped", (4, 4))):
        path = ZOO / f"{name}.py"
        ex = find_executable(capture_model_file(path, {}, 2), load_model_file(path))
        assert ex.ep and ex.experts == experts, (name, ex.left_out)
        # and inside pipeline stages (dp 2 x pp 2 x ep 2)
        assert ex.pipeline and ex.ep_pipeline, (name, ex.left_out)
    path = ZOO / "tied_lm.py"
    ex = find_executable(capture_model_file(path, {}, 2), load_model_file(path))
    assert not ex.ep and not ex.ep_pipeline and ex.experts == () and not any(x.kind == "expert parallel"
                                                                             for x in ex.left_out)


# ------------------------------------------------------------------ plan, edit, run
@pytest.mark.multiproc
def test_autopar_run_of_an_edited_printed_plan_with_ep_trains(tmp_path):
    """``autopar plan`` (dp 2 fixed) prints a plan; setting its ``mesh.ep`` to 2 by hand (the
    JSON a user edits) and ``autopar run`` of it trains the zoo's MoE like the plain loop.  Both
    verbs run in this process (tests/cli_inprocess.run_cli; ``runtime.run_launch.run_plan``, what
    ``autopar run`` calls), the ranks under torchrun."""
    from cli_inprocess import run_cli
    from test_zoo_plan_run import CLUSTER

    from autopar.runtime.run_launch import run_plan

    cluster = tmp_path / "two-cpu.yaml"
    cluster.write_text(CLUSTER)
    printed, edited = tmp_path / "plan.json", tmp_path / "plan_ep.json"
    measured = edited.with_name("measured.json")
    planned = run_cli("plan", ZOO / "moe.py", "--cluster", cluster, "--global-batch", "4", "--dp", "2",
                      "--time-budget", "2", "-o", printed)
    assert planned.returncode == 0, planned.stderr[-3000:]
    plan = json.loads(printed.read_text())
    assert plan["mesh"]["dp"] == 2 and plan["mesh"]["ep"] == 1, plan["mesh"]
    plan["mesh"]["ep"] = 2
    edited.write_text(json.dumps(plan, indent=1))
    with open(tmp_path / "run.log", "w") as log:
        code = run_plan(edited, steps=STEPS, log=log)
    out = (tmp_path / "run.log").read_text()
    assert code == 0, out[-4000:]
    assert "ep=2" in out
    losses = json.loads(measured.read_text())["losses"]
    want = plain("moe", 1).losses
    assert max(abs(a - b) for a, b in zip(losses, want)) <= 1e-5, (losses, want)
