"""The simulator against published training runs: Megatron-LM PTD-P, DeepSpeed ZeRO-3, FSDP,
context parallelism (CP) and expert parallelism (EP: Megatron-Core's MoE runs).

Every row of ``benchmarks/data/published_runs.json`` (a published run: its model, cluster,
parallel layout and measured throughput, with its source) is priced as ``autopar simulate``
prices a configuration: the model built from ``examples/gpt.py`` or ``examples/llama.py`` with
the row's dimensions and captured on meta, the cluster from a bundled file with the row's node
count and network, the plan from the row's layout (``simulator.configure.config_plan``), and
``simulator.simulate.simulate_plan`` (the step model).  Per family (PTD-P, ZeRO-3, FSDP) and GPU
type it prints the median |error|, the mean signed error and the worst row.

Error = predicted throughput / measured throughput - 1 (= measured step / predicted step - 1):
positive means the simulator promises more than the run delivered.

The rows are split in two halves, deterministically: within each family and GPU type, rows
sorted by id, alternately A and B (``split_halves``).  A cost term with a free constant is fitted on one half
and reported on the other, both ways; the per-half figures are printed beside the whole table.

    python benchmarks/published_runs.py [--fit] [--only ID_SUBSTRING] [--refresh-data]

``--refresh-data`` rebuilds the project's copy from ``../shared/validation/published_runs.json``
(beside the repository); the benchmark itself reads only the copy, and the project's own rows of
runs the shared file does not hold, ``benchmarks/data/published_runs_cp_ep.json`` (family CP:
context parallelism; EP: expert parallelism -- each row with its source).
Writes benchmarks/results/published_runs.{txt,json}.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "benchmarks" / "data" / "published_runs.json"
SHARED = ROOT.parent / "shared" / "validation" / "published_runs.json"
RESULTS = ROOT / "benchmarks" / "results"
FAMILIES = ("PTD-P", "ZeRO-3", "FSDP", "AUTOPAR", "CP", "EP")
#: rows the project holds itself (runs with context or expert parallelism), beside the shared copy
LOCAL_DATA = ROOT / "benchmarks" / "data" / "published_runs_cp_ep.json"

# Per GPU type of the sources: the bundled profile and the cluster file whose node it uses.
GPU_KEYS = {"NVIDIA A100 SXM4 80GB": "a100", "A100 80GB": "a100", "NVIDIA A100 80GB": "a100",
            "NVIDIA H100 80GB": "h100", "H100 80GB": "h100", "NVIDIA H100 SXM5 80GB": "h100",
            "NVIDIA H100 SXM 96GB HBM2e (2.4 TB/s), 500W power limit (Grand Teton)": "h100-96gb-500w"}
BASE_CLUSTER = {"a100": "dgx-a100-192x8", "h100": "h100-16x8", "h100-96gb-500w": "h100-96gb-500w-1x8"}


# ----------------------------------------------------------------------------- the data copy
#: bytes a gradient element took in the published runs' reduce-scatters: llm-foundry's FSDP mixed
#: precision (composer DEFAULT and PURE) and fms-fsdp's bfSixteen policy reduce in bf16, DeepSpeed's
#: fp16 ZeRO-3 in fp16 (the model dtype) -- 2 bytes each (TrainingCode.reduce_bytes, simulator/training_code.py)
REDUCE_BYTES = 2.0
#: torchtitan's runs (the AUTOPAR family) reduce in fp32: ``training.mixed_precision_reduce`` defaults
#: to float32 (torchtitan 9dec370 ``config_manager.py``), as autopar's runtime does
AUTOPAR_REDUCE_BYTES = 4.0
#: torchtitan 9dec370's selective checkpointing ``selective_ac_option = "op"`` (its llama3 8B config)
TORCHTITAN_SELECTIVE_MM_POLICY = "every_other"


def _autocast(parallel: dict) -> str:
    """How the run used torch.autocast (simulator/autocast.py modes): llm-foundry's runs train under
    composer's amp_bf16 -- autocast -- with fp32 parameters (FSDP mixed precision DEFAULT) or bf16
    ones (PURE); Megatron-LM and DeepSpeed keep fp16 parameters and fms-fsdp bf16 ones (FSDP
    MixedPrecision param_dtype), without autocast."""
    text = parallel.get("precision") or ""
    if "DEFAULT" in text:
        return "fp32_params"
    if "PURE" in text:
        return "low_params"
    return "off"


def _family(row: dict) -> str:
    """PTD-P (Megatron-LM), ZeRO-3 (DeepSpeed), FSDP (PyTorch's FSDP1) or AUTOPAR: the runs made with
    the stack autopar's runtime is -- FSDP2 (``fully_shard``), torch.utils.checkpoint, SDPA -- in
    eager mode, priced as autopar's own code (``row_code``: ``training_code.AUTOPAR``)."""
    zero = row["parallel"]["zero_stage"]
    if isinstance(zero, str) and "FSDP2" in zero:
        return "AUTOPAR"
    if row["parallel"].get("fsdp") or (isinstance(zero, str) and "FSDP" in zero):
        return "FSDP"
    if zero == 3:
        return "ZeRO-3"
    return "PTD-P"


def _recompute_label(text: str | None, family: str = "") -> str:
    t = (text or "").lower()
    if family == "AUTOPAR" and t.startswith("selective"):
        return "selective"        # torchtitan's op-level selective checkpointing ("op"), row_plan
    if t.startswith("selective"):
        return "partial"          # IBM: checkpointing every n-th block, n not stated
    if t.startswith(("full", "yes")):
        return "full"
    return "none"


def _inter_node_GBps_per_gpu(cluster: dict) -> float | None:
    """The GPU's share of its node's network, GB/s per direction, from the row's description."""
    text = (cluster.get("inter_node") or "").lower()
    gpn = cluster["gpus_per_node"]
    if "8x infiniband hdr 200 gb/s per node" in text:
        return 8 * 200 / 8 / gpn                       # 8 adapters x 200 Gb/s
    if text.startswith("1600 gbps"):
        return 1600 / 8 / gpn
    if text.startswith("400 gbps"):
        return 400 / 8 / gpn
    if "400 gb/s per gpu" in text:
        return 400 / 8                                 # torchtitan's hosts: RDMA 400 Gb/s per GPU
    return None


def not_yet_priced(row: dict) -> str | None:
    """Why a shared row is left out of the copy for now, or None: torch.compile and float8 runs
    come with their own issue (their kernels are not eager PyTorch's)."""
    p = row["parallel"]
    if p.get("torch_compile"):
        return "torch.compile" + (" + float8 linears" if "fp8" in (p.get("precision") or "") else "")
    if "fp8" in (p.get("precision") or ""):
        return "float8 linears"
    return None


#: What Megatron-LM's own scripts for the SC'21 paper ran (NVIDIA/Megatron-LM 6985e58938, 2021-08-18,
#: ``examples/sc21/``; later moved to ``examples/academic_paper_scripts/sc21/`` unchanged): per
#: Table 1 model, ``run_table_1.sh`` gives the micro-batch (``MBS``), the DDP implementation
#: (``DDP``: ``torch`` = torch DistributedDataParallel, ``local`` = Megatron's own) and, where
#: the row runs the interleaved schedule, ``--num-layers-per-virtual-pipeline-stage`` (model
#: chunks per pipeline rank = layers / pp / that; none given = the non-interleaved 1F1B).
#: Table 1 of the paper states none of these.  Keyed by the row id's size.
#: (micro-batch, layers per virtual stage or None, DDP implementation)
SC21_TABLE_1 = {"1.7B": (16, None, "torch"), "3.6B": (16, None, "torch"), "7.5B": (16, None, "torch"),
                "18.4B": (8, None, "torch"), "39.1B": (4, None, "local"), "76.1B": (2, 5, "local"),
                "145.6B": (2, 5, "local"), "310.1B": (1, 3, "local"), "529.6B": (1, 1, "local"),
                "1008.0B": (1, None, "local")}
#: Table 2's PTD-P rows (174.6B, tp 8, pp 12, micro-batch 1) have no script; ``run_figure_12.sh``
#: runs the same model and layout (96 layers, hidden 12288, tp 8, pp 12, MBS 1, DDP local)
#: interleaved with 2 layers per virtual stage, which is taken for them (an inference, so noted
#: in docs/validation.md).
SC21_TABLE_2_PTDP = (1, 2, "local")


def _megatron_layout(row_id: str, layers: int, pp: int) -> dict:
    """The Megatron-LM settings of a PTD-P row that the paper's tables leave out (SC21_TABLE_1)."""
    if row_id.startswith("megatron21_t1_"):
        mb, per_chunk, ddp = SC21_TABLE_1[row_id.rsplit("_", 1)[1]]
    else:
        mb, per_chunk, ddp = SC21_TABLE_2_PTDP
    return {"micro_batch": mb, "virtual_stages": layers // pp // per_chunk if per_chunk else 1, "ddp": ddp}


def copy_from_shared(shared: Path = SHARED) -> dict:
    """The project's copy: each row's figures and source, no prose (see the module docstring)."""
    if not shared.exists():
        raise SystemExit(f"the shared validation data {shared} is absent: it is expected beside the repository "
                         f"(../shared/validation/published_runs.json); the benchmark reads the project's copy "
                         f"{DATA.relative_to(ROOT)}, which --refresh-data rebuilds from it.")
    src = json.loads(shared.read_text())
    rows, later = [], []
    for r in src["rows"]:
        if not_yet_priced(r):
            later.append({"id": r["id"], "why": not_yet_priced(r)})
            continue
        m, c, p, met = r["model"], r["cluster"], r["parallel"], r["metrics"]
        measured = ({"metric": "tflops_per_gpu_megatron_eq3", "value": met["tflops_per_gpu"]["value"]}
                    if met.get("tflops_per_gpu") else
                    {"metric": "tokens_per_s_per_gpu", "value": met["tokens_per_sec"]["value"]})
        for k in ("mfu", "hfu"):
            if met.get(k):
                v = met[k]["value"]
                measured[k] = v / 100 if v > 1 else v
        source = {k: r["source"][k] for k in ("title", "location", "url", "repo", "path", "commit")
                  if r["source"].get(k)}
        arch = "llama" if m.get("kv_heads") and "Llama" in m["name"] else "gpt"
        family = _family(r)
        layout = {"dp": p["dp"], "tp": p["tp"], "pp": p["pp"], "micro_batch": p["micro_batch"],
                  "global_batch": p["global_batch"], "recompute": _recompute_label(p["recompute"], family),
                  "reduce_bytes": AUTOPAR_REDUCE_BYTES if family == "AUTOPAR" else REDUCE_BYTES,
                  "autocast": _autocast(p)}
        if _family(r) == "PTD-P":
            layout.update(_megatron_layout(r["id"], m["layers"], p["pp"]))
        rows.append({
            "id": r["id"], "family": family, "gpu": GPU_KEYS[c["gpu"]], "source": source,
            "model": {"name": m["name"], "arch": arch, "mpt": "MPT" in m["name"],
                      **{k: m[k] for k in ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "seq_len", "vocab")}},
            "cluster": {"gpus": c["gpus"], "gpus_per_node": c["gpus_per_node"],
                        "inter_node_GBps_per_gpu": _inter_node_GBps_per_gpu(c)},
            "layout": layout,
            "measured": measured,
        })
        if rows[-1]["model"]["mpt"]:
            rows[-1]["torch"] = mpt_torch(r["id"])
    rows += _ibm_h100_rows(rows)
    rows += mpt_table_rows(rows)
    return {"about": "Figures of published training runs (throughput, layout, model and cluster) with their "
                     "sources, copied from ../shared/validation/published_runs.json (and the H100 columns of "
                     "the IBM/Meta FSDP blog's Table 1, and the rest of llm-foundry's A100 80GB table, "
                     "benchmarks/data/mpt_a100_80gb.csv) by benchmarks/published_runs.py --refresh-data.",
            "rows": rows, "not_yet_priced": later}


#: Runs the shared file does not hold: the H100 columns of the IBM/Meta FSDP blog's Table 1
#: (https://pytorch.org/blog/maximizing-training/; pytorch/pytorch.github.io,
#: _posts/2024-03-13-maximizing-training.md): 96 H100 80GB, 800 Gbps inter-node, Llama 2
#: architectures at sequence 4096, batch 2 per GPU, FSDP; (size, tokens/s/GPU, MFU, HFU, checkpointing).
IBM_H100 = (("7B", 7500, 0.37, 0.37, "none"), ("13B", 3800, 0.35, 0.40, "partial"),
            ("34B", 1550, 0.32, 0.44, "full"), ("70B", 800, 0.34, 0.45, "full"))


def _ibm_h100_rows(a100_rows: list[dict]) -> list[dict]:
    by_size = {r["id"].split("_")[3]: r for r in a100_rows if r["id"].startswith("ibm_fsdp_llama2_")}
    out = []
    for size, tps, mfu, hfu, rec in IBM_H100:
        base = by_size[size]
        out.append({
            "id": f"ibm_fsdp_llama2_{size}_h100_96gpu", "family": "FSDP", "gpu": "h100",
            "source": {"title": base["source"]["title"], "location": "Table 1, H100 columns",
                       "url": base["source"].get("url")},
            "model": dict(base["model"]),
            "cluster": {"gpus": 96, "gpus_per_node": 8, "inter_node_GBps_per_gpu": 800 / 8 / 8},
            "layout": {"dp": 96, "tp": 1, "pp": 1, "micro_batch": 2, "global_batch": 192, "recompute": rec,
                       "reduce_bytes": REDUCE_BYTES, "autocast": "off"},
            "measured": {"metric": "tokens_per_s_per_gpu", "value": tps, "mfu": mfu, "hfu": hfu}})
    return out


#: Every row of llm-foundry's A100 80GB table (61 runs), of which the shared file holds 11
MPT_TABLE = ROOT / "benchmarks" / "data" / "mpt_a100_80gb.csv"

#: The rows of that table run on torch 1.13.1; the rest ran on 2.1.0 (``sharded_runtime``).  The
#: table at 061f2c7c is b2a43a147's re-run on the 2.1 image, but it keeps the two 70B rows of its
#: first revision, 300cc5c58 (2023-05-03): their figures equal that revision's to the last digit,
#: with its precision "bf16" and MP mode "PURE" (that revision's ``submit_benchmarks.py`` defaults,
#: ``--precisions bf16``, ``--fsdp_config_mixed_precision PURE``; no re-run row has them).  That
#: revision's ``sweep.sh`` submits both 70B runs with ``IMAGE="mosaicml/pytorch:1.13.1_cu117-
#: python3.10-ubuntu20.04"``, its ``setup.py`` pins ``torch==1.13.1``, and its README says "TODO:
#: Update tables with torch 2.0 after next Composer release".
MPT_TORCH_1_13 = frozenset({"mpt_a100_80gb_70b_seq2048_64gpu_mbs8", "mpt_a100_80gb_70b_seq2048_32gpu_mbs2"})


def mpt_torch(row_id: str) -> str:
    """The torch version a row of llm-foundry's A100 table ran on (``MPT_TORCH_1_13``)."""
    return "1.13.1" if row_id in MPT_TORCH_1_13 else "2.1.0"


def read_mpt_table(table: Path) -> list[dict]:
    """The records of one of the project's copies of an llm-foundry table (a CSV with # comments)."""
    import csv

    return list(csv.DictReader(ln for ln in table.read_text().splitlines() if not ln.startswith("#")))


def mpt_table_rows(rows: list[dict], table: Path = MPT_TABLE, records: list[dict] | None = None) -> list[dict]:
    """The rows of llm-foundry's A100 80GB table (``MPT_TABLE``; or ``records``, records of the
    table copied in ``table``) that ``rows`` do not hold, as rows of the project's copy: each size's
    dimensions from the held rows of that size, the run's sequence length, micro-batch, global
    batch, checkpointing and precision from the table, on nodes of 8 GPUs with 1600 Gb/s each.  A
    table row that ``rows`` already hold (by id) must agree with it on the measured figures."""
    held = {r["id"]: r for r in rows}
    by_size = {r["model"]["name"].split("-", 1)[1]: r for r in rows if r["model"].get("mpt")}
    out = []
    for t in read_mpt_table(table) if records is None else records:
        seq, gpus, mb = int(t["seq_len"]), int(t["gpus"]), int(t["micro_batch"])
        rid = f"mpt_a100_80gb_{t['size']}_seq{seq}_{gpus}gpu_mbs{mb}"
        measured = {"metric": "tokens_per_s_per_gpu", "value": int(t["tokens_per_s_per_gpu"]),
                    "mfu": float(t["mfu_pct"]) / 100, "hfu": float(t["hfu_pct"]) / 100}
        if rid in held:
            if held[rid]["measured"] != measured:
                raise SystemExit(f"{table.name}: row {rid} disagrees with the shared file's "
                                 f"({measured} against {held[rid]['measured']})")
            continue
        base = by_size[t["size"]]
        recompute = "full" if t["activation_checkpointing"] == "True" else "none"
        assert t["sharding"] == "FULL_SHARD" and gpus % 8 == 0, t
        out.append({
            "id": rid, "family": "FSDP", "gpu": "a100",
            "source": {**base["source"], "location": base["source"]["location"] + ", every row (benchmarks/data/"
                                                                                  + table.name + ")"},
            "model": {**base["model"], "seq_len": seq},
            "cluster": {"gpus": gpus, "gpus_per_node": 8, "inter_node_GBps_per_gpu": 1600 / 8 / 8},
            "layout": {"dp": gpus, "tp": 1, "pp": 1, "micro_batch": mb, "global_batch": int(t["global_batch"]),
                       "recompute": recompute, "reduce_bytes": REDUCE_BYTES,
                       "autocast": _autocast({"precision": f"{t['precision']} (MP mode {t['mp_mode']})"})},
            "measured": measured, "torch": mpt_torch(rid)})
    return out


def load_rows(path: Path = DATA) -> list[dict]:
    if not path.exists():
        raise SystemExit(f"{path} is missing; rebuild it with `python benchmarks/published_runs.py --refresh-data` "
                         f"(needs ../shared/validation/published_runs.json beside the repository).")
    rows = json.loads(path.read_text())["rows"]
    if path == DATA and LOCAL_DATA.exists():
        rows = rows + json.loads(LOCAL_DATA.read_text())["rows"]
    return rows


# --------------------------------------------------------------------- measured vs predicted
def megatron_eq3_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """FLOPs of one iteration with full recompute (Narayanan et al. 2021, Eq. 3):
    96 B s l h^2 (1 + s / (6 h) + V / (16 l h))."""
    return 96.0 * batch * seq * layers * hidden ** 2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def measured_step_s(row: dict) -> float:
    """The step time the row's measured throughput implies."""
    m, lay, gpus = row["model"], row["layout"], row["cluster"]["gpus"]
    meas = row["measured"]
    if meas["metric"] == "tflops_per_gpu_megatron_eq3":
        flops = megatron_eq3_flops(lay["global_batch"], m["seq_len"], m["layers"], m["hidden"], m["vocab"])
        return flops / (meas["value"] * 1e12 * gpus)
    if meas["metric"] == "tokens_per_s_per_gpu":
        return lay["global_batch"] * m["seq_len"] / (meas["value"] * gpus)
    raise ValueError(f"row {row['id']}: unknown metric {meas['metric']!r}")


def throughput_error(predicted_step_s: float, measured_step: float) -> float:
    """predicted throughput / measured throughput - 1."""
    return measured_step / predicted_step_s - 1.0


def summarize(errors: list[tuple[str, float]]) -> dict:
    """median |error|, mean signed error and the worst row of (id, error) pairs."""
    if not errors:
        return {"rows": 0}
    vals = [e for _, e in errors]
    worst = max(errors, key=lambda x: abs(x[1]))
    return {"rows": len(vals), "median_abs": statistics.median(abs(e) for e in vals),
            "mean_signed": sum(vals) / len(vals), "worst_id": worst[0], "worst": worst[1]}


def split_halves(rows: list[dict]) -> dict[str, str]:
    """id -> "A" or "B": within each family and GPU type, rows sorted by id, alternately A, B, A, ..."""
    out = {}
    for fam, gpu in sorted({(r["family"], r["gpu"]) for r in rows}):
        ids = sorted(r["id"] for r in rows if r["family"] == fam and r["gpu"] == gpu)
        for i, rid in enumerate(ids):
            out[rid] = "AB"[i % 2]
    return out


def family_table(results: list[dict], half: str | None = None, halves: dict | None = None) -> dict:
    """(family, gpu) -> summary over ``results`` (optionally one half only)."""
    groups: dict[tuple[str, str], list] = {}
    for r in results:
        if half is not None and halves[r["id"]] != half:
            continue
        groups.setdefault((r["family"], r["gpu"]), []).append((r["id"], r["error"]))
    return {f"{fam}/{gpu}": summarize(v) for (fam, gpu), v in sorted(groups.items())}


# ---------------------------------------------------------------------- pricing one row
def model_spec(row: dict) -> tuple[str, dict]:
    """(model file, model args) of the row: Llama rows on examples/llama.py, mixtures of experts
    (arch "moe") on examples/moe.py, GPT and MPT on gpt.py."""
    m = row["model"]
    if m["arch"] == "moe":
        return str(ROOT / "examples" / "moe.py"), {
            "layers": m["layers"], "hidden": m["hidden"], "heads": m["heads"], "kv_heads": m["kv_heads"],
            "head_dim": m.get("head_dim", 0), "experts": m["experts"], "top_k": m["top_k"],
            "expert_ffn": m["expert_ffn"], "shared_ffn": m.get("shared_ffn", 0),
            "dense_layers": m.get("dense_layers", 0), "dense_ffn": m.get("dense_ffn", m["expert_ffn"]),
            "qk_norm": int(bool(m.get("qk_norm"))), "seq": m["seq_len"], "vocab": m["vocab"], "dtype": "bfloat16"}
    if m["arch"] == "llama":
        return str(ROOT / "examples" / "llama.py"), {
            "layers": m["layers"], "hidden": m["hidden"], "heads": m["heads"], "kv_heads": m["kv_heads"],
            "ffn": m["ffn_hidden"], "seq": m["seq_len"], "vocab": m["vocab"], "dtype": "bfloat16"}
    args = {"layers": m["layers"], "hidden": m["hidden"], "heads": m["heads"], "seq": m["seq_len"],
            "vocab": m["vocab"]}
    if m.get("mpt"):
        # MPT: flash attention (one fused kernel), no dropout (llm-foundry's MPT yamls)
        args.update(attention="sdpa")
    else:
        # Megatron-LM's GPT in 2021: attention without flash attention, its scale, causal mask and
        # softmax one fused kernel (Narayanan et al. 2021, Sec. 4.2); dropout 0.1 (pretrain_gpt defaults)
        args.update(dropout=0.1, attention="megatron")
    return str(ROOT / "examples" / "gpt.py"), args


def row_cluster(row: dict):
    from autopar.core.cluster import Link, load_cluster

    c = row["cluster"]
    gpn = c["gpus_per_node"]
    nodes = max(1, c["gpus"] // gpn)
    cl = load_cluster(BASE_CLUSTER[row["gpu"]], nodes=nodes)
    if c.get("inter_node_GBps_per_gpu"):
        cl = replace(cl, inter_node=Link(c["inter_node_GBps_per_gpu"], cl.inter_node.latency_us))
    return cl


def row_plan(row: dict, graph, cluster):
    """The row's layout as a Plan.  A pipeline runs 1F1B, interleaved where the row has more than one
    model chunk per rank (``virtual_stages``: the PTD-P rows' from Megatron-LM's scripts, SC21_TABLE_1)."""
    from autopar.simulator.configure import config_plan

    lay = row["layout"]
    pp = lay["pp"]
    rec = lay["recompute"]
    v = lay.get("virtual_stages", 1)
    # the row's own ZeRO stage where it states one (the EP rows: 0, benchmarks/data/published_runs_cp_ep.json "about")
    zero = lay.get("zero", 3 if row["family"] in SHARDED_FAMILIES + ("AUTOPAR", "CP", "EP") else 0)
    # sequence parallelism where the row's code ran it (the 405B CP rows: torchtitan's apply_tp has no
    # TP without it; benchmarks/data/published_runs_cp_ep.json "about"); Megatron-LM of 2021 had none
    plan = config_plan(graph, degrees={"dp": lay["dp"], "tp": lay["tp"], "pp": pp, "cp": lay.get("cp", 1)},
                       micro_batch=lay["micro_batch"],
                       global_batch=lay["global_batch"], schedule="interleaved" if pp > 1 and v > 1 else "1f1b",
                       virtual_stages=v, zero=zero,
                       recompute={"full": "full", "partial": "full", "selective": "selective"}.get(rec, "none"),
                       offload="none",
                       precision="bf16", sequence_parallel=bool(lay.get("sequence_parallel", False)),
                       cluster_name=cluster.name)
    if rec == "partial":
        # checkpointing every n-th block: the fraction of blocks recomputed is what the row's
        # hardware over model FLOPs says, (hfu / mfu - 1) * 3 (a recomputed forward is 1/3 of a step)
        meas = row["measured"]
        frac = (meas["hfu"] / meas["mfu"] - 1.0) * 3.0
        blocks = [lp for lp in plan.layers if graph.layers[lp.layer].kind not in ("pre", "post")]
        every = max(1, round(1.0 / max(frac, 1e-9)))
        keep = {b.layer for i, b in enumerate(blocks) if i % every == 0}
        plan = replace(plan, layers=tuple(lp if lp.layer in keep or lp.recompute == "none"
                                          else replace(lp, recompute="none") for lp in plan.layers))
    if lay.get("ep", 1) > 1:
        plan = replace(plan, mesh=replace(plan.mesh, ep=lay["ep"]))
    if lay.get("compile"):             # regional torch.compile of every block (simulator/compile_fusion.py)
        plan = replace(plan, compile=True)
    if lay.get("float8"):              # torchao float8 linears in the blocks (simulator/float8.py)
        plan = replace(plan, layers=tuple(replace(lp, precision="fp8") if graph.layers[lp.layer].kind not in
                                          ("pre", "post") else lp for lp in plan.layers))
    return plan


def sharded_runtime(row: dict):
    """The sharded-data-parallel implementation a row's run used (simulator/sharded_dp.py, items 4
    and 5): the ZeRO-3 rows ran DeepSpeed of April 2021; the FSDP rows PyTorch's FSDP1
    (``FullyShardedDataParallel``) as torch 2 runs it -- fms-fsdp's on the nightlies after 2.2 (the
    IBM/Meta blog's training details), llm-foundry's MPT table on torch 2.1: the table of
    ``MPT_TABLE``'s revision was written by mosaicml/llm-foundry b2a43a147 (#543, 2023-10-19), whose
    ``scripts/train/benchmarking/sweep.sh`` submits the A100 80GB runs with ``--image $IMAGE``,
    ``IMAGE="mosaicml/pytorch:2.1.0_cu121-python3.10-ubuntu20.04"`` (four 7B lines name
    ``$IMAGE0`` / ``$IMAGE1``, set nowhere in the script; the table's earlier revisions,
    5f43bf16..c6cfb428, ran the 1.13.1 image and had other figures), but for its two 70B rows, kept
    from the 1.13.1 runs (``MPT_TORCH_1_13``) and priced as FSDP1 in torch 1.13, with its pad
    pass (item 5b).  FSDP1's terms priced here (item 5) are the same in 2.1 and 2.2 (the pad of
    item 5b went in November 2022, PR #88769).  PTD-P rows shard nothing (FSDP2, unused)."""
    from autopar.simulator.axes import sharded_dp

    if row["family"] == "ZeRO-3":
        return sharded_dp.DEEPSPEED_ZERO3_2021
    if row["family"] == "FSDP":
        return sharded_dp.FSDP1_TORCH_1_13 if _torch_1(row) else sharded_dp.FSDP1_TORCH_2_2
    return sharded_dp.FSDP2


def _torch_1(row: dict) -> bool:
    """Whether a row ran on torch 1.x (the rows of llm-foundry's table say which, ``MPT_TORCH_1_13``;
    fms-fsdp's ran on the nightlies after 2.2)."""
    return row.get("torch", "").startswith("1.")


def pipeline_runtime(family: str):
    """The pipeline exchange a family's runs used (simulator/pipeline_p2p.py): the PTD-P rows ran
    Megatron-LM of 2021 (blocking exchange, scatter/gather on); the others have no pipeline."""
    from autopar.simulator.axes import pp_p2p as pipeline_p2p

    return pipeline_p2p.MEGATRON_2021 if family == "PTD-P" else pipeline_p2p.TORCH_PIPELINING


def attention_kernel(row: dict) -> str:
    """The flash-attention kernel a row's run used (profile ``attention_kernels``): llm-foundry's MPT
    runs used ``attn_impl: triton`` (``submit_benchmarks.py`` default at b2a43a147, which the sweep
    does not override), i.e. ``llmfoundry/models/layers/flash_attn_triton.py``
    (``triton_flash_attn_fn``), a copy of flash-attention's own ``flash_attn_triton.py``.  No
    published benchmark times that kernel; its docstring says that its forward is generally faster
    and its backward slower than FlashAttention's CUDA kernel, forward and backward together
    "slightly slower" -- so it is priced at FlashAttention (v1)'s published rates (``flash``), the
    nearest measured figure, a little optimistic by its author's account.  (The "Triton" bars of the
    FlashAttention-2 paper time another kernel: OpenAI Triton's ``triton.ops.flash_attention``,
    ``attention_triton`` in flash-attention 4f285b35 ``benchmarks/benchmark_causal.py``; profile
    ``flash_triton``.)  fms-fsdp's runs used PyTorch's SDPA, FlashAttention-2 (the source's
    attention field).  Megatron-LM's 2021 rows run no fused attention (examples/gpt.py
    ``attention="megatron"``)."""
    from autopar.simulator.device.training_code import DEFAULT_ATTENTION_KERNEL

    return "flash" if row["model"].get("mpt") else DEFAULT_ATTENTION_KERNEL


def optimizer_runtime(row: dict):
    """The optimizer step a row's run used (simulator/optimizer_step.py): the PTD-P rows ran
    Megatron-LM of 2021 with --fp16 (fp32 main weights beside the fp16 model, gradients copied,
    unscaled and clipped around the Adam step), with its own DDP after the flush or torch's DDP
    overlapped with the last backward, as the row's script says (``layout.ddp``, SC21_TABLE_1);
    the FSDP rows' optimizers step the sharded fp32 or bf16 parameters themselves.  The ZeRO-3
    rows keep AdamW's price (DeepSpeed's fp16 ZeRO-3 optimizer of 2021 is not modelled here)."""
    from autopar.simulator.step import optimizer_step

    if row["family"] != "PTD-P":
        return optimizer_step.TORCH_ADAMW
    if row["layout"].get("ddp") == "torch":
        return optimizer_step.MEGATRON_FP16_TORCH_DDP_2021
    return optimizer_step.MEGATRON_FP16_2021


def recompute_early_stop(row: dict) -> bool:
    """Whether a row's activation checkpointing stops its recompute at the last saved tensor
    (simulator/layer_cost.py ``_recompute``): non-reentrant ``torch.utils.checkpoint`` on PyTorch
    2.1 or later does.  The FSDP rows ran it: llm-foundry's pretraining yamls at b2a43a147 set
    ``activation_checkpointing_reentrant: false`` (``scripts/train/yamls/pretrain/mpt-*.yaml``),
    which composer turns into ``checkpoint_wrapper(..., checkpoint_impl=CheckpointImpl.NO_REENTRANT)``
    (``composer/trainer/dist_strategy.py``), on torch 2.1; fms-fsdp 7746dac wraps its blocks the same
    way (``fms_fsdp/policies/ac_handler.py``) on the nightlies after 2.2.  Megatron-LM of 2021 (the
    PTD-P rows, and the Megatron-LM the ZeRO-3 rows ran under DeepSpeed) checkpoints with its own
    reentrant ``CheckpointFunction`` (NVIDIA/Megatron-LM 6985e58938 ``megatron/mpu/random.py``: the
    backward reruns the whole forward under ``enable_grad``).  The two 70B rows of llm-foundry's
    table ran torch 1.13.1 (``MPT_TORCH_1_13``), whose non-reentrant checkpoint reruns the whole
    forward: the early stop came with 2.1 (pytorch/pytorch PR #96866)."""
    return row["family"] == "FSDP" and not _torch_1(row)


def row_code(row: dict):
    """The training code a row's run used, as the simulator prices it (simulator/training_code.py):
    its sharded data parallelism, its gradients' reduce dtype, its exchange between pipeline
    stages, its optimizer step, its ops' dtypes, its attention kernel and its recompute.  The
    AUTOPAR rows are priced as autopar's own runtime, ``training_code.AUTOPAR``, but for the one
    place torchtitan's code differs from it: its op-level selective checkpointing recomputes every
    second matmul of a block (simulator/selective_mm_policy.py), where the runtime saves them all."""
    from autopar.simulator.device.training_code import AUTOPAR, TrainingCode

    if row["family"] == "AUTOPAR":
        return replace(AUTOPAR, selective_mm_policy=TORCHTITAN_SELECTIVE_MM_POLICY)
    if row["family"] == "EP":
        return megatron_core_moe_code(row)
    if row["family"] == "CP":
        # torchtitan's FSDP2 stack; its context parallelism is torch's ``context_parallel`` with the
        # all-gather rotation (torchtitan 9dec370 ``context_parallel_rotate_method = "allgather"``),
        # whose per-block SDPA keeps causality (no explicit mask): simulator/cp_cost.cp_attention_op;
        # with tp its loss runs on vocabulary-sharded logits (9dec370 parallel_dims.py
        # ``loss_parallel_enabled = tp > 1 and enable_loss_parallel``, on unless
        # --training.disable_loss_parallel; parallelize_llama.py keeps the head's output Shard(-1))
        return replace(AUTOPAR, selective_mm_policy=TORCHTITAN_SELECTIVE_MM_POLICY, cp_attention="causal_blocks",
                       loss_parallel=row["layout"]["tp"] > 1)

    family, lay = row["family"], row["layout"]
    return TrainingCode(sharded=sharded_runtime(row), reduce_bytes=lay["reduce_bytes"],
                        p2p=pipeline_runtime(family), optimizer=optimizer_runtime(row),
                        autocast=lay["autocast"], attention_kernel=attention_kernel(row),
                        recompute_early_stop=recompute_early_stop(row))


#: the busiest expert's tokens over the mean in Megatron Bridge's MoE benchmarks: its performance
#: summary's footnote says they force-balance the token distribution among experts, dropless
#: (NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md)
MBRIDGE_EXPERT_LOAD = 1.0

#: the token dispatcher each EP row's recipe ran (TrainingCode.ep_dispatch; NVIDIA-NeMo/Megatron-Bridge at
#: the container's release tag, docs/releases/software-versions.md and docs/versions1.json):
#: * 26.06 (v0.5.0) Qwen3: scripts/performance/configs/qwen/qwen3_llm_pretrain.py
#:   ``qwen3_30b_a3b_pretrain_config_h100`` sets ``moe_token_dispatcher_type = "flex"`` with
#:   qwen3_workload_base_configs.py's H100 ``moe_flex_dispatcher_backend="hybridep"`` (ep 16, no pp,
#:   ``moe_a2a_overlap=False``);
#: * 26.02.01 (v0.3.1) Qwen3: the same (commit f29a269f8, #2477, moved the H100 config to ep 16 with
#:   HybridEP); 26.02 (v0.3.0), whose pp 2 x vp 12 x ep 8 layout the table repeats, dispatched with
#:   flex/DeepEP too (the recipe's ``apply_flex_dispatcher_backend(model_cfg, "deepep")``), so either way "deepep";
#: * 25.11 (v0.2.0) Qwen3: no flex backend for the 30B (configs/qwen3/workload_base_configs.py), so the
#:   provider's ``moe_token_dispatcher_type = "alltoall"`` (src/megatron/bridge/models/qwen/qwen_provider.py);
#: * 26.04.01 (v0.4.2) GPT-OSS: the recipe sets ``"alltoall"`` (src/megatron/bridge/recipes/gpt_oss/
#:   gpt_oss.py), and scripts/performance/utils/overrides.py ``set_workload_base_configs`` (v0.4.2 and
#:   v0.5.0) applies a flex backend only where the perf config names one -- the H100 GPT-OSS config
#:   names none, so ``"alltoall"``; the Qwen3 H100 config names HybridEP, so flex.
MBRIDGE_DISPATCH = {"mbridge2606_qwen3_30b_a3b_16gpu_ep16": "deepep",
                    "mbridge2602p1_qwen3_30b_a3b_16gpu_pp2_vp12_ep8": "deepep",
                    "mbridge2511_qwen3_30b_a3b_16gpu_pp2_vp24_ep8_mbs2": "all_to_all",
                    "mbridge2604p1_gpt_oss_120b_64gpu_pp4_ep8": "all_to_all"}


def megatron_core_moe_code(row: dict):
    """The training code of the EP rows, Megatron Bridge's runs of Megatron-Core (2025-26):

    * pipeline exchange: Megatron-Core's ``p2p_communication`` posts ``batch_isend_irecv`` without
      a device synchronize and, with the interleaved schedule, overlaps it with the next chunk
      (``overlap_p2p_comm``); its scatter/gather across tensor-parallel ranks is gone -- the
      non-blocking exchange without scatter/gather that ``pipeline_p2p.TORCH_PIPELINING`` prices;
    * data parallelism: DDP with the distributed optimizer: gradients reduce-scattered in the row's
      dtype (bf16: the perf scripts' ``grad_reduce_in_fp32 = False``) and the updated parameters
      all-gathered once per step, overlapped with the backward -- priced as DDP's all-reduce, the
      same ring traffic (the row's ``zero`` 0; a plan's ZeRO-1 beside a pipeline would run as
      FSDP2 without reshard, whose reduce-scatters torch's schedules run once a step:
      core/rules.zero_stage_that_runs, simulator/pipeline_fsdp.py); AdamW
      (``optimizer_step.TORCH_ADAMW``), on every parameter rather than 1/dp of them;
    * no autocast: bf16 parameters (Megatron's ``--bf16``, fp32 main weights in the optimizer);
    * attention: Transformer Engine's fused attention, priced as FlashAttention-2;
    * routing: force-balanced (``MBRIDGE_EXPERT_LOAD``);
    * dispatch: the recipe's token dispatcher (``MBRIDGE_DISPATCH``: DeepEP/HybridEP's deduplicated
      exchange or the plain all-to-all);
    * optimizer state: sharded over each parameter's data-parallel ranks (the recipes'
      ``use_distributed_optimizer = True``: TrainingCode.distributed_optimizer), its traffic DDP's;
    * loss: Transformer Engine's fused cross entropy (the GPT provider's ``cross_entropy_loss_fusion
      = True`` and the performance scripts' ``cross_entropy_fusion_impl = "te"``:
      TrainingCode.fused_cross_entropy), no gradient pair at the loss's backward."""
    from autopar.simulator.step import optimizer_step
    from autopar.simulator.axes import pp_p2p as pipeline_p2p
    from autopar.simulator.device.training_code import DEFAULT_ATTENTION_KERNEL, TrainingCode

    return TrainingCode(reduce_bytes=row["layout"]["reduce_bytes"], p2p=pipeline_p2p.TORCH_PIPELINING,
                        optimizer=optimizer_step.TORCH_ADAMW, autocast=row["layout"]["autocast"],
                        attention_kernel=DEFAULT_ATTENTION_KERNEL, expert_load=MBRIDGE_EXPERT_LOAD,
                        ep_dispatch=MBRIDGE_DISPATCH.get(row["id"], "all_to_all"), distributed_optimizer=True,
                        fused_cross_entropy=True)


def price_row(row: dict, graph_cache: dict, calibration=None) -> dict:
    """The row priced as its own code ran it, with the fitted constants ``calibration``
    (simulator/calibration.py; None: the last fit, ``FITTED``)."""
    from autopar.core.capture import capture_model_file
    from autopar.simulator.device.calibration import FITTED
    from autopar.simulator.device.cost_model import CostModel
    from autopar.simulator.simulate import simulate_plan

    path, args = model_spec(row)
    mb = row["layout"]["micro_batch"]
    key = (path, tuple(sorted(args.items())), mb)
    if key not in graph_cache:
        graph_cache[key] = capture_model_file(path, args, mb)
    graph = graph_cache[key]
    cluster = row_cluster(row)
    code = row_code(row)                                        # priced as the run's own code ran it
    calibration = FITTED if calibration is None else calibration
    cms = {g.gpu: CostModel.from_profile(g.gpu).for_code(code).for_calibration(calibration) for g in cluster.groups}
    plan = row_plan(row, graph, cluster)
    res = simulate_plan(graph, plan, cluster, cms)
    meas = measured_step_s(row)
    out = {"id": row["id"], "family": row["family"], "gpu": row["gpu"], "predicted_step_s": res.step_time_s,
           "measured_step_s": meas, "error": throughput_error(res.step_time_s, meas), "fits": res.fits,
           "predicted_mfu": res.mfu, "predicted_peak_memory_gib": res.max_memory_bytes / 2**30}
    if plan.mesh.ep > 1:
        out["ep"] = plan.mesh.ep
    return out


# ------------------------------------------------------------------------------- fitting
#: the values of Calibration.nccl_overlap_slowdown (simulator/calibration.py) the fit tries
SLOWDOWN_GRID = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.9, 1.0)
#: the values of Calibration.sharded_ring_efficiency the fit tries; 0.85 is the profiles' all-reduce
#: figure (collective_efficiency.inter), i.e. no term
RING_GRID = (0.3, 0.33, 0.36, 0.39, 0.42, 0.45, 0.5, 0.6, 0.85)
SHARDED_FAMILIES = ("ZeRO-3", "FSDP")


def reads_ring_efficiency(row: dict) -> bool:
    """Whether a sharded row's price reads the ring efficiency rather than the overlap slowdown
    (simulator/sharded_dp.py ``network_paced``, items 2 and 6; the sharded rows run dp over all
    their GPUs, so their group spans nodes where the row does).  Every sharded row reads exactly
    one of the two constants, so each is priced once per value of its own constant."""
    from autopar.simulator.axes import sharded_dp

    c = row["cluster"]
    return sharded_dp.network_paced(sharded_runtime(row), "inter" if c["gpus"] > c["gpus_per_node"] else "intra")


#: what a fit minimises over the rows of its half (``fit_constants``): the median |error| is the
#: benchmark's criterion; the others are printed beside it to show how firmly a half's rows fix
#: the constants (least absolute deviations and least squares, the two textbook estimators)
LOSSES = {"median": lambda errors: statistics.median(abs(e) for e in errors),
          "absolute": lambda errors: statistics.fmean(abs(e) for e in errors),
          "squared": lambda errors: statistics.fmean(e * e for e in errors)}


def fit_constants(errors_by_value: dict, ids: set[str], loss: str = "median"):
    """The grid value (a number or a tuple of numbers) whose ``LOSSES[loss]`` over the errors of
    the rows ``ids`` is least (the smaller value on a tie)."""
    def score(v):
        return LOSSES[loss]([e for rid, e in errors_by_value[v] if rid in ids])
    return min(sorted(errors_by_value), key=score)


def cross_validate(rows: list[dict], halves: dict, cache: dict) -> tuple[list[str], dict]:
    """Fit the overlap slowdown and the ring efficiency together on each half's sharded rows,
    report the other half (and both).  Each grid value is priced with cost models of its own
    calibration (simulator/calibration.py); nothing is reassigned."""
    from dataclasses import replace

    from autopar.simulator.device.calibration import FITTED

    sharded = [r for r in rows if r["family"] in SHARDED_FAMILIES]
    ring_rows = [r for r in sharded if reads_ring_efficiency(r)]
    slow_rows = [r for r in sharded if not reads_ring_efficiency(r)]
    saved = FITTED.nccl_overlap_slowdown, FITTED.sharded_ring_efficiency
    by_slowdown = {v: [price_row(r, cache, replace(FITTED, nccl_overlap_slowdown=v)) for r in slow_rows]
                   for v in SLOWDOWN_GRID}
    by_ring = {v: [price_row(r, cache, replace(FITTED, sharded_ring_efficiency=v)) for r in ring_rows]
               for v in RING_GRID}
    results_by_pair = {(s, e): by_slowdown[s] + by_ring[e] for s in SLOWDOWN_GRID for e in RING_GRID}
    errors_by_pair = {k: [(r["id"], r["error"]) for r in v] for k, v in results_by_pair.items()}

    def table(pair, half):
        return family_table([dict(r, half=halves[r["id"]]) for r in results_by_pair[pair] if halves[r["id"]] == half])

    def fit_on(half, loss="median"):
        """(the pair fitted on ``half`` under ``loss``, the other half, its table there)"""
        pair = fit_constants(errors_by_pair, {r["id"] for r in sharded if halves[r["id"]] == half}, loss)
        other = "B" if half == "A" else "A"
        return pair, other, table(pair, other)

    lines, out = [], {}
    for fit_half in "AB":
        pair, test_half, held = fit_on(fit_half)
        fitted = table(pair, fit_half)
        out[f"fit_{fit_half}"] = {"slowdown": pair[0], "ring_efficiency": pair[1],
                                  "fitted_half": fitted, "held_back_half": held}
        lines += format_table(f"fitted on half {fit_half}: NCCL_OVERLAP_SLOWDOWN {pair[0]}, SHARDED_RING_EFFICIENCY "
                              f"{pair[1]}; fitted half {fit_half}:", fitted)
        lines += format_table(f"  ... held-back half {test_half}:", held)
    for key, name, pair in (
            ("without_the_ring_term", f"without the ring term (ring efficiency 0.85, the all-reduce figure), "
                                      f"slowdown {saved[0]}", (saved[0], 0.85)),
            ("without_the_overlap_slowdown", f"without the overlap slowdown (0.0), ring efficiency {saved[1]}",
             (0.0, saved[1])),
            ("without_either", "without either (slowdown 0.0, ring efficiency 0.85)", (0.0, 0.85))):
        for h in "AB":
            t = table(pair, h)
            out[f"{key}_{h}"] = t
            lines += format_table(f"{name}, half {h}:", t)
    lines.append("the same cross-fit under the other losses (LOSSES), held-back half only:")
    out["other_losses"] = {}
    for loss in ("absolute", "squared"):
        out["other_losses"][loss] = {}
        for fit_half in "AB":
            pair, test_half, held = fit_on(fit_half, loss)
            out["other_losses"][loss][f"fit_{fit_half}"] = {"slowdown": pair[0], "ring_efficiency": pair[1],
                                                           "held_back_half": held}
            lines += format_table(f"  {loss} loss, fitted on half {fit_half}: NCCL_OVERLAP_SLOWDOWN {pair[0]}, "
                                  f"SHARDED_RING_EFFICIENCY {pair[1]}; held-back half {test_half}:", held)
    pair = fit_constants(errors_by_pair, {r["id"] for r in sharded})
    out["fit_all"] = {"slowdown": pair[0], "ring_efficiency": pair[1]}
    lines.append(f"fitted on all sharded rows: NCCL_OVERLAP_SLOWDOWN {pair[0]}, SHARDED_RING_EFFICIENCY {pair[1]} "
                 f"(in the code: {saved[0]}, {saved[1]})")
    return lines, out


# ------------------------------------------------------------------------------- output
def format_table(title: str, table: dict) -> list[str]:
    lines = [title, f"  {'family/gpu':<22} {'rows':>4} {'median |err|':>12} {'mean signed':>11}  worst row"]
    for k, s in table.items():
        if not s["rows"]:
            continue
        lines.append(f"  {k:<22} {s['rows']:>4} {100 * s['median_abs']:>11.1f}% {100 * s['mean_signed']:>+10.1f}%  "
                     f"{s['worst_id']} ({100 * s['worst']:+.1f}%)")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=None, help="price only rows whose id contains this")
    ap.add_argument("--refresh-data", action="store_true", help="rebuild the project's copy from ../shared/validation")
    ap.add_argument("--fit", action="store_true",
                    help="also fit the overlap slowdown and the ring efficiency on each half and report the other")
    ap.add_argument("--shared", type=Path, default=SHARED, help=f"the shared validation file (default {SHARED})")
    ap.add_argument("--no-write", action="store_true", help="print only; leave benchmarks/results alone")
    args = ap.parse_args()
    if args.refresh_data:
        DATA.parent.mkdir(parents=True, exist_ok=True)
        DATA.write_text(json.dumps(copy_from_shared(args.shared), indent=1) + "\n")
        print(f"wrote {DATA.relative_to(ROOT)}")
    rows = load_rows()
    if args.only:
        rows = [r for r in rows if args.only in r["id"]]
    halves = split_halves(load_rows())
    cache: dict = {}
    results = []
    lines = [f"{'row':<42} {'half':>4} {'measured s':>10} {'predicted s':>11} {'error':>7}"]
    print(lines[0], flush=True)
    t0 = time.perf_counter()
    for row in rows:
        r = price_row(row, cache)
        r["half"] = halves[row["id"]]
        results.append(r)
        line = (f"{r['id']:<42} {r['half']:>4} {r['measured_step_s']:>10.3f} {r['predicted_step_s']:>11.3f} "
                f"{100 * r['error']:>+6.1f}%{'' if r['fits'] else '  (does not fit)'}")
        lines.append(line)
        print(line, flush=True)
    lines.append("")
    lines += format_table("All rows:", family_table(results))
    for h in "AB":
        lines += format_table(f"Half {h}:", family_table(results, h, halves))
    fit = None
    if args.fit:
        fit_lines, fit = cross_validate(rows, halves, cache)
        lines.append("")
        lines += fit_lines
    lines.append(f"({len(results)} rows in {time.perf_counter() - t0:.0f} s)")
    print("\n".join(lines[len(results) + 1:]))
    if not args.no_write and not args.only:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "published_runs.txt").write_text(f"$ python benchmarks/published_runs.py{' --fit' if args.fit else ''}\n" + "\n".join(lines) + "\n")
        out = {"command": "python benchmarks/published_runs.py", "error": "predicted throughput / measured - 1",
               "split": "within each family and GPU type, rows sorted by id, alternately A and B", "rows": results,
               "families": family_table(results),
               "halves": {h: family_table(results, h, halves) for h in "AB"}, "fit": fit}
        (RESULTS / "published_runs.json").write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
