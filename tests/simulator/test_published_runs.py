"""benchmarks/published_runs.py: measured step times, errors and per-family figures against hand
computations from the published figures (not from the benchmark's own pricing)."""
import json
from pathlib import Path

import pytest
from plain_loop import load          # a file loaded as a module once, cached in sys.modules

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    return load(ROOT / "benchmarks" / "published_runs.py")


@pytest.fixture(scope="module")
def rows(bench):
    return {r["id"]: r for r in bench.load_rows()}


@pytest.fixture(scope="module")
def graphs():
    """price_row's capture cache, shared by the tests that price the same rows (each row's model
    is captured once in the module)."""
    return {}


def test_megatron_row_step_matches_published_aggregate(bench, rows):
    # GPT 145.6B on 1536 A100, batch 2304: Eq. 3 FLOPs by hand; the paper's table gives the
    # aggregate 227.1 PFLOP/s for the row, so the step is FLOPs / 227.1e15 to the table's rounding
    b, s, l, h, v = 2304, 2048, 80, 12288, 51200
    flops = 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    step = bench.measured_step_s(rows["megatron21_t1_145.6B"])
    assert step == pytest.approx(flops / (148e12 * 1536), rel=1e-12)
    assert step == pytest.approx(flops / 227.1e15, rel=2e-3)


def test_mpt_row_step_and_mfu(bench, rows):
    row = rows["mpt_a100_80gb_125m_seq2048_8gpu_mbs32"]
    assert bench.measured_step_s(row) == pytest.approx(512 * 2048 / (141737 * 8), rel=1e-12)
    # the README's MFU convention, (6 N + 12 L d s) FLOPs per token over 312 TFLOP/s, gives its 44.45%
    n, l, d, s = 125311488, 12, 768, 2048
    assert (6 * n + 12 * l * d * s) * 141737 / 312e12 == pytest.approx(0.4445, abs=5e-4)
    assert row["measured"]["mfu"] == pytest.approx(0.4445)


def test_mpt_table_rows_from_the_readme_figures(bench, rows, tmp_path):
    """Rows built from llm-foundry's A100 80GB table (benchmarks/data/mpt_a100_80gb.csv) against the
    README's own figures, by hand; a table row the shared file also holds must agree with it."""
    mpt = [r for r in rows.values() if r["id"].startswith("mpt_")]
    assert len(mpt) == 61 and len({r["id"] for r in mpt}) == 61
    # README row "7b | 65536 | 8 | a100_80gb | 46.97 | 62.63 | ... | 1 | 2 | 16 | 0 | 8108 | 1013 |
    # 1048576 | amp_bf16 | DEFAULT | FULL_SHARD | True": 16 sequences of 65536 at 1013 tokens/s/GPU on 8
    row = rows["mpt_a100_80gb_7b_seq65536_8gpu_mbs1"]
    assert bench.measured_step_s(row) == pytest.approx(16 * 65536 / (1013 * 8), rel=1e-12)
    assert row["layout"] == {"dp": 8, "tp": 1, "pp": 1, "micro_batch": 1, "global_batch": 16, "recompute": "full",
                             "reduce_bytes": 2.0, "autocast": "fp32_params"}
    assert row["model"]["seq_len"] == 65536 and row["model"]["hidden"] == 4096 and row["model"]["layers"] == 32
    assert row["measured"]["hfu"] == pytest.approx(0.6263)
    # "70b | 2048 | 32 | ... | 2 | 16 | 1024 | ... | 373 | ... | bf16 | PURE": bf16 parameters, 4 nodes
    row = rows["mpt_a100_80gb_70b_seq2048_32gpu_mbs2"]
    assert row["layout"]["autocast"] == "low_params" and row["cluster"]["gpus"] == 32
    assert bench.measured_step_s(row) == pytest.approx(1024 * 2048 / (373 * 32), rel=1e-12)
    # the MPT rows of the shared file are rows of the table: a disagreeing figure is refused
    shared_13b = dict(rows["mpt_a100_80gb_13b_seq2048_8gpu_mbs2"])
    shared_13b["measured"] = dict(shared_13b["measured"], value=2263)
    base = [r for r in rows.values() if r["id"] != "mpt_a100_80gb_13b_seq2048_8gpu_mbs2"]
    with pytest.raises(SystemExit, match="13b_seq2048_8gpu_mbs2 disagrees"):
        bench.mpt_table_rows(base + [shared_13b])


def test_error_sign_and_family_summary(bench):
    # predicted step 0.8 s for a measured 1.0 s: the simulator promises 25% more throughput
    assert bench.throughput_error(0.8, 1.0) == pytest.approx(0.25)
    results = [{"id": "a", "family": "FSDP", "gpu": "a100", "error": 0.25},
               {"id": "b", "family": "FSDP", "gpu": "a100", "error": -0.10},
               {"id": "c", "family": "FSDP", "gpu": "a100", "error": 0.05},
               {"id": "d", "family": "PTD-P", "gpu": "a100", "error": -0.02}]
    t = bench.family_table(results)
    assert t["FSDP/a100"]["median_abs"] == pytest.approx(0.10)
    assert t["FSDP/a100"]["mean_signed"] == pytest.approx((0.25 - 0.10 + 0.05) / 3)
    assert t["FSDP/a100"]["worst_id"] == "a"
    assert t["PTD-P/a100"]["rows"] == 1
    halves = bench.split_halves([{"id": i, "family": "FSDP", "gpu": "a100"} for i in ("z", "x", "y")])
    assert halves == {"x": "A", "y": "B", "z": "A"}


def test_fit_picks_least_median_on_its_half(bench):
    by_value = {0.0: [("a", 0.3), ("b", 0.2)], 0.5: [("a", 0.05), ("b", 0.4)]}
    assert bench.fit_constants(by_value, {"a"}) == 0.5
    assert bench.fit_constants(by_value, {"b"}) == 0.0


def test_fit_losses_weigh_one_large_error_differently(bench):
    # one row far off at 0.0 and two exact; at 0.5 all three a little off (by hand: median 0 /
    # 0.12, mean |e| 0.1 / 0.12, mean e^2 0.03 / 0.0144)
    by_value = {0.0: [("a", 0.0), ("b", 0.0), ("c", 0.3)], 0.5: [("a", 0.12), ("b", -0.12), ("c", 0.12)]}
    ids = {"a", "b", "c"}
    assert bench.fit_constants(by_value, ids) == 0.0
    assert bench.fit_constants(by_value, ids, "absolute") == 0.0
    assert bench.fit_constants(by_value, ids, "squared") == 0.5
    # two rows a little off beat one row far off under least absolute deviations, not under the median
    by_value = {0.0: [("a", 0.0), ("b", 0.0), ("c", 0.3)], 0.5: [("a", 0.05), ("b", 0.05), ("c", 0.05)]}
    assert bench.fit_constants(by_value, ids) == 0.0
    assert bench.fit_constants(by_value, ids, "absolute") == 0.5


def test_zero3_table2_steps_from_the_published_tflops(bench, rows):
    # Narayanan et al. 2021 Table 2, ZeRO-3 without model parallelism, GPT 174.6B, batch 1536:
    # 144 / 88 / 44 TFLOP/s per GPU on 384 / 768 / 1536 GPUs, Eq. 3 FLOPs by hand
    b, s, l, h, v = 1536, 2048, 96, 12288, 51200
    flops = 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    for gpus, tflops in ((384, 144), (768, 88), (1536, 44)):
        step = bench.measured_step_s(rows[f"megatron21_t2_ZeRO-3_174.6B_{gpus}gpu"])
        assert step == pytest.approx(flops / (tflops * 1e12 * gpus), rel=1e-12)
    # the published runs did not speed up from 768 to 1536 GPUs
    assert flops / (88e12 * 768) == pytest.approx(flops / (44e12 * 1536))


@pytest.mark.parametrize("rid", ["megatron21_t2_ZeRO-3_174.6B_384gpu", "megatron21_t2_ZeRO-3_174.6B_1536gpu",
                                 "megatron21_t1_39.1B", "mpt_a100_80gb_125m_seq2048_8gpu_mbs32",
                                 "ibm_fsdp_llama2_7B_a100_128gpu"])
def test_rows_priced_near_the_published_step(bench, rows, graphs, rid):
    """DeepSpeed ZeRO-3 (April 2021), Megatron-LM's fused softmax and the runs' flash-attention
    kernels priced as those runs ran (simulator/sharded_dp.py item 4, examples/gpt.py
    attention="megatron", profile attention_kernels): the predicted step against the step the
    published throughput implies, within 10%."""
    r = bench.price_row(rows[rid], graphs)
    assert r["fits"]
    assert r["predicted_step_s"] == pytest.approx(bench.measured_step_s(rows[rid]), rel=0.10)


def test_zero3_rows_run_deepspeed_and_fsdp_rows_fsdp1(bench, rows):
    """The ZeRO-3 rows ran DeepSpeed of 2021; every FSDP row ran FSDP1 (FullyShardedDataParallel):
    llm-foundry's MPT table on the 2.1 image (its sweep.sh at b2a43a147) but for its two 70B rows,
    kept from the table's first revision on the 1.13.1 image; fms-fsdp's Llama-2 rows on the
    nightlies after 2.2.  The planner's plans are priced as FSDP2, what autopar's runtime runs
    (sharded_dp.py items 4, 5)."""
    from autopar.simulator.axes import sharded_dp
    from autopar.simulator.device.training_code import AUTOPAR

    assert bench.sharded_runtime(rows["megatron21_t2_ZeRO-3_174.6B_384gpu"]) is sharded_dp.DEEPSPEED_ZERO3_2021
    fsdp = [r for r in rows.values() if r["family"] == "FSDP"]
    assert len(fsdp) == 69               # 61 MPT (llm-foundry's A100 80GB table), 4 + 4 IBM/Meta
    # the rows whose figures are those of 300cc5c58's table (2023-05-03, "bf16 | PURE"), by hand
    old = {"mpt_a100_80gb_70b_seq2048_64gpu_mbs8", "mpt_a100_80gb_70b_seq2048_32gpu_mbs2"}
    for r in fsdp:
        code = bench.row_code(r)
        if r["id"] in old:
            assert r["torch"] == "1.13.1" and code.sharded is sharded_dp.FSDP1_TORCH_1_13, r["id"]
            assert not code.recompute_early_stop          # the early stop came with torch 2.1
        else:
            assert r.get("torch", "2.1.0") == "2.1.0" and code.sharded is sharded_dp.FSDP1_TORCH_2_2, r["id"]
            assert code.recompute_early_stop
        assert not code.sharded.copy_out and code.sharded.grad_concat_on_compute
    assert (sharded_dp.FSDP1_TORCH_1_13.reduce_prep_passes, sharded_dp.FSDP1_TORCH_2_2.reduce_prep_passes) == (2, 1)
    assert AUTOPAR.sharded is sharded_dp.FSDP2             # what every plan of the planner is priced as
    assert sharded_dp.FSDP2.copy_out and not sharded_dp.FSDP2.grad_concat_on_compute


def test_megatron_rows_run_its_fp16_optimizer(bench, rows):
    """The PTD-P rows price Megatron-LM 2021's fp16 optimizer step and pipeline exchange, the others
    AdamW alone; each row's code is its own (the planner's plans are priced as AUTOPAR)."""
    from autopar.simulator.step import optimizer_step
    from autopar.simulator.axes import pp_p2p as pipeline_p2p, sharded_dp

    assert bench.optimizer_runtime(rows["megatron21_t1_1008.0B"]) is optimizer_step.MEGATRON_FP16_2021
    assert bench.optimizer_runtime(rows["megatron21_t2_PTD-P_174.6B_384gpu"]) is optimizer_step.MEGATRON_FP16_2021
    # the models without a pipeline ran torch's DDP (run_table_1.sh, DDP=torch)
    assert bench.optimizer_runtime(rows["megatron21_t1_1.7B"]) is optimizer_step.MEGATRON_FP16_TORCH_DDP_2021
    assert (bench.optimizer_runtime(rows["ibm_fsdp_llama2_7B_a100_128gpu"])
            is bench.optimizer_runtime(rows["megatron21_t2_ZeRO-3_174.6B_384gpu"]) is optimizer_step.TORCH_ADAMW)
    megatron = bench.row_code(rows["megatron21_t1_18.4B"])
    assert megatron.optimizer is optimizer_step.MEGATRON_FP16_TORCH_DDP_2021
    assert megatron.p2p is pipeline_p2p.MEGATRON_2021
    zero3 = bench.row_code(rows["megatron21_t2_ZeRO-3_174.6B_384gpu"])
    assert zero3.sharded is sharded_dp.DEEPSPEED_ZERO3_2021 and zero3.reduce_bytes == 2.0


def test_rows_run_their_attention_kernel(bench, rows):
    """llm-foundry's MPT runs used its copy of flash-attention's Triton kernel, priced at FlashAttention
    (v1)'s published rates (its author: "slightly slower" than that kernel); fms-fsdp's PyTorch SDPA
    (FlashAttention-2, also what autopar's runtime runs)."""
    from autopar.simulator.device.training_code import DEFAULT_ATTENTION_KERNEL

    assert bench.attention_kernel(rows["mpt_a100_80gb_125m_seq2048_8gpu_mbs32"]) == "flash"
    assert bench.attention_kernel(rows["ibm_fsdp_llama2_7B_a100_128gpu"]) == DEFAULT_ATTENTION_KERNEL == "flash2"


@pytest.mark.parametrize("size,micro_batch,chunks,ddp", [
    # NVIDIA/Megatron-LM 6985e58938 examples/sc21/run_table_1.sh, by hand: MBS, then layers / PP /
    # --num-layers-per-virtual-pipeline-stage (1 where the flag is absent), then DDP
    ("1.7B", 16, 1, "torch"), ("18.4B", 8, 1, "torch"), ("39.1B", 4, 1, "local"),
    ("76.1B", 2, 60 // 4 // 5, "local"), ("145.6B", 2, 80 // 8 // 5, "local"), ("310.1B", 1, 96 // 16 // 3, "local"),
    ("529.6B", 1, 105 // 35 // 1, "local"), ("1008.0B", 1, 1, "local")])
def test_table1_rows_run_the_papers_scripts(bench, rows, size, micro_batch, chunks, ddp):
    """Table 1 states no micro-batch, schedule or DDP; the rows take them from the paper's own run
    scripts, and a row's plan runs the interleaved schedule exactly where the script asks for it."""
    from autopar.core.capture import capture_model_file

    row = rows[f"megatron21_t1_{size}"]
    lay = row["layout"]
    assert (lay["micro_batch"], lay["virtual_stages"], lay["ddp"]) == (micro_batch, chunks, ddp)
    if lay["pp"] > 1:
        path, args = bench.model_spec(row)
        small = dict(args, layers=2 * lay["pp"] * chunks, hidden=8 * args["heads"], vocab=512)  # the same split
        plan = bench.row_plan(row, capture_model_file(path, small, lay["micro_batch"]), bench.row_cluster(row))
        assert plan.pipeline.schedule == ("interleaved" if chunks > 1 else "1f1b")
        assert len(plan.pipeline.stages) == lay["pp"] * chunks


def test_each_sharded_row_reads_one_of_the_two_fitted_constants(bench, rows, graphs):
    """The fit prices each sharded row once per value of the constant it reads
    (``reads_ring_efficiency``): a row on a ring over nodes does not move with the overlap slowdown,
    a row within one node (or on DeepSpeed's per-GPU gathers) not with the ring efficiency."""
    from autopar.simulator.device.calibration import Calibration

    ring, node, zero3 = (rows[i] for i in ("ibm_fsdp_llama2_7B_a100_128gpu", "mpt_a100_80gb_125m_seq2048_8gpu_mbs32",
                                          "megatron21_t2_ZeRO-3_174.6B_384gpu"))
    assert bench.reads_ring_efficiency(ring) and not bench.reads_ring_efficiency(node)
    assert not bench.reads_ring_efficiency(zero3)
    steps = {}
    for s, e in ((0.0, 0.3), (1.0, 0.3), (0.0, 0.85)):
        cal = Calibration(nccl_overlap_slowdown=s, sharded_ring_efficiency=e)
        steps[s, e] = [bench.price_row(r, graphs, cal)["predicted_step_s"] for r in (ring, node, zero3)]
    assert steps[0.0, 0.3][0] == steps[1.0, 0.3][0]                                # the ring row: efficiency only
    assert steps[0.0, 0.3][0] > steps[0.0, 0.85][0]
    for k in (1, 2):                                                                  # the others: slowdown only
        assert steps[0.0, 0.3][k] == steps[0.0, 0.85][k] < steps[1.0, 0.3][k]


def test_autopar_family_is_torchtitans_eager_row_priced_as_autopars_code(bench, rows):
    """torchtitan's Table 1 eager row (FSDP2, Llama 3.1 8B on 8 H100 96 GB at 500 W) is the AUTOPAR
    family: priced as autopar's runtime (FSDP2, fp32 reduce, SDPA flash) but for torchtitan's
    op-level selective checkpointing, on the variant's own profile; the compile and float8 rows of
    the same table are listed as not yet priced."""
    from dataclasses import replace

    from autopar.simulator.device.training_code import AUTOPAR

    row = rows["torchtitan24_8b_8gpu_FSDP"]
    assert (row["family"], row["gpu"]) == ("AUTOPAR", "h100-96gb-500w")
    assert bench.row_code(row) == replace(AUTOPAR, selective_mm_policy="every_other")
    assert row["layout"]["recompute"] == "selective" and row["layout"]["reduce_bytes"] == AUTOPAR.reduce_bytes
    cluster = bench.row_cluster(row)
    assert cluster.world_size == 8 and [g.gpu for g in cluster.groups] == ["h100-sxm-96gb-500w"]
    # 131072 tokens a step at 5,762 tokens/s on each of 8 GPUs
    assert bench.measured_step_s(row) == pytest.approx(16 * 8192 / (5762 * 8))
    data = json.loads((ROOT / "benchmarks" / "data" / "published_runs.json").read_text())
    assert {r["id"] for r in data["not_yet_priced"]} == {"torchtitan24_8b_8gpu_FSDP_torchcompile",
                                                          "torchtitan24_8b_8gpu_FSDP_torchcompile_Float8"}
    assert not any(r["id"] in {x["id"] for x in data["not_yet_priced"]} for r in data["rows"])


def test_cp_family_is_torchtitans_context_parallel_table(bench, rows):
    """Family CP: torchtitan's Tables 2 and 6 (FSDP + CP, Llama 3.1 8B on 8 H100 96 GB and 405B on
    512 with tp 8 and pp 8, sequence 32K to 256K), from the project's own rows file, split in halves like the others; each row's plan has
    its cp, torch.compile and float8 blocks, priced as torchtitan's code (causal per-block CP)."""
    cp_rows = [r for r in rows.values() if r["family"] == "CP"]
    # Table 2 (8B, 8 GPUs) and Table 6 (405B, 512 GPUs, tp 8 x pp 8): the same four dp x cp splits
    for table in ("8b_8gpu", "405b_512gpu"):
        assert sorted((r["layout"]["dp"], r["layout"]["cp"], r["model"]["seq_len"]) for r in cp_rows
                      if table in r["id"]) == [(1, 8, 262144), (2, 4, 131072), (4, 2, 65536), (8, 1, 32768)]
    halves = bench.split_halves(list(rows.values()))
    assert sorted(halves[r["id"]] for r in cp_rows) == ["A"] * 4 + ["B"] * 4
    row = rows["torchtitan24_cp_8b_8gpu_fsdp2_cp4_seq131072"]
    # 2 samples of 131072 tokens a step at 1,071 tokens/s on each of 8 GPUs
    assert bench.measured_step_s(row) == pytest.approx(2 * 131072 / (1071 * 8))
    assert bench.row_code(row).cp_attention == "causal_blocks"
    from autopar.core.capture import capture_model_file

    path, args = bench.model_spec(row)
    graph = capture_model_file(path, args, 1)
    plan = bench.row_plan(row, graph, bench.row_cluster(row))
    assert (plan.mesh.dp, plan.mesh.cp, plan.global_batch, plan.compile) == (2, 4, 2, True)
    assert {lp.precision for lp in plan.layers if graph.layers[lp.layer].kind not in ("pre", "post")} == {"fp8"}


def test_ep_family_is_megatron_bridges_moe_table_priced_with_its_ep(bench, rows, graphs):
    """Family EP: Megatron Bridge's DGX-H100 MoE rows (benchmarks/data/published_runs_cp_ep.json),
    each with its source, split in halves like the others; each is priced (a finite step) on
    examples/moe.py with a plan whose mesh has the row's ep, as Megatron-Core's code with the
    force-balanced routing the source's footnote states."""
    ep_rows = [r for r in rows.values() if r["family"] == "EP"]
    assert len(ep_rows) >= 4
    for r in ep_rows:
        src = r["source"]
        assert src["repo"] == "NVIDIA-NeMo/Megatron-Bridge" and src["path"] and src["commit"] and src["location"]
        assert r["model"]["arch"] == "moe" and r["layout"]["ep"] > 1
    halves = bench.split_halves(list(rows.values()))
    assert {halves[r["id"]] for r in ep_rows} == {"A", "B"}
    # 26.06 table, DGX-H100 Qwen3_30B_a3B: 1024 sequences of 4096 at 8826 tokens/s on each of 16 GPUs
    row = rows["mbridge2606_qwen3_30b_a3b_16gpu_ep16"]
    assert bench.measured_step_s(row) == pytest.approx(1024 * 4096 / (8826 * 16))
    code = bench.row_code(row)
    assert code.expert_load == 1.0 and not code.p2p.blocking
    # each row's dispatcher read from its recipe (MBRIDGE_DISPATCH); every recipe sets the distributed optimizer
    assert set(bench.MBRIDGE_DISPATCH) == {r["id"] for r in ep_rows}
    assert code.ep_dispatch == "deepep" and code.distributed_optimizer
    assert bench.row_code(rows["mbridge2604p1_gpt_oss_120b_64gpu_pp4_ep8"]).ep_dispatch == "all_to_all"
    from autopar.core.capture import capture_model_file

    for r in ep_rows:
        path, args = bench.model_spec(r)
        key = (path, tuple(sorted(args.items())), r["layout"]["micro_batch"])
        if key not in graphs:                  # price_row's key: the row's model captured once
            graphs[key] = capture_model_file(path, args, r["layout"]["micro_batch"])
        graph = graphs[key]
        plan = bench.row_plan(r, graph, bench.row_cluster(r))
        lay = r["layout"]
        assert (plan.mesh.ep, plan.mesh.dp, plan.mesh.tp, plan.mesh.pp) == (lay["ep"], lay["dp"], lay["tp"], lay["pp"])
        priced = bench.price_row(r, graphs)
        assert priced["ep"] == lay["ep"] and 0 < priced["predicted_step_s"] < float("inf")


def test_moe_example_matches_a_per_token_loop():
    """examples/moe.py's grouped-GEMM experts against a plain loop over tokens and their chosen
    experts (each expert a SwiGLU of its own slices of the stacked weights), on CPU in bf16."""
    import torch
    import torch.nn.functional as F
    from plain_loop import load as load_file

    m = load_file(ROOT / "examples" / "moe.py")
    torch.manual_seed(0)
    model = m.build_model(layers=1, hidden=16, heads=2, kv_heads=1, experts=4, top_k=2, expert_ffn=8, shared_ffn=8)
    moe = model.layers[0].ffn
    with torch.no_grad():                      # weights of order one, so the outputs are too
        for p in moe.parameters():
            p.normal_(0.0, 0.5)
    x = torch.randn(2, 5, 16, dtype=torch.bfloat16)
    got = moe(x).float()
    flat = x.reshape(-1, 16).float()
    probs = F.softmax(flat @ moe.router.weight.float().T, dim=-1)
    want = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        w, idx = probs[t].topk(2)
        w = w / w.sum()
        for weight, e in zip(w, idx):
            gate, up = (flat[t] @ moe.experts.w13[e].float()).chunk(2)
            want[t] += weight * ((F.silu(gate) * up) @ moe.experts.w2[e].float())
        s = moe.shared
        want[t] += s.w2.weight.float() @ (F.silu(s.w1.weight.float() @ flat[t]) * (s.w3.weight.float() @ flat[t]))
    assert want.abs().mean() > 0.5
    assert torch.allclose(got.reshape(-1, 16), want, atol=0.05 * want.abs().max().item(), rtol=0.05)


def test_405b_cp_rows_run_torchtitans_sequence_parallel_tp(bench, rows):
    """torchtitan 9dec370's apply_tp shards the block inputs over the sequence (SequenceParallel norms,
    Shard(1) outputs) whenever tp > 1, so Table 6's rows are priced sequence-parallel; the rows
    without it in the file (the 8B CP rows, tp 1; Megatron-LM 2021, before sequence parallelism)
    are not.  The 405B row's plan is built on a four-block copy of the model (the layout is what is
    checked, not the model)."""
    from autopar.core.capture import capture_model_file

    for rid, row in rows.items():
        if row["family"] == "CP":
            assert row["layout"].get("sequence_parallel", False) == (row["layout"]["tp"] > 1), rid
        elif row["family"] == "PTD-P":
            assert not row["layout"].get("sequence_parallel", False), rid
    row = json.loads(json.dumps(rows["torchtitan24_cp_405b_512gpu_fsdp2_cp4_seq131072"]))
    row["model"].update(layers=8, hidden=512, heads=8, kv_heads=8, ffn_hidden=1024, vocab=1024, seq_len=1024)
    path, args = bench.model_spec(row)
    graph = capture_model_file(path, args, 1)
    plan = bench.row_plan(row, graph, bench.row_cluster(row))
    assert (plan.mesh.tp, plan.mesh.pp, plan.mesh.cp, plan.mesh.sequence_parallel) == (8, 8, 4, True)
    row["layout"].pop("sequence_parallel")
    assert not bench.row_plan(row, graph, bench.row_cluster(row)).mesh.sequence_parallel
