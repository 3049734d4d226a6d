"""Resume under another layout (issue 32): a checkpoint saved under one plan kind resumes under
any other -- pipeline, ZeRO-3, tensor parallelism, DDP, more or fewer ranks -- and the run goes
on as one uninterrupted run would.

The model is ``tests/zoo/tied_lm.py``: its LM head is tied to the token embedding, so a
pipeline holds the tie as two copies (embedding on the first stage, head on the last) while
every other layout holds one parameter under two names.  Each chain trains a few steps under
one plan, saves, and the next plan resumes the same folder:

* pp2 (GPipe) -> ZeRO-3 (dp2) -> tp2 with the vocabulary split (embedding row-wise, head
  column-wise), 2 steps each;
* ZeRO-3 -> pp2 interleaved (4 stages) -> ZeRO-1 (``ZeroRedundancyOptimizer``: each rank
  saves and loads its partition's entries) -> DDP, the other way round;
* 2 ranks -> 4 ranks: DDP on 2 ranks, then dp2 x pp2 on 4; and 4 -> 2: dp2 x pp2 on 4 ranks,
  then ZeRO-3 on 2;
* ``tests/zoo/hf_qwen2.py`` (``tie_word_embeddings``; its pipeline stages are cut from the
  ``torch.export`` graph): pp2 -> ZeRO-3;
* the NVMe tier (AdamW's moments, and the sharded parameters and gradients, in files under
  ``--nvme-path``, runtime/nvme_tier.py): ZeRO-3 offload nvme+params+grads -> DDP -> ZeRO-2
  offload nvme+params (the checkpoint holds the states' values, and a load puts them back into
  the files);
* ``tests/zoo/hf_gpt2.py`` with attention and MLP split, the fused q/k/v ``c_attn`` per part
  (runtime/fused_tp.py): tp2 -> ZeRO-3 -> pp2 -> tp2.
* PowerSGD (``powersgd:2``, torch's hook on DDP, compressing from the third step on): its hook
  state -- error feedback, warm-start Q, step count, generator -- is saved per rank with the
  checkpoint (runtime/powersgd_state.py), so a run interrupted after 3 steps and resumed for 2
  more equals the same run made in one go (within 1e-5, losses and parameters; the resumed
  run's first step sees DDP's first bucket order, not the rebuilt one that saved).  A third leg
  under ZeRO-1 (another layout) restarts the state and says so in one line.

The reference is ``plain_loop.train_plain`` -- one process, never entering autopar's
runtime -- trained for the same total number of steps: every chain's losses (the resumed ones
from the checkpoints' manifests, then its own) and its final parameters (read back from the
last checkpoint by DCP's own converter) must match it within 1e-5.  The checkpoint must hold
the tied parameter once, under its canonical name (what lets every layout read it).

* ``autopar replan`` then resume, 4 -> 2 ranks and 2 -> 4 on the zoo's nanoGPT
  (``tests/zoo/nanogpt.py``, tied ``lm_head``) and on Hugging Face's Llama
  (``tests/zoo/hf_llama.py``): the first leg runs a hand-made plan, the second the plan
  ``autopar replan --cluster`` wrote for a cluster of 2 (or 4) devices, resumed from the first
  leg's checkpoint.  Llama's 4 -> 2 re-plan is a pipeline cut from ``torch.export``; its 2 -> 4
  goes on from there (a copy of that 2-rank checkpoint, 4 -> 2 -> 4), re-planned for one node
  of 4 devices (dp 4).

Three launches: the 4-rank one first (it writes the 4 -> 2 checkpoints), then one 2-rank launch
for all 2-rank cases, in order (it writes the 2 -> 4 checkpoints, which a second 4-rank launch
resumes).
"""
from __future__ import annotations

import functools
import json
import shutil
import sys
from pathlib import Path

import pytest

from runtime_support import ROOT, assert_matches_reference, failure_summary, torchrun

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import plain_loop  # noqa: E402

ZOO = ROOT / "tests" / "zoo"
WORKER = Path(__file__).resolve().parents[1] / "runtime_worker.py"
TIED = ZOO / "tied_lm.py"
GLOBAL_BATCH = 4
LEG = 2                                   # steps per plan of a chain
TIMEOUT_S = 600

PP2 = dict(pp=2, micro_batch=2, num_microbatches=2, schedule="gpipe")
PP2_INTERLEAVED = dict(pp=2, micro_batch=2, num_microbatches=2, schedule="interleaved", virtual_stages=2)
ZERO3 = dict(dp=2, micro_batch=2, zero=3)
DDP = dict(dp=2, micro_batch=2)
ZERO1 = dict(dp=2, micro_batch=2, zero=1)
TP2_VOCAB = dict(tp=2, micro_batch=2, num_microbatches=2)
DP2_PP2 = dict(dp=2, pp=2, micro_batch=1, num_microbatches=2, schedule="gpipe")
TP_STYLES = {"pre": {"embed": "rowwise"}, "post": {"head": "colwise"}}
BLOCK_TP = {"fc": "colwise", "proj": "rowwise"}

# a chain's further run options: pp2 -> ZeRO-3 -> tp2 clips the gradient norm (this model's is
# ~9.5: the clip bites), so the norm counts the tied parameter once -- two copies under pp, one
# parameter under two names elsewhere -- and each leg's norms are checked against the plain loop
CHAIN_OPTIONS = {"pp2_zero3_tp2": {"grad_clip": 5.0}}
# chain name -> the plans it runs, in order, each for LEG steps on the same folder
CHAINS = {
    "pp2_zero3_tp2": [("pp2", PP2), ("zero3", ZERO3), ("tp2_vocab", TP2_VOCAB)],
    "zero3_ppi_zero1_ddp": [("zero3", ZERO3), ("pp2_interleaved", PP2_INTERLEAVED), ("zero1", ZERO1), ("ddp", DDP)],
    "nvme_ddp_nvme": [("zero3_nvme", dict(ZERO3, offload="nvme+params+grads")), ("ddp", DDP),
                      ("zero2_nvme", dict(ZERO3, zero=2, offload="nvme+params"))],
}
# a Hugging Face model with tie_word_embeddings: its pipeline stages are cut from the
# torch.export graph (each stage holds the tied tensor under one of its names)
HF_TIED = ZOO / "hf_qwen2.py"
HF_CHAIN = [("pp2", PP2), ("zero3", ZERO3)]
# GPT-2 (tied head) with its fused q/k/v c_attn split per part under tp (runtime/fused_tp.py):
# the checkpoint holds c_attn in the model's own row order, so tp2 -> ZeRO-3 -> pp2 -> tp2 resumes
GPT2 = ZOO / "hf_gpt2.py"
TP2 = dict(tp=2, micro_batch=2, num_microbatches=2)
GPT2_CHAIN = [("tp2", TP2), ("zero3", ZERO3), ("pp2", PP2), ("tp2", TP2)]
# per model: (block styles relative to the block, styles of the pre/post layers)
MODEL_TP = {GPT2: ({"attn.c_attn": "colwise:3", "attn.c_proj": "rowwise", "mlp.c_fc": "colwise",
                    "mlp.c_proj": "rowwise"}, {})}


def _has_transformers() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformers") is not None


# autopar replan then resume (4 -> 2 and 2 -> 4): first legs by hand, second legs planned by
# 'autopar replan --cluster' for 2 or 4 local CPU devices (one node of 2, two nodes of 2)
REPLAN_MODELS = {"nanogpt": ZOO / "nanogpt.py", "hf_llama": ZOO / "hf_llama.py"}
REPLAN_DIRECTIONS = {"nanogpt": ("4to2", "2to4"), "hf_llama": ("4to2", "2to4")}
# the cluster of each model's 2 -> 4 re-plan: (nodes, devices per node).  Llama's is one node of
# 4: there the planner picks dp 4, where on two nodes of 2 it picks a 4-stage pipeline cut from
# torch.export, which would make the 4-rank launch half a minute longer
REPLAN_UP_CLUSTER = {"nanogpt": (2, 2), "hf_llama": (1, 4)}
# models whose 2 -> 4 chain goes on from their 4 -> 2 chain's 2-rank checkpoint (a copy, made once
# the 2-rank launch wrote it) instead of a 2-rank first leg of its own: 4 -> 2 -> 4
REPLAN_UP_FROM_DOWN = {"hf_llama"}
REPLAN_CLUSTER = """\
name: cpu-nodes
backend: gloo
inter_node: {bandwidth_GBps: 1.4, latency_us: 750}
groups:
  - name: cpu
    gpu: local-cpu
    nodes: NODES
    gpus_per_node: DEVICES
    host_memory_GB: 8
"""
FOUR_ZERO3 = dict(dp=4, micro_batch=1, zero=3)
# PowerSGD: (kind, plan, steps) -- 5 steps in one go into their own folder, then 3 + 2 on another
# folder (the hook compresses from the third step on, so the checkpoint of step 3 holds its error
# feedback and Q), then 1 more under ZeRO-1 (another layout: the state restarts)
POWERSGD = dict(DDP, grad_compression="powersgd:2")
POWERSGD_LEGS = [("whole", POWERSGD, 5), ("ddp", POWERSGD, 3), ("ddp", POWERSGD, 5),
                 ("zero1", dict(ZERO1, grad_compression="powersgd:2"), 6)]


def _replanned(plan: Path, nodes: int, out: Path, devices: int = 2) -> Path:
    """``autopar replan PLAN --cluster`` (a cluster of ``nodes`` nodes of ``devices`` CPU devices)."""
    from cli_inprocess import run_cli

    cluster = out.with_suffix(".cluster.yaml")
    cluster.write_text(REPLAN_CLUSTER.replace("NODES", str(nodes)).replace("DEVICES", str(devices)))
    got = run_cli("replan", plan, "--cluster", cluster, "--time-budget", 1, "-o", out)
    assert got.returncode == 0, got.stdout[-2000:] + got.stderr
    assert "global batch: 4 samples per step, kept" in got.stdout, got.stdout
    return out


def _replan_cases(tmp: Path) -> tuple[list[dict], list[dict], list[dict], dict, list[tuple[Path, Path]]]:
    """(4-rank first legs, 2-rank cases, 4-rank second legs, runs by name, checkpoint folders to
    copy once the 2-rank launch ran) of the replan chains."""
    first4, two, second4, runs, copies = [], [], [], {}, []
    for name, model in REPLAN_MODELS.items():
        if name.startswith("hf_") and not _has_transformers():
            continue
        if "4to2" in REPLAN_DIRECTIONS[name]:
            down = _case(tmp, f"{name}.four", FOUR_ZERO3, tmp / f"{name}_4to2.ckpt", LEG, model=model)
            down_b = dict(down, name=f"{name}.four_to_two", steps=2 * LEG,
                          measured=str(tmp / f"{name}.42.measured.json"),
                          plan=str(_replanned(Path(down["plan"]), 1, tmp / f"{name}.replan2.json")))
            first4.append(down)
            two.append(down_b)
            runs[f"replan_{name}_4to2"] = {"cases": [down, down_b], "steps": 2 * LEG, "model": model,
                                           "replanned": True}
        if "2to4" in REPLAN_DIRECTIONS[name]:
            if name in REPLAN_UP_FROM_DOWN:                  # 4 -> 2 -> 4: the 2-rank leg is down_b
                up = down_b
                copies.append((Path(down_b["checkpoint_dir"]), tmp / f"{name}_2to4.ckpt"))
            else:
                up = _case(tmp, f"{name}.two", ZERO3, tmp / f"{name}_2to4.ckpt", LEG, model=model)
                two.append(up)
            nodes, devices = REPLAN_UP_CLUSTER[name]
            up_b = dict(up, name=f"{name}.two_to_four", steps=up["steps"] + LEG, checkpoint_dir=str(tmp / f"{name}_2to4.ckpt"),
                        measured=str(tmp / f"{name}.24.measured.json"),
                        plan=str(_replanned(Path(up["plan"]), nodes, tmp / f"{name}.replan4.json", devices)))
            second4.append(up_b)
            runs[f"replan_{name}_2to4"] = {"cases": [up, up_b], "steps": up_b["steps"], "model": model,
                                           "replanned": True}
    return first4, two, second4, runs, copies


@functools.lru_cache(maxsize=None)
def _graph(model: Path, micro_batch: int):
    from capture_memo import captured   # the ranks' plan checks read this capture (tests/capture_memo.py)

    return captured(str(model), {}, micro_batch)


def plan_for(model: Path, kw: dict, path: Path) -> Path:
    """A uniform plan; with tp, the blocks' MLPs split Megatron-style and the tied embedding /
    head vocabulary-parallel."""
    from autopar.core.plan import ModelRef, save_plan, uniform_plan

    g = _graph(model, kw["micro_batch"])
    kw = dict(kw)
    if kw.get("tp", 1) > 1:
        block, edges = MODEL_TP.get(model, (BLOCK_TP, TP_STYLES))
        kw["tp_styles_per_layer"] = {
            i: dict(edges.get(l.name, {})) if l.name in ("pre", "post") else {f"{l.name}.{k}": v for k, v in block.items()}
            for i, l in enumerate(g.layers)}
    ref = ModelRef(file=str(model), args={}, name=model.stem, fingerprint=g.fingerprint)
    plan = uniform_plan(model=ref, num_layers=len(g.layers), **kw)
    assert plan.global_batch == GLOBAL_BATCH, kw
    save_plan(plan, path)
    return path


def _case(tmp: Path, label: str, kw: dict, ckpt: Path, steps: int, model: Path = TIED, options=None) -> dict:
    out = {"name": label, "plan": str(plan_for(model, kw, tmp / f"{label}.json")), "steps": steps,
           "checkpoint_dir": str(ckpt), "measured": str(tmp / f"{label}.measured.json")}
    if options:
        out.update(options=options, grad_norms=str(tmp / f"{label}.norms.json"))
    return out


def _launch(nproc: int, cases: list[dict], tmp: Path, name: str) -> str:
    """Run ``cases`` in one launch; returns its output."""
    spec = tmp / f"{name}.cases.json"
    spec.write_text(json.dumps(cases))
    out = torchrun(nproc, str(WORKER), str(spec), timeout_s=TIMEOUT_S)
    assert out.returncode == 0, failure_summary(out.stdout + out.stderr)
    return out.stdout + out.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    out: dict[str, dict] = {}
    # 4 ranks first: dp2 x pp2 writes the checkpoint that 2 ranks resume
    four = _case(tmp, "four_dp2pp2", DP2_PP2, tmp / "four_to_two.ckpt", LEG)
    replan_first4, replan_two, replan_second4, replan_runs, replan_copies = _replan_cases(tmp)
    out.update(replan_runs)
    _launch(4, [four, *replan_first4], tmp, "four")
    cases = []
    for chain, legs in CHAINS.items():
        for i, (kind, kw) in enumerate(legs):
            nvme = {"nvme_path": str(tmp)} if kw.get("offload", "").startswith("nvme") else None
            cases.append(_case(tmp, f"{chain}.{i}.{kind}", kw, tmp / f"{chain}.ckpt", LEG * (i + 1),
                               options=CHAIN_OPTIONS.get(chain) or nvme))
        out[chain] = {"cases": cases[-len(legs):], "steps": LEG * len(legs)}
    if _has_transformers():
        for i, (kind, kw) in enumerate(HF_CHAIN):
            cases.append(_case(tmp, f"hf_qwen2.{i}.{kind}", kw, tmp / "hf_qwen2.ckpt", LEG * (i + 1), model=HF_TIED))
        out["hf_qwen2_pp2_zero3"] = {"cases": cases[-len(HF_CHAIN):], "steps": LEG * len(HF_CHAIN), "model": HF_TIED}
        for i, (kind, kw) in enumerate(GPT2_CHAIN):
            cases.append(_case(tmp, f"hf_gpt2.{i}.{kind}", kw, tmp / "hf_gpt2.ckpt", LEG * (i + 1), model=GPT2))
        out["hf_gpt2_tp2_zero3_pp2_tp2"] = {"cases": cases[-len(GPT2_CHAIN):], "steps": LEG * len(GPT2_CHAIN),
                                        "model": GPT2}
    cases.append(_case(tmp, "four_to_two.zero3", ZERO3, tmp / "four_to_two.ckpt", 2 * LEG))
    out["four_to_two"] = {"cases": [four, cases[-1]], "steps": 2 * LEG}
    cases.append(_case(tmp, "two_to_four.ddp", DDP, tmp / "two_to_four.ckpt", LEG))
    powersgd = [_case(tmp, f"powersgd.{i}.{kind}", kw, tmp / f"powersgd{'_whole' if kind == 'whole' else ''}.ckpt",
                      steps) for i, (kind, kw, steps) in enumerate(POWERSGD_LEGS)]
    out["powersgd"] = {"cases": powersgd, "log": _launch(2, cases + powersgd + replan_two, tmp, "two")}
    for src, dst in replan_copies:
        shutil.copytree(src, dst)
    back = _case(tmp, "two_to_four.dp2pp2", DP2_PP2, tmp / "two_to_four.ckpt", 2 * LEG)
    _launch(4, [back, *replan_second4], tmp, "four_again")
    out["two_to_four"] = {"cases": [cases[-1], back], "steps": 2 * LEG}
    return out


@pytest.mark.multiproc
def test_powersgd_resumed_equals_an_uninterrupted_powersgd_run(runs):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    import torch

    whole, first, second, zero1 = runs["powersgd"]["cases"]
    log = runs["powersgd"]["log"]
    m_whole, m_second = (json.loads(Path(c["measured"]).read_text()) for c in (whole, second))
    assert m_second["first_step"] == first["steps"] and len(m_second["losses"]) == len(m_whole["losses"]) == 5
    assert m_second["losses"] == pytest.approx(m_whole["losses"], abs=1e-5), (m_second["losses"], m_whole["losses"])

    def params(folder: Path) -> dict:
        dcp_to_torch_save(folder, folder.with_suffix(".pt"))
        return torch.load(folder.with_suffix(".pt"), weights_only=False)["model"]

    last = f"step_{second['steps']:08d}"        # (the ZeRO-1 leg saved a later one into the same folder)
    want, got = params(Path(whole["checkpoint_dir"]) / last), params(Path(second["checkpoint_dir"]) / last)
    assert set(got) == set(want)
    for k in want:
        assert (got[k].float() - want[k].float()).abs().max().item() <= 1e-5, k
    # the state is each rank's, beside DCP's files, listed in the manifest with its checksum
    manifest = json.loads((Path(second["checkpoint_dir"]) / last / "manifest.json").read_text())
    assert {"powersgd_rank0.pt", "powersgd_rank1.pt"} <= set(manifest["files"]) and manifest["powersgd"] == "powersgd:2"
    assert log.count("powersgd:2: error feedback, warm-start Q and step count restored") == 1, log[-3000:]
    # under ZeRO-1 the layout differs: one line says the state restarts, and the run resumed
    assert json.loads(Path(zero1["measured"]).read_text())["first_step"] == second["steps"]
    restarts = [line for line in log.splitlines() if "its state restarts" in line]
    assert len(restarts) == 1 and "zero 0" in restarts[0] and "zero 1" in restarts[0], restarts


@functools.lru_cache(maxsize=None)
def plain(steps: int, model: Path = TIED, grad_clip: float | None = None):
    return plain_loop.train_plain(model, {}, GLOBAL_BATCH, steps, grad_clip=grad_clip)


def tie_aliases(model) -> dict[str, str]:
    """Every name of a parameter -> the first name ``named_parameters`` gives it (read off the
    plain loop's model)."""
    first: dict[int, str] = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out[name] = first.setdefault(id(p), name)
    return out


def _saved_keys(checkpoint_dir: Path) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    latest = json.loads((checkpoint_dir / "latest.json").read_text())
    return set(FileSystemReader(str(checkpoint_dir / latest["path"])).read_metadata().state_dict_metadata)


@pytest.mark.multiproc
@pytest.mark.parametrize("chain", [*CHAINS, "four_to_two", "two_to_four", "hf_qwen2_pp2_zero3",
                                   "hf_gpt2_tp2_zero3_pp2_tp2",
                                   *(f"replan_{m}_{d}" for m, ds in REPLAN_DIRECTIONS.items() for d in ds)])
def test_resume_under_another_layout_matches_an_uninterrupted_run(runs, chain):
    if chain not in runs:
        pytest.skip("transformers is not installed")
    got = runs[chain]
    ref = plain(got["steps"], got.get("model", TIED), CHAIN_OPTIONS.get(chain, {}).get("grad_clip"))
    last = got["cases"][-1]
    ckpt = Path(last["checkpoint_dir"])
    for i, case in enumerate(got["cases"][1:], start=1):    # each later plan resumed, it did not start afresh
        m = json.loads(Path(case["measured"]).read_text())
        assert m["first_step"] == got["cases"][i - 1]["steps"], (case["name"], m["first_step"])
    keys, aliases = _saved_keys(ckpt), tie_aliases(ref.model)
    if got.get("replanned"):                   # autopar replan's plan, on the other rank count, resumed
        m = json.loads(Path(last["measured"]).read_text())
        assert m["world_size"] == {4: 2, 2: 4}[json.loads(Path(got["cases"][0]["measured"]).read_text())
                                               ["world_size"]], (chain, m["world_size"])
        assert_matches_reference(Path(last["measured"]), ckpt, ref, chain, steps=got["steps"], aliases=aliases)
        return
    tied = {name for name, first in aliases.items() if name != first}
    assert tied, "the model has no tie"
    for name in tied:           # the tie is saved once, under its first name, weights and optimizer state
        assert f"model.{aliases[name]}" in keys and f"model.{name}" not in keys, sorted(keys)
        assert f"optim.state.{aliases[name]}.exp_avg" in keys, sorted(keys)
        assert not [k for k in keys if k.startswith("optim.") and f".{name}." in k], sorted(keys)
    assert_matches_reference(Path(last["measured"]), ckpt, ref, chain, steps=got["steps"], aliases=aliases)
    if chain in CHAIN_OPTIONS:                 # every leg's norms before clipping
        norms = [x for case in got["cases"] for x in json.loads(Path(case["grad_norms"]).read_text())]
        assert min(ref.grad_norms) > CHAIN_OPTIONS[chain]["grad_clip"]
        assert norms == pytest.approx(ref.grad_norms, rel=1e-5), (norms, ref.grad_norms)


# ------------------------------------------------------------------ one process: the keys themselves

def _tied_model_and_optimizer(seed: int):
    import torch

    torch.manual_seed(seed)
    model = plain_loop.load(TIED).build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs, target = plain_loop.draw_batch(plain_loop.load(TIED), GLOBAL_BATCH, {}, seed, 0)
    plain_loop.load(TIED).loss_fn(model(*inputs), target).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)            # as the runtime leaves it between steps
    return model, opt


def _stage_parts(model):
    """The tied model as two pipeline stages on one rank, the head holding its own copy."""
    import torch
    import torch.nn as nn

    first, last = nn.Module(), nn.Module()
    first.embed = model.embed
    last.head = nn.Linear(model.head.in_features, model.head.out_features, bias=False)
    with torch.no_grad():
        last.head.weight.zero_()
    return [first, last], [torch.optim.AdamW(p.parameters(), lr=1e-3) for p in (first, last)]


def test_state_names_key_a_tie_once_under_its_canonical_name():
    from autopar.runtime.state_names import MODEL, OPTIM, StateNames, canonical_states

    ties = [("embed.weight", "head.weight")]
    whole = StateNames.build(ties, [], [0])
    merged, keys = canonical_states(whole, MODEL, [{"embed.weight": 1, "head.weight": 1, "norm.bias": 2}], for_save=True)
    assert merged == {"embed.weight": 1, "norm.bias": 2} and keys[0]["head.weight"] == "embed.weight"
    assert whole.canonical_key(OPTIM, "state.head.weight.exp_avg") == ("state.embed.weight.exp_avg", "embed.weight")
    assert whole.canonical_key(OPTIM, "param_groups.head.weight.lr") == ("param_groups.embed.weight.lr",
                                                                          "embed.weight")
    # pipeline: the last stage's copy is saved by the first stage only, and loaded by both
    staged = StateNames.build(ties, [(ties[0], [0, 3])], [3])
    states = [{"head.weight": "copy", "norm.weight": 5}]
    assert canonical_states(staged, MODEL, states, for_save=True)[0] == {"norm.weight": 5}
    assert canonical_states(staged, MODEL, states, for_save=False)[0] == {"embed.weight": "copy", "norm.weight": 5}


def test_whole_model_checkpoint_loads_into_stages_holding_tied_copies(one_rank, tmp_path):
    import torch

    from autopar.runtime import checkpointing
    from autopar.runtime.state_names import StateNames
    from autopar.runtime.ties import find_ties

    model, opt = _tied_model_and_optimizer(seed=3)
    ties = find_ties(model)
    identity = checkpointing.CheckpointIdentity(fingerprint="x", world_size=1, mesh={}, zero=0)
    checkpointing.save_checkpoint(tmp_path / "ckpt", 1, [model], [opt], identity, [0.0],
                                  names=StateNames.build(ties, [], [0]))
    keys = _saved_keys(tmp_path / "ckpt")
    assert "model.embed.weight" in keys and "model.head.weight" not in keys
    assert "optim.state.embed.weight.exp_avg" in keys and "optim.state.head.weight.exp_avg" not in keys

    fresh, _ = _tied_model_and_optimizer(seed=4)
    parts, opts = _stage_parts(fresh)
    names = StateNames.build(ties, [(ties[0], [0, 1])], [0, 1])
    checkpointing.resume(tmp_path / "ckpt", parts, opts, identity, steps=2, names=names)
    assert torch.equal(parts[0].embed.weight, model.embed.weight)
    assert torch.equal(parts[1].head.weight, model.embed.weight)
    want = opt.state[model.embed.weight]["exp_avg_sq"]
    for part, o in zip(parts, opts):
        (p,) = list(part.parameters())
        assert torch.equal(o.state[p]["exp_avg_sq"], want)


def test_checkpoint_lacking_an_entry_is_refused_with_one_message(one_rank, tmp_path):
    """What DCP cannot give a layout (an entry the saving layout never wrote) is a
    CheckpointError (exit 2) naming the folder, not DCP's traceback."""
    from autopar.runtime import checkpointing

    model, opt = _tied_model_and_optimizer(seed=3)
    parts, opts = _stage_parts(model)
    identity = checkpointing.CheckpointIdentity(fingerprint="x", world_size=1, mesh={}, zero=0)
    checkpointing.save_checkpoint(tmp_path / "ckpt", 1, parts[:1], opts[:1], identity, [0.0])
    with pytest.raises(checkpointing.CheckpointError, match=r"step_00000001 cannot be loaded under this plan's "
                                                            r"layout.*blocks\.0.*new --checkpoint-dir") as e:
        checkpointing.resume(tmp_path / "ckpt", [model], [opt], identity, steps=2)
    assert e.value.exit_code == 2


def test_powersgd_state_is_saved_hashed_and_read_back(one_rank, tmp_path):
    """A rank's PowerSGD state goes into the checkpoint as powersgd_rank<R>.pt, listed in the
    manifest with its checksum (verified on resume like every file), and comes back with
    ``torch.load(weights_only=True)``; the resume returns the layout and the powersgd:R it was
    saved under, which decide whether it continues (runtime/powersgd_state.restart_reason)."""
    import torch

    from autopar.runtime import checkpointing
    from autopar.runtime.powersgd_state import restart_reason

    model, opt = _tied_model_and_optimizer(seed=3)
    identity = checkpointing.CheckpointIdentity(fingerprint="x", world_size=1, mesh={"dp": 1}, zero=0)
    state = {"format": "autopar-powersgd", "iter": 7, "error": {"embed.weight": torch.arange(3.0)}}
    path = checkpointing.save_checkpoint(tmp_path / "ckpt", 1, [model], [opt], identity, [0.0],
                                         records={"powersgd": "powersgd:2"}, powersgd=state)
    assert "powersgd_rank0.pt" in json.loads((path / "manifest.json").read_text())["files"]
    resumed = checkpointing.resume(tmp_path / "ckpt", [model], [opt], identity, steps=2)
    layout = {"world_size": 1, "mesh": {"dp": 1}, "zero": 0}
    assert resumed.records["powersgd"] == "powersgd:2" and resumed.layout == layout
    back = torch.load(path / checkpointing.powersgd_file(0), weights_only=True)
    assert back["iter"] == 7 and torch.equal(back["error"]["embed.weight"], torch.arange(3.0))
    assert restart_reason(layout, layout, "powersgd:2", "powersgd:2", True) is None
    assert "zero 1" in restart_reason(layout, dict(layout, zero=1), "powersgd:2", "powersgd:2", True)
    assert "powersgd:4" in restart_reason(layout, layout, "powersgd:2", "powersgd:4", True)
    assert "no PowerSGD state" in restart_reason(layout, layout, None, "powersgd:2", False)
