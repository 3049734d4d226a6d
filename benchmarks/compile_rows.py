"""Price torchtitan's Table 1 rows (Llama 3.1 8B on 8 H100, FSDP2, selective recompute,
micro-batch 2, sequence 8192) eager and compiled, with the simulator's compile term
(simulator/compile_fusion.py), and print the predicted speed-up against the measured one.

    python benchmarks/compile_rows.py

Measured (../shared/validation/published_runs.json, torchtitan benchmark end of 2024, Table 1):
eager 5,762, compiled 6,667 (+15.7%), compiled + float8 linears 8,532 (+48.1%) tokens/s/GPU.
Float8 is priced with simulator/float8.py's tensorwise recipe on the blocks' linears, with
FSDP2's fp8 all-gather of their weights (torchtitan's float8 rows ran tensorwise with
enable_fsdp_float8_all_gather).  The rows themselves are benchmarks/
published_runs.py's (priced there with the project's fitted terms); this script isolates what
the compile flag changes in the same plan on the stock H100 profile.
"""
from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED = next((p for p in (ROOT.parent / "shared", ROOT.parent.parent / "shared") if p.is_dir()),
              ROOT.parent / "shared") / "validation" / "published_runs.json"   # beside the repo or its worktrees
ROW_IDS = ("torchtitan24_8b_8gpu_FSDP", "torchtitan24_8b_8gpu_FSDP_torchcompile",
           "torchtitan24_8b_8gpu_FSDP_torchcompile_Float8")


def measured() -> dict[str, float]:
    rows = {r["id"]: r for r in json.loads(SHARED.read_text())["rows"]} if SHARED.exists() else {}
    return {i: rows[i]["metrics"]["tokens_per_sec"]["value"] for i in ROW_IDS if i in rows}


def price(micro_batch: int = 2, seq: int = 8192, layers: int = 32) -> dict:
    from autopar.core.capture import capture_model_file
    from autopar.core.cluster_file import load_cluster
    from autopar.simulator.configure import config_plan
    from autopar.simulator.device.cost_model import CostModel
    from autopar.simulator.simulate import simulate_plan

    # Llama 3 8B (Llama Team 2024, Table 3), as torchtitan's run: bf16, sequence 8192
    args = {"size": "llama3-8b", "layers": layers, "seq": seq, "dtype": "bfloat16"}
    graph = capture_model_file(str(ROOT / "examples" / "llama.py"), args, micro_batch)
    cluster = load_cluster("h100-16x8", nodes=1)
    cms = {g.gpu: CostModel.from_profile(g.gpu) for g in cluster.groups}
    eager = config_plan(graph, degrees={"dp": 8, "tp": 1, "pp": 1},
                        micro_batch=micro_batch, global_batch=8 * micro_batch,
                        schedule="1f1b", virtual_stages=1, zero=3, recompute="selective", offload="none",
                        precision="bf16", sequence_parallel=False, cluster_name=cluster.name)
    out = {}
    fp8_layers = tuple(replace(lp, precision="fp8") if graph.layers[lp.layer].kind not in ("pre", "post") else lp
                       for lp in eager.layers)
    for name, plan in (("eager", eager), ("compile", replace(eager, compile=True)),
                       ("compile_float8", replace(eager, compile=True, layers=fp8_layers))):
        r = simulate_plan(graph, plan, cluster, cms)
        out[name] = {"step_s": r.step_time_s, "tokens_per_s_per_gpu": 8 * micro_batch * seq / r.step_time_s / 8}
    return out


def main() -> int:
    got = price()
    meas = measured()
    e = got["eager"]["tokens_per_s_per_gpu"]
    c, f = got["compile"]["tokens_per_s_per_gpu"], got["compile_float8"]["tokens_per_s_per_gpu"]
    print(f"predicted: eager {e:.0f}, compile {c:.0f} ({c / e - 1:+.1%}), compile + float8 {f:.0f} ({f / e - 1:+.1%}) "
          f"tokens/s/GPU")
    if len(meas) == 3:
        e, c, f = (meas[i] for i in ROW_IDS)
        print(f"measured:  eager {e:.0f}, compile {c:.0f} ({c / e - 1:+.1%}), compile + float8 {f:.0f} "
              f"({f / e - 1:+.1%}) tokens/s/GPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
