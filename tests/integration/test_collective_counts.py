"""Selective recompute issues no extra tensor- or expert-parallel collective in backward.

Each plan runs twice in one 2-rank torchrun launch (gloo), once with ``recompute: none`` and once
with ``selective``, and ``tests/collective_count_worker.py`` counts the collectives every step
issues, forward and backward apart (a dispatch mode outside the runtime's: it sees the ops that
really run).  The reference is the run without recompute, which never enters
runtime/recompute.py: under tp 2 (with and without sequence parallelism) and under ep 2 the
selective run must issue in backward exactly its collectives -- the forward's all-reduces,
reduce-scatters, all-gathers and all-to-alls are saved, not rerun.  Context parallelism's K/V
all-gather is rerun by design (runtime/recompute.py; simulator/layer_cost.py prices it): the
selective run's backward has exactly one more all-gather per forward one, also beside tp's
sequence-parallel all-gathers (cp 2 x tp 2 on 4 ranks, a second launch).  Each selective run's
losses and final parameters (read back from its DCP checkpoint) equal its no-recompute twin's
(whose parity with the plain loop tests/integration/test_runtime_parity.py, test_runtime_ep.py
and test_runtime_cp.py check) -- under ep 2 for every form of routed experts, which with
FSDP2's nested experts unit needed runtime/recompute.py's profiler-annotation rule to run at all.

How often FSDP2's collectives run in a step, against the counts the simulator prices
(simulator/pipeline_fsdp.py ``collectives_per_step``), in the same 4-rank launch: each plan runs
two steps and the second is counted on rank 0 (the first also runs the pipeline's shape
inference); the count of ``_allgather_base_`` and ``_reduce_scatter_base_`` calls is divided among
rank 0's FSDP units (its layers with parameters).  Under a pipeline torch's schedules skip gradient
sync and reshard-after-backward until the last backward; without one the runtime reduce-scatters
every micro-batch of an accumulation step (runtime/train.py ``_grad_sync``), and that run's losses
must still be the plain loop's.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from collections import Counter
from pathlib import Path

import pytest

from runtime_support import (GPT, MODEL_ARGS, PARAM_ATOL, ROOT, TP_STYLES, consolidated_params, failure_summary,
                             torchrun)

WORKER = Path(__file__).resolve().parents[1] / "collective_count_worker.py"
ZOO = ROOT / "tests" / "zoo"
LLAMA_ARGS = {"layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2, "ffn": 64, "seq": 8, "vocab": 64}
GPT_ARGS = dict(MODEL_ARGS, layers=2)
STEPS = 2
LOSS_ATOL = 1e-5

# name -> (model file, model arguments, uniform_plan arguments, ep); global batch 4
PLANS = {
    "tp2": (GPT, GPT_ARGS, dict(tp=2, micro_batch=4), 1),
    "tp2_sp": (GPT, GPT_ARGS, dict(tp=2, micro_batch=4, sequence_parallel=True), 1),
    # every form of routed experts (core/experts.py): stacked, grouped, list, and transformers 5's
    **{f"ep2_{m}": (ZOO / f"{m}.py", {}, dict(dp=2, micro_batch=2), 2)
       for m in ("moe", "moe_aux", "moe_grouped", "deepseek_moe", "hf_mixtral")},
    "cp2": (ZOO / "hf_llama.py", LLAMA_ARGS, dict(cp=2, micro_batch=4), 1),
}
# 4 ranks: both gathers at once -- tp's sequence-parallel all-gathers (saved) and cp's K/V
# all-gather (rerun), told apart by their process group (runtime/recompute.py ``rerun_groups``);
# and tp's all-reduces beside ep's all-to-alls
PLANS_4 = {"cp2_tp2_sp": (ZOO / "hf_llama.py", LLAMA_ARGS, dict(cp=2, tp=2, micro_batch=4, sequence_parallel=True), 1),
           "dp2_tp2_ep2": (ZOO / "hf_mixtral.py", {}, dict(dp=2, tp=2, micro_batch=2), 2)}
# pipeline FSDP and accumulation: name -> uniform_plan arguments (4 ranks, GPT of MODEL_ARGS)
FSDP_PLANS = {
    "gpipe_zero2_m2": dict(dp=2, pp=2, schedule="gpipe", zero=2, num_microbatches=2),
    "gpipe_zero2_m4": dict(dp=2, pp=2, schedule="gpipe", zero=2, num_microbatches=4),
    "gpipe_zero3_m4": dict(dp=2, pp=2, schedule="gpipe", zero=3, num_microbatches=4),
    "1f1b_zero3_m4": dict(dp=2, pp=2, schedule="1f1b", zero=3, num_microbatches=4),
    "interleaved_zero3_m4": dict(dp=2, pp=2, schedule="interleaved", virtual_stages=2, zero=3, num_microbatches=4),
    "accumulate_zero2_m2": dict(dp=4, zero=2, num_microbatches=2),
    "accumulate_zero3_m2": dict(dp=4, zero=3, num_microbatches=2),
}
GATHER, SCATTER = "c10d._allgather_base_", "c10d._reduce_scatter_base_"
# DDP under bf16 autocast, plain and with --grad-compression bf16: name -> (uniform_plan arguments,
# bytes of a gradient element the all-reduce sends); 2 ranks, GPT of GPT_ARGS, no recompute twin
BYTE_PLANS = {"ddp_bf16_autocast": (dict(dp=2, micro_batch=2, precision="bf16"), 4),
              "ddp_bf16_autocast_bf16_wire": (dict(dp=2, micro_batch=2, precision="bf16", grad_compression="bf16"), 2)}
ALL_REDUCE = "c10d.allreduce_"
ATTENTION_TP = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
                "self_attn.o_proj": "rowwise"}
STYLES = {"gpt": TP_STYLES, "hf_mixtral": ATTENTION_TP,
          "hf_llama": {**ATTENTION_TP, "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
                       "mlp.down_proj": "rowwise"}}


def _plan(path: Path, file: Path, args: dict, kw: dict, ep: int) -> Path:
    from autopar.core.capture import capture_model_file
    from autopar.core.plan import ModelRef, save_plan, uniform_plan

    g = capture_model_file(str(file), dict(args), kw["micro_batch"])
    kw = dict(kw)
    if kw.get("tp", 1) > 1:
        styles = STYLES[file.stem]
        kw["tp_styles_per_layer"] = {i: {f"{layer.name}.{k}": v for k, v in styles.items()}
                                     for i, layer in enumerate(g.layers) if layer.name not in ("pre", "post")}
    plan = uniform_plan(model=ModelRef(str(file), dict(args), file.stem, g.fingerprint), num_layers=len(g.layers),
                        **kw)
    plan = dataclasses.replace(plan, mesh=dataclasses.replace(plan.mesh, ep=ep))
    assert plan.global_batch == 4
    save_plan(plan, path)
    return path


def _launch(tmp: Path, nproc: int, plans: dict, fsdp_plans: dict | None = None,
            byte_plans: dict | None = None) -> dict:
    cases = _fsdp_count_cases(tmp, fsdp_plans or {})
    for name, (kw, _) in (byte_plans or {}).items():
        cases.append({"name": name, "steps": STEPS, "plan": str(_plan(tmp / f"{name}.json", GPT, GPT_ARGS, kw, 1)),
                      "measured": str(tmp / f"{name}.measured.json"), "counts": str(tmp / f"{name}.counts.json")})
    for name, (file, args, kw, ep) in plans.items():
        for mode in ("none", "selective"):
            case = f"{name}_{mode}"
            cases.append({"name": case, "steps": STEPS,
                          "plan": str(_plan(tmp / f"{case}.json", file, args, dict(kw, recompute=mode), ep)),
                          "measured": str(tmp / f"{case}.measured.json"), "counts": str(tmp / f"{case}.counts.json"),
                          "checkpoint_dir": str(tmp / f"{case}.ckpt")})
    (tmp / "cases.json").write_text(json.dumps(cases))
    out = torchrun(nproc, str(WORKER), str(tmp / "cases.json"), timeout_s=420)
    assert out.returncode == 0, failure_summary(out.stdout + out.stderr)
    return {c["name"]: (json.loads(Path(c["counts"]).read_text()), json.loads(Path(c["measured"]).read_text()),
                        Path(c["checkpoint_dir"]) if c.get("checkpoint_dir") else None)
            for c in cases}


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("recompute_collectives"), 2, PLANS, byte_plans=BYTE_PLANS)


@pytest.fixture(scope="module")
def counted_4(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("recompute_collectives_4"), 4, PLANS_4, FSDP_PLANS)


@functools.lru_cache(maxsize=None)
def _gpt_graph():
    """The GPT the FSDP count plans run, captured once (each plan and each test reads it)."""
    from autopar.core.capture import capture_model_file

    return capture_model_file(str(GPT), dict(MODEL_ARGS), 1)


def _fsdp_plan(kw: dict):
    from autopar.core.plan import ModelRef, uniform_plan

    g = _gpt_graph()
    ref = ModelRef(file=str(GPT), args=dict(MODEL_ARGS), name="gpt", fingerprint=g.fingerprint)
    return g, uniform_plan(model=ref, num_layers=len(g.layers), micro_batch=1, precision="fp32", **kw)


def _fsdp_count_cases(tmp: Path, plans: dict) -> list[dict]:
    from autopar.core.plan import save_plan

    cases = []
    for name, kw in plans.items():
        save_plan(_fsdp_plan(kw)[1], tmp / f"{name}.json")
        cases.append({"name": name, "steps": 2, "count_from": 1, "plan": str(tmp / f"{name}.json"),
                      "measured": str(tmp / f"{name}.measured.json"), "counts": str(tmp / f"{name}.counts.json")})
    return cases


def _check_training(counted, name):
    """The selective run's losses and final parameters are its no-recompute twin's."""
    (_, plain, plain_ckpt), (_, selective, selective_ckpt) = counted[f"{name}_none"], counted[f"{name}_selective"]
    assert len(selective["losses"]) == STEPS
    assert max(abs(a - b) for a, b in zip(selective["losses"], plain["losses"])) <= LOSS_ATOL, \
        (name, selective["losses"], plain["losses"])
    want, got = consolidated_params(plain_ckpt), consolidated_params(selective_ckpt)
    assert set(got) == set(want)
    for key, tensor in want.items():
        assert (got[key].float() - tensor.float()).abs().max().item() <= PARAM_ATOL, (name, key)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", [n for n in PLANS if n != "cp2"])
def test_selective_recompute_reissues_no_collective(counted, name):
    (reference, _, _), (selective, _, _) = counted[f"{name}_none"], counted[f"{name}_selective"]
    assert reference["bwd"], reference          # the plan does communicate in backward
    assert selective["fwd"] == reference["fwd"], (name, selective, reference)
    assert selective["bwd"] == reference["bwd"], f"{name}: backward collectives {selective['bwd']} " \
                                                 f"with selective recompute, {reference['bwd']} without"
    _check_training(counted, name)


def _extra_backward(counted, name) -> dict:
    (reference, _, _), (selective, _, _) = counted[f"{name}_none"], counted[f"{name}_selective"]
    assert selective["fwd"] == reference["fwd"], (name, selective, reference)
    extra = Counter(selective["bwd"])
    extra.subtract(reference["bwd"])
    return {k: v for k, v in extra.items() if v}


@pytest.mark.multiproc
def test_selective_recompute_reruns_only_the_cp_kv_gather(counted):
    gathers = counted["cp2_none"][0]["fwd"]["_c10d_functional.all_gather_into_tensor"]
    assert gathers == 2 * STEPS                  # one K/V gather per attention (2 layers) and step
    assert _extra_backward(counted, "cp2") == {"_c10d_functional.all_gather_into_tensor": gathers}
    _check_training(counted, "cp2")


@pytest.mark.multiproc
def test_tp_beside_ep_reissues_no_collective(counted_4):
    assert _extra_backward(counted_4, "dp2_tp2_ep2") == {}
    _check_training(counted_4, "dp2_tp2_ep2")


@pytest.mark.multiproc
def test_cp_with_sequence_parallel_tp_reruns_the_kv_gather_only(counted_4):
    """Of cp 2 x tp 2 (sequence-parallel)'s forward all-gathers, the rerun repeats the K/V ones
    only: one per attention (2 layers) and step, the tp ones saved."""
    reference = counted_4["cp2_tp2_sp_none"][0]
    assert reference["fwd"]["_c10d_functional.all_gather_into_tensor"] > 2 * STEPS    # tp's gathers too
    assert _extra_backward(counted_4, "cp2_tp2_sp") == {"_c10d_functional.all_gather_into_tensor": 2 * STEPS}
    _check_training(counted_4, "cp2_tp2_sp")


def _rank0_units(name: str) -> int:
    """FSDP units on pipeline rank 0: the layers with parameters of its stages."""
    g, plan = _fsdp_plan(FSDP_PLANS[name])
    stages = [s for s in plan.pipeline.stages if s.index % plan.mesh.pp == 0]
    return sum(1 for s in stages for k in range(s.start, s.end) if g.layers[k].param_numel > 0)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(FSDP_PLANS))
def test_fsdp_collectives_per_step_are_the_priced_counts(counted_4, name):
    from autopar.simulator.axes.pp_fsdp import collectives_per_step

    kw = FSDP_PLANS[name]
    counts = counted_4[name][0]
    ran = {op: counts["fwd"].get(op, 0) + counts["bwd"].get(op, 0) for op in (GATHER, SCATTER)}
    units = _rank0_units(name)
    gathers, scatters = collectives_per_step(kw["zero"], kw["num_microbatches"], kw.get("pp", 1) > 1)
    assert (ran[GATHER], ran[SCATTER]) == (units * gathers, units * scatters), (name, units, counts)


@pytest.mark.multiproc
def test_pipeline_zero2_gathers_once_whatever_the_micro_batches(counted_4):
    """The step's ZeRO-2 traffic under a pipeline does not grow with the micro-batches: what the
    price used to charge per micro-batch."""
    two, four = (counted_4[f"gpipe_zero2_m{m}"][0] for m in (2, 4))
    assert two["fwd"].get(GATHER) == four["fwd"].get(GATHER) > 0
    assert two["fwd"].get(SCATTER) == four["fwd"].get(SCATTER) > 0


@pytest.mark.multiproc
@pytest.mark.parametrize("zero", [2, 3])
def test_accumulation_reduce_scattering_each_micro_batch_trains_as_the_plain_loop(counted_4, zero):
    from plain_loop import train_plain

    measured = counted_4[f"accumulate_zero{zero}_m2"][1]
    want = train_plain(GPT, dict(MODEL_ARGS), 8, 2, chunks=2).losses      # dp 4 x 1 sample x 2 micro-batches
    assert len(measured["losses"]) == 2
    assert measured["losses"] == pytest.approx(want, abs=1e-5)


@pytest.mark.multiproc
def test_saved_activations_are_the_priced_ones_with_and_without_sequence_parallelism(counted):
    """What autograd keeps in forward on rank 0 (the worker's ``SavedBytes``: saved tensors once per
    storage, parameters left out) against the simulator's activation bytes summed over the layers,
    for tp 2 without recompute, with and without sequence parallelism.  A column-parallel linear
    keeps its gathered input under sequence parallelism too (core/sharding.propagate): priced as
    sharded, the simulator's saving from sequence parallelism was twice the measured one."""
    from autopar.core.capture import capture_model_file
    from autopar.core.cluster import Cluster, Link, NodeGroup
    from autopar.core.plan import load_plan
    from autopar.simulator.device.cost_model import CostModel
    from autopar.simulator.evaluator import PlanEvaluator

    g = capture_model_file(str(GPT), dict(GPT_ARGS), 4)
    cluster = Cluster("c", (NodeGroup("n", "t", 1, 2, 2**34, Link(1.0, 100.0), 2**36, Link(5.0, 1.0)),),
                      Link(1.0, 100.0))
    cm = CostModel.from_profile(dict(name="t", memory_bandwidth_Bps=1e10, peak_flops={"fp32": 1e11},
                                     efficiency={}, collective_efficiency={}))
    ev = PlanEvaluator(g, cluster, cm)
    measured, priced = {}, {}
    for name in ("tp2_none", "tp2_sp_none"):
        plan = load_plan(counted[name][2].with_name(f"{name}.json"))
        measured[name] = counted[name][0]["saved_bytes"]
        priced[name] = sum(ev.layer_cost(k, lp, plan.mesh, plan.micro_batch, plan.precision).activation_bytes
                           for k, lp in enumerate(plan.layers))
        assert priced[name] == pytest.approx(measured[name], rel=0.03), (name, priced[name], measured[name])
    saving = measured["tp2_none"] - measured["tp2_sp_none"]
    assert saving > 0
    assert priced["tp2_none"] - priced["tp2_sp_none"] == pytest.approx(saving, rel=0.02)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(BYTE_PLANS))
def test_ddp_all_reduce_sends_the_priced_bytes(counted, tmp_path, name):
    """What DDP's gradient all-reduce hands gloo each step under bf16 autocast -- counted on rank 0
    from the tensors of every ``c10d.allreduce_`` in backward (DDP's buckets, or the compress
    hook's bf16 copies) -- is G x 4 bytes, the fp32 gradients of autocast's fp32 parameters, or
    G x 2 under --grad-compression bf16, G the model's elements counted from torch; and the
    simulator's wire bytes for the plan are the ring's 2 (n - 1) / n of it (n = 2)."""
    from plain_loop import load
    from sim_graphs import priced_dp_wire_bytes

    from autopar.core.capture import capture_model_file
    from autopar.core.plan import load_plan

    kw, element_bytes = BYTE_PLANS[name]
    counts, _, _ = counted[name]
    sent = counts["bytes"]["bwd"][ALL_REDUCE] / STEPS
    G = sum(p.numel() for p in load(GPT).build_model(**GPT_ARGS).parameters() if p.requires_grad)
    assert sent == G * element_bytes, (name, sent, G)
    plan = load_plan(_plan(tmp_path / f"{name}.json", GPT, GPT_ARGS, kw, 1))       # the plan the launch ran
    g = capture_model_file(str(GPT), dict(GPT_ARGS), kw["micro_batch"])
    assert priced_dp_wire_bytes(g, plan) == pytest.approx(2 * (2 - 1) / 2 * sent, rel=1e-12)
