"""Published runs with PowerSGD-compressed gradients (torch's DDP hook), priced as their software
ran, with the error of each.

``benchmarks/data/published_runs_compression.json`` holds the runs as their source states them
(pytorch/pytorch issue #74148: ResNet-50 on nodes of two V100 32GB joined at 3 Gbit/s, torch 1.10's
``powerSGD_hook``, speed-up over one card on 4, 6 and 8 cards) with what the source leaves out
and is assumed (``assumed``: micro-batch, rank, precision, links).  Each row is priced through
the simulator (benchmarks/price_layout.py): the step of DDP with the hook on N GPUs and the step
of one GPU on the same node type, predicted speed-up = N x one GPU's step / N GPUs' step.  Error
= predicted speed-up / published - 1 (positive: the simulator promises more).  The same rows at
the other micro-batch the sources allow are printed beside them, and the predicted speed-up of
uncompressed DDP, so the effect of the assumptions and of the compression shows.
docs/validation.md "Gradient compression".

    python benchmarks/grad_compression_runs.py [--no-write]

Writes benchmarks/results/grad_compression_runs.{txt,json}.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))      # price_layout.py beside this file
DATA = ROOT / "benchmarks" / "data" / "published_runs_compression.json"
#: the micro-batch pytorch/examples imagenet/main.py gives each of a node's 2 GPUs (256 per node)
OTHER_MICRO_BATCH = 128


def load_runs(path: Path = DATA) -> dict:
    return json.loads(path.read_text())


def predicted_speedup(common: dict, gpus: int, micro_batch: int, graph_cache: dict,
                      grad_compression: str | None = None) -> tuple[float, float, float]:
    """(speed-up, one GPU's step s, N GPUs' step s) of ``common["priced_as"]`` on ``gpus`` GPUs
    at ``micro_batch`` per GPU (``grad_compression``: the row's unless given)."""
    from price_layout import price, row_cluster

    how = common["priced_as"]
    gpn = common["stated"]["gpus_per_node"]
    lay = dict(how["layout"], micro_batch=micro_batch)
    if grad_compression is not None:
        lay["grad_compression"] = grad_compression
    one = price(how["model"], row_cluster(how["cluster"], 1, gpus_per_node=1),
                dict(lay, dp=1, global_batch=micro_batch, grad_compression="none"), how["code"], graph_cache)
    many = price(how["model"], row_cluster(how["cluster"], gpus // gpn), dict(lay, dp=gpus, global_batch=gpus * micro_batch),
                 how["code"], graph_cache)
    return gpus * one.step_time_s / many.step_time_s, one.step_time_s, many.step_time_s


def price_row(row: dict, common: dict, graph_cache: dict, micro_batch: int | None = None) -> dict:
    from price_layout import ratio_error

    mb = micro_batch or common["assumed"]["micro_batch"]["value"]
    sp, t1, tn = predicted_speedup(common, row["gpus"], mb, graph_cache)
    plain, _, _ = predicted_speedup(common, row["gpus"], mb, graph_cache, grad_compression="none")
    return {"id": row["id"], "gpus": row["gpus"], "micro_batch": mb, "published_speedup": row["published_speedup"],
            "predicted_speedup": sp, "error": ratio_error(sp, row["published_speedup"]),
            "one_gpu_step_s": t1, "step_s": tn, "predicted_speedup_uncompressed": plain}


def report(runs: dict, graph_cache: dict | None = None) -> tuple[list[str], list[dict]]:
    """The printed lines and the priced rows' results (the assumed micro-batch first, then the other)."""
    graph_cache = {} if graph_cache is None else graph_cache
    common = runs["common"]
    src = common["source"]
    lines = [f"{src['url']} ({src['location']}): {common['stated']['model']} on {common['stated']['gpu']}, "
             f"{common['stated']['gpus_per_node']} per node, {common['stated']['inter_node']}, torch {common['stated']['torch']}",
             "assumed: " + "; ".join(f"{k} {v['value']}" for k, v in common["assumed"].items() if "value" in v),
             f"{'row':<40} {'mb':>4} {'published':>9} {'predicted':>9} {'error':>7} {'1-GPU step s':>12} "
             f"{'N-GPU step s':>12} {'uncompressed':>12}"]
    results = []
    for mb in (common["assumed"]["micro_batch"]["value"], OTHER_MICRO_BATCH):
        for row in runs["rows"]:
            p = price_row(row, common, graph_cache, mb)
            results.append(p)
            lines.append(f"{p['id']:<40} {mb:>4} {p['published_speedup']:>9.2f} {p['predicted_speedup']:>9.2f} "
                         f"{100 * p['error']:>+6.1f}% {p['one_gpu_step_s']:>12.4f} {p['step_s']:>12.4f} "
                         f"{p['predicted_speedup_uncompressed']:>12.2f}")
    for x in runs["not_priced"]:
        lines.append(f"not priced: {x['id']} (published {x['published_speedup']}): {x['why']}")
    lines.append(f"read, not runs to price: {', '.join(x['id'] for x in runs['read_but_not_runs'])}")
    lines.append(f"{len(runs['rows'])} rows priced (at micro-batch {common['assumed']['micro_batch']['value']}, the "
                 f"assumed one; {OTHER_MICRO_BATCH} beside it); error = predicted speed-up / published - 1; "
                 f"'uncompressed': DDP's predicted speed-up without the hook (docs/validation.md 'Gradient compression')")
    return lines, results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-write", action="store_true", help="print only; leave benchmarks/results alone")
    args = ap.parse_args()
    lines, results = report(load_runs())
    print("\n".join(lines))
    if not args.no_write:
        from price_layout import write_results

        write_results("grad_compression_runs", lines, results, "predicted speed-up / published speed-up - 1")
    return 0


if __name__ == "__main__":
    sys.exit(main())
