"""A plan never holds a tensor-parallel mesh (tp > 1) without a layer that it splits: such a
plan runs the whole model on every tp rank.  The search rejects such candidates (and re-solves
a setting's ILP with the splits forced when it leaves every layer whole); ``--tp 2`` on a model
with nothing to split exits 2 and says so, with no plan written."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# convolutions only, and a loss read through an element-wise op: no Linear pair, no embedding,
# no Linear head feeding the loss (core/sharding.megatron_styles finds nothing in any layer)
NOTHING_TO_SPLIT = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Conv1d(4, 4, 3, padding=1) for _ in range(2))

    def forward(self, x):
        for conv in self.blocks:
            x = torch.tanh(conv(x))
        return x


def build_model():
    return Net()


def make_batch(batch_size):
    return torch.randn(batch_size, 4, 8), torch.randn(batch_size, 4, 8)


def loss_fn(out, target):
    return F.mse_loss(out, target)
'''


def _plan(tmp_path: Path, model: Path, *args: str) -> subprocess.CompletedProcess:
    from cli_inprocess import run_cli

    return run_cli("plan", str(model), "--cluster", "local-cpu", "--global-batch", "8", "--time-budget", "3",
                   "-o", str(tmp_path / "plan.json"), *args, cwd=ROOT)


@pytest.mark.slow          # two `autopar plan` processes, about 12 s each
@pytest.mark.parametrize("check", [[], ["--no-runtime-check"]], ids=["runtime-check", "no-runtime-check"])
def test_forced_tp_on_a_model_with_nothing_to_split_exits_2(tmp_path, check):
    model = tmp_path / "convs.py"
    model.write_text(NOTHING_TO_SPLIT)
    r = _plan(tmp_path, model, "--tp", "2", *check)
    said = " ".join(r.stderr.split())
    assert r.returncode == 2, r.stdout + r.stderr
    assert "model convs has nothing tensor parallelism can split" in said, said
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "plan.json").exists()
    # without --tp the search plans it, on a mesh without tp
    r = _plan(tmp_path, model, *check)
    assert r.returncode == 0, r.stderr
    from autopar.core.plan import load_plan

    assert load_plan(tmp_path / "plan.json").mesh.tp == 1


def _two_device_cluster(tmp_path: Path) -> Path:
    text = (ROOT / "examples" / "clusters" / "local-cpu.yaml").read_text()
    assert "gpus_per_node: 4" in text
    path = tmp_path / "cpu2.yaml"
    path.write_text(text.replace("gpus_per_node: 4", "gpus_per_node: 2").replace("name: local-cpu", "name: cpu2"))
    return path


@pytest.mark.parametrize("search_kw", [{}, {"algo": "ilp", "sequence_parallel": False}], ids=["auto", "ilp-no-sp"])
def test_every_tp_plan_of_the_search_splits_a_layer(tmp_path, search_kw):
    """hf_llama on 2 gloo devices with --tp 2: the layers' collectives cost more than their
    compute on this cluster, so the cheapest candidate left every layer whole (the issue: a tp=2
    mesh and no split).  Now the best plan and every runner-up split at least one layer: MCMC's
    candidates are rejected (``auto``), the structured phase's ILP is solved again with the
    splits forced (``ilp`` without sequence parallelism, whose meshes force no split)."""
    pytest.importorskip("transformers")
    from autopar.core.capture import capture_model_file
    from autopar.core.cluster import load_cluster
    from autopar.planner.search import PlanOptions, search
    from autopar.simulator.device.cost_model import CostModel

    graph = capture_model_file(ROOT / "tests" / "zoo" / "hf_llama.py", {}, 8)
    cluster = load_cluster(str(_two_device_cluster(tmp_path)))
    cms = {g.gpu: CostModel.from_profile(g.gpu) for g in cluster.groups}
    result = search(graph, cluster, cms, PlanOptions(global_batch=8, precision="fp32", degrees={"tp": 2},
                                                     time_budget_s=4, mcmc_iterations=300, **search_kw))
    plans = [result.best.plan] + [ev.plan for ev in result.runner_ups]
    for plan in plans:
        assert plan.mesh.tp == 2
        assert any(lp.tp for lp in plan.layers), [dict(lp.tp) for lp in plan.layers]


def test_forced_tp_that_a_head_count_does_not_divide_exits_2_naming_it(tmp_path):
    """llama-tiny (examples/llama.py SIZES: 4 query heads, 2 key/value heads) over --tp 4: the
    widths divide by 4, k's and v's 2 heads do not, and a rank cannot hold half a head.  The
    plan is refused (exit 2, nothing written) with the projection and its head count named --
    not the reshape's RuntimeError the runtime check saw -- and tp 2, which divides both, is
    offered instead; planned freely, the plan keeps tp=4 among what it left out, saying why."""
    import json

    model = ROOT / "examples" / "llama.py"
    r = _plan(tmp_path, model, "--tp", "4")
    said = " ".join(r.stderr.split())
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--tp 4:" in said and "layers.0.attn.wk has 2 heads" in said and "not divisible by tp=4" in said, said
    assert "Use --tp 2, --tp 1 or leave --tp out" in said, said
    assert "RuntimeError" not in said and "Traceback" not in r.stderr
    assert not (tmp_path / "plan.json").exists()
    r = _plan(tmp_path, model)
    assert r.returncode == 0, r.stderr
    from autopar.core.plan import load_plan

    assert load_plan(tmp_path / "plan.json").mesh.tp in (1, 2)
    left = {x["kind"]: x["reason"] for x in json.loads((tmp_path / "plan.json").read_text())["provenance"]["left_out"]}
    assert "layers.0.attn.wk has 2 heads" in left["tp=4"] and "tp=2" not in left, left


def test_forced_tp_without_the_runtime_check_refused_by_the_head_count():
    """--no-runtime-check (no ``Executable``): the analysis's own refusal stops --tp 4 on
    llama-tiny (2 key/value heads), while --tp 2, which divides 4 and 2, is taken."""
    from autopar.core.capture import capture_model_file
    from autopar.core.cluster import load_cluster
    from autopar.core.errors import UserError
    from autopar.planner.constraints import constrain
    from autopar.planner.search import PlanOptions

    graph = capture_model_file(ROOT / "examples" / "llama.py", {}, 2)
    cluster = load_cluster("local-cpu")
    with pytest.raises(UserError, match=r"--tp 4: .*layers\.0\.attn\.wk has 2 heads .*not divisible by tp=4"):
        constrain(PlanOptions(global_batch=8, degrees={"tp": 4}), graph, cluster)
    assert constrain(PlanOptions(global_batch=8, degrees={"tp": 2}), graph, cluster).degrees == {"tp": 2}


def test_search_without_the_runtime_check_offers_no_degree_a_head_count_refuses():
    """With no runtime check's verdict the search's meshes leave out tp 4 for llama-tiny (its 2
    key/value heads) and keep tp 2; a model whose 4 heads divide by 4 (examples/gpt.py, MHA)
    keeps tp 4."""
    from autopar.core.capture import capture_model_file
    from autopar.core.cluster import load_cluster
    from autopar.planner.constraints import candidate_meshes
    from autopar.planner.search import PlanOptions

    cluster = load_cluster("local-cpu")
    llama = capture_model_file(ROOT / "examples" / "llama.py", {}, 2)
    gpt = capture_model_file(ROOT / "examples" / "gpt.py", {"layers": 2, "hidden": 64, "heads": 4, "seq": 16,
                                                            "vocab": 128}, 2)
    for graph, want in ((llama, {1, 2}), (gpt, {1, 2, 4})):
        tps = {m.tp for m in candidate_meshes(PlanOptions(global_batch=8), cluster, len(graph.layers), graph)}
        assert tps == want, (graph.model_file, tps)
