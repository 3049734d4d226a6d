"""Published runs with state on NVMe (ZeRO-Infinity, DeepSpeed's NVMe offload), priced as their
software ran, with the error of each.

``benchmarks/data/published_runs_nvme.json`` holds the runs as their sources state them.  For each
row this prints what its own figures fix, re-derived by hand (``checks``).  A row with
``priced_as`` (model, cluster file, layout, training code) -- every row now -- is priced through
the simulator (benchmarks/price_layout.py) and printed beside the published iteration time and
TFLOP/s per GPU, with the error (predicted throughput / published - 1) and the mechanisms of the
run the price has no term for (``not_modelled``).  docs/validation.md "NVMe tier".

    python benchmarks/nvme_runs.py [--no-write]

Writes benchmarks/results/nvme_runs.txt.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))      # price_layout.py beside this file
DATA = ROOT / "benchmarks" / "data" / "published_runs_nvme.json"


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
    if inf and "total_parameters_B" in st and "iteration_ms" in st:      # a log that prints both
        p = gpt2_megatron_params(inf["layers"], inf["hidden"], inf["vocab_padded"], inf["seq_len"])
        out.append((f"parameters [B] of {inf['layers']} x {inf['hidden']}, vocab {inf['vocab_padded']}, "
                    f"seq {inf['seq_len']}", st["total_parameters_B"], round(p / 1e9, 3)))
        out.append((f"TFLOP/s per GPU at batch {inf['micro_batch']} x seq {inf['seq_len']}", st["tflops_per_gpu"],
                    round(megatron_zero3_tflops_per_gpu(st["total_parameters_B"], inf["micro_batch"], inf["seq_len"],
                                                        st["iteration_ms"] / 1000.0), 2)))
    return out


#: a step's phases as DeepSpeedExamples' Megatron log times them (forward, backward, optimizer)
PHASES = ("forward_s", "backward_s", "optimizer_s")


def price_row(row: dict, graph_cache: dict) -> dict:
    """The row priced as ``priced_as`` says its software ran: predicted iteration seconds, the
    TFLOP/s per GPU the run's own formula gives at that iteration (``megatron_zero3_tflops_per_gpu``),
    the error against the published iteration, and whether the plan fits each memory tier."""
    from price_layout import price, row_cluster, step_phases, ratio_error

    how, st, inf = row["priced_as"], row["stated"], row["inferred"]
    res = price(how["model"], row_cluster(how["cluster"], st["nodes"]), how["layout"], how["code"], graph_cache,
                timeline=True)
    params_B = st.get("total_parameters_B") or round(
        gpt2_megatron_params(inf["layers"], inf["hidden"], inf["vocab_padded"], inf["seq_len"]) / 1e9, 3)
    # the published iteration: the log's where it prints one, else the one its TFLOP/s stands for
    # under the code's own formula (megatron_zero3_tflops_per_gpu solved for the iteration)
    published_s = (st["iteration_ms"] / 1000.0 if "iteration_ms" in st else
                   params_B * inf["micro_batch"] * inf["seq_len"] * 8.0 / (st["tflops_per_gpu"] * 1000.0))
    return {"id": row["id"], "published_iteration_s": published_s, "predicted_iteration_s": res.step_time_s,
            "iteration_from_tflops": "iteration_ms" not in st, "published_tflops_per_gpu": st["tflops_per_gpu"],
            "predicted_tflops_per_gpu": megatron_zero3_tflops_per_gpu(params_B, inf["micro_batch"],
                                                                      inf["seq_len"], res.step_time_s),
            "error": ratio_error(1.0 / res.step_time_s, 1.0 / published_s),
            "fits": {"device": bool(res.device_fits), "host": bool(res.host_fits), "nvme": bool(res.nvme_fits)},
            "device_GiB": res.max_memory_bytes / 2**30, "device_capacity_GiB": res.capacity_bytes / 2**30,
            "nvme_GB_per_node": res.nvme_bytes_per_node / 1e9, "predicted_phases_s": step_phases(res),
            "published_phases_s": {k: st[k[:-2] + "_ms"] / 1000.0 for k in PHASES if k[:-2] + "_ms" in st}}


def report(runs: dict, graph_cache: dict | None = None) -> tuple[list[str], list[dict]]:
    """The printed lines and the priced rows' results."""
    graph_cache = {} if graph_cache is None else graph_cache
    lines, priced = [], []
    for r in runs["rows"]:
        src = r["source"]
        lines.append(f"{r['id']}  ({src['url']}, {src['location']})")
        st = r["stated"]
        lines.append(f"  stated: {st['gpus']} x {st['gpu']} on {st['nodes']} node(s), "
                     f"{st['tflops_per_gpu']} TFLOP/s per GPU")
        for what, stated, derived in checks(r):
            lines.append(f"  check: {what}: source {stated}, by hand {derived}")
        if "priced_as" in r:
            p = price_row(r, graph_cache)
            priced.append(p)
            fits = ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in p["fits"].items())
            derived = " (from its TFLOP/s)" if p["iteration_from_tflops"] else ""
            lines.append(f"  priced: iteration {p['predicted_iteration_s']:.1f} s predicted, {p['published_iteration_s']:.1f} s "
                         f"published{derived}; TFLOP/s per GPU {p['predicted_tflops_per_gpu']:.2f} predicted, "
                         f"{p['published_tflops_per_gpu']} published; error {100 * p['error']:+.1f}%")
            lines.append("  phases, predicted (published): " + ", ".join(
                f"{k[:-2]} {p['predicted_phases_s'][k]:.1f} s"
                + (f" ({p['published_phases_s'][k]:.1f})" if k in p["published_phases_s"] else "") for k in PHASES))
            lines.append(f"  fits: {fits} (device {p['device_GiB']:.1f} of {p['device_capacity_GiB']:.1f} GiB; "
                         f"NVMe {p['nvme_GB_per_node']:.0f} GB per node)")
            for m in r["not_modelled"]:
                lines.append(f"  not modelled: {m['what']}")
    lines.append(f"read, not runs to price: {', '.join(x['id'] for x in runs['read_but_not_runs'])}")
    lines.append(f"{len(runs['rows'])} rows, {len(priced)} priced; error = predicted throughput / published - 1 "
                 f"(docs/validation.md 'NVMe tier')")
    return lines, priced


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-write", action="store_true", help="print only; leave benchmarks/results alone")
    args = ap.parse_args()
    lines, priced = report(load_runs())
    print("\n".join(lines))
    if not args.no_write:
        from price_layout import write_results

        write_results("nvme_runs", lines, priced, "predicted throughput / published - 1")
    return 0


if __name__ == "__main__":
    sys.exit(main())
