"""Published runs with state on NVMe (ZeRO-Infinity, DeepSpeed's NVMe offload) and why none is priced yet.

``benchmarks/data/published_runs_nvme.json`` holds the runs as their sources state them.  For each
row this prints what its own figures fix, re-derived by hand (``checks``), and the reasons it is
not priced, each checked live against the project (``reason_holds``): a reason that no longer holds
-- a profile for the row's GPU was added, the NVMe tier learned to hold parameters -- is printed as
such, and the row is then due to be priced as ``benchmarks/published_runs.py`` prices the others.
Nothing here is a predicted-vs-measured error: no row is priced.  docs/validation.md "NVMe tier".

    python benchmarks/nvme_runs.py [--no-write]

Writes benchmarks/results/nvme_runs.txt.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "benchmarks" / "data" / "published_runs_nvme.json"
RESULTS = ROOT / "benchmarks" / "results"


def load_runs(path: Path = DATA) -> dict:
    return json.loads(path.read_text())


def gpt2_megatron_params(layers: int, hidden: int, vocab: int, seq_len: int) -> int:
    """Parameters of Megatron-LM v1.1.5's GPT-2 (DeepSpeedExamples Megatron-LM-v1.1.5-ZeRO3): per
    layer the QKV (3h^2 + 3h) and output (h^2 + h) projections, the 4h MLP (8h^2 + 5h) and two
    layernorms (4h) = 12 h^2 + 13 h; the word and position embeddings; the final layernorm (2h).
    Narayanan et al. 2021 (SC'21), Sec. 5.1 counts the same: 12 l h^2 (1 + 13/(12 h) + (V + s)/(12 l h))."""
    return 12 * layers * hidden * hidden + 13 * layers * hidden + (vocab + seq_len) * hidden + 2 * hidden


def megatron_zero3_tflops_per_gpu(params_B: float, batch_per_gpu: int, seq_len: int, iteration_s: float) -> float:
    """DeepSpeedExamples Megatron-LM-v1.1.5-ZeRO3 ``megatron/utils.py flops_calculator`` (bdf8e59a):
    P[B] x batch_size x seq_length x 2 x 4 / (iteration s x 1000), batch_size per GPU, no model parallelism."""
    return params_B * batch_per_gpu * seq_len * 2.0 * 4.0 / (iteration_s * 1000.0)


def checks(row: dict) -> list[tuple[str, float, float]]:
    """(what, the source's figure, the hand derivation) for what a row's own figures fix."""
    st, inf = row["stated"], row.get("inferred")
    out = []
    parts = [k for k in ("forward_ms", "backward_ms", "optimizer_ms", "batch_generator_ms") if k in st]
    if "iteration_ms" in st and parts:
        out.append(("iteration ms = " + " + ".join(p[:-3] for p in parts), st["iteration_ms"], sum(st[p] for p in parts)))
    if inf:
        p = gpt2_megatron_params(inf["layers"], inf["hidden"], inf["vocab_padded"], inf["seq_len"])
        out.append((f"parameters [B] of {inf['layers']} x {inf['hidden']}, vocab {inf['vocab_padded']}, "
                    f"seq {inf['seq_len']}", st["total_parameters_B"], round(p / 1e9, 3)))
        out.append((f"TFLOP/s per GPU at batch {inf['micro_batch']} x seq {inf['seq_len']}", st["tflops_per_gpu"],
                    round(megatron_zero3_tflops_per_gpu(st["total_parameters_B"], inf["micro_batch"], inf["seq_len"],
                                                        st["iteration_ms"] / 1000.0), 2)))
    return out


def reason_holds(reason: dict) -> bool:
    """Whether a reason a row is not priced still holds in the project as it is now."""
    if reason["check"] == "profile":
        from autopar.profiles import available_profiles

        return not any(reason["gpu"] in name for name in available_profiles())
    if reason["check"] == "tier_offloads":
        from autopar.simulator.axes import nvme_tier

        # the tier's swap is priced overlapped only (the runtime's read-ahead and background
        # write-back, simulator/axes/nvme_tier.py SWAP): DeepSpeed's serial swap has no term
        return nvme_tier.SWAP == "overlapped"
    return True                            # "stated": about what the source publishes


def report(runs: dict) -> list[str]:
    lines = []
    for r in runs["rows"]:
        src = r["source"]
        lines.append(f"{r['id']}  ({src['url']}, {src['location']})")
        st = r["stated"]
        lines.append(f"  stated: {st['gpus']} x {st['gpu']} on {st['nodes']} node(s), "
                     f"{st['tflops_per_gpu']} TFLOP/s per GPU")
        for what, stated, derived in checks(r):
            lines.append(f"  check: {what}: source {stated}, by hand {derived}")
        for reason in r["why_not_priced"]:
            lines.append(f"  not priced: {reason['what']} ({'holds' if reason_holds(reason) else 'NO LONGER HOLDS'})")
    lines.append(f"read, not runs to price: {', '.join(x['id'] for x in runs['read_but_not_runs'])}")
    lines.append(f"{len(runs['rows'])} rows, 0 priced (docs/validation.md 'NVMe tier')")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-write", action="store_true", help="print only; leave benchmarks/results alone")
    args = ap.parse_args()
    lines = report(load_runs())
    print("\n".join(lines))
    if not args.no_write:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "nvme_runs.txt").write_text("$ python benchmarks/nvme_runs.py\n" + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
