"""The simulator against one software upgrade: llm-foundry's MPT table on torch 1.13.1 and on 2.1.0.

llm-foundry's A100 80GB table was first published from runs on torch 1.13.1 (300cc5c58,
2023-05-03; benchmarks/data/mpt_a100_80gb_torch113.csv) and re-run on torch 2.1.0 by b2a43a147
(2023-10-19; benchmarks/data/mpt_a100_80gb.csv, the rows of benchmarks/published_runs.py).  Most
layouts (model, sequence, GPUs, micro-batch, accumulation) appear in both, so each such pair
measures what the software change alone did to the same training job on the same kind of node.

The simulator prices both runs of a pair as each revision's code ran them
(benchmarks/published_runs.py ``row_code``): on 1.13.1, FSDP1 with its pad pass
(simulator/sharded_dp.py item 5b), composer's PURE mixed precision (bf16 parameters under
autocast), and a non-reentrant checkpoint that reruns the whole forward; on 2.1.0, FSDP1 without
the pad, DEFAULT mixed precision (fp32 parameters under autocast: simulator/autocast.py) and a
checkpoint that stops at the last saved tensor (simulator/layer_cost.py ``_recompute``).  It
prints, per pair, the measured speed-up (2.1.0 throughput over 1.13.1's) beside the predicted
one, and the median |error| and mean signed error of the predicted speed-up, for checkpointed and
not checkpointed pairs, against the same figures for "no change" (a speed-up of 1); then each
run's own throughput error.  Nothing is fitted here: the constants are the ones
published_runs.py reports, and the 1.13.1 runs are in none of its halves.

A pair whose two runs have the same figures to the last digit is one run kept in both revisions
(the 70B rows, ``published_runs.MPT_TORCH_1_13``) and is left out.

Writes benchmarks/results/mpt_revisions.txt.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import published_runs as pr  # noqa: E402

OLD_TABLE = pr.ROOT / "benchmarks" / "data" / "mpt_a100_80gb_torch113.csv"
RESULTS = pr.RESULTS / "mpt_revisions.txt"


def _key(t: dict) -> tuple:
    return t["size"], int(t["seq_len"]), int(t["gpus"]), int(t["micro_batch"]), int(t["grad_accum"])


FIGURES = ("mfu_pct", "hfu_pct", "tokens_per_s_per_gpu")


def torch113_rows(records: list[dict], new_rows: list[dict]) -> list[dict]:
    """Records of the 1.13.1 table as rows, built as published_runs builds the re-run table's
    (``mpt_table_rows``: each size's dimensions from the project's copy, the record's layout,
    precision and figures, nodes of 8 GPUs with 1600 Gb/s -- the heading the re-run table files the
    kept 70B runs under; the first revision names no network), on torch 1.13.1."""
    bases = {}
    for r in new_rows:
        if r["model"].get("mpt"):
            bases.setdefault(r["model"]["name"], {**r, "id": "base_" + r["id"]})
    rows = pr.mpt_table_rows(list(bases.values()), OLD_TABLE, records=records)
    return [{**r, "id": r["id"] + "_torch113", "torch": "1.13.1"} for r in rows]


def pairs(old: list[dict], new_rows: list[dict], new_table: list[dict]) -> list[tuple[dict, dict]]:
    """(1.13.1 row, 2.1.0 row) for every layout both tables ran as a distinct run: the 2.1.0 row
    from the project's copy of the published runs, the 1.13.1 row from the old run's record
    (``torch113_rows``); the two share their layout but for the precision."""
    by_id = {r["id"]: r for r in new_rows}
    new_by_key = {_key(t): t for t in new_table}
    paired = [t for t in old if _key(t) in new_by_key and any(new_by_key[_key(t)][f] != t[f] for f in FIGURES)]
    out = []
    for old_row in torch113_rows(paired, new_rows):
        new = by_id[old_row["id"].removesuffix("_torch113")]
        assert new.get("torch") == "2.1.0", new["id"]
        assert ({**old_row["layout"], "autocast": None} == {**new["layout"], "autocast": None}
                and old_row["model"] == new["model"] and old_row["cluster"] == new["cluster"]), new["id"]
        out.append((old_row, new))
    return out


def rows_over_nodes(old: list[dict], new_rows: list[dict]) -> list[dict]:
    """The 1.13.1 table's runs on 16-64 GPUs that the 2.1 re-run did not repeat (the 70B pair aside,
    which benchmarks/published_runs.py prices), as rows (``torch113_rows``)."""
    return torch113_rows([t for t in old if int(t["gpus"]) > 8 and t["size"] != "70b"], new_rows)


def speedups(old_row: dict, new_row: dict, cache: dict) -> dict:
    """Measured and predicted speed-up of the 2.1.0 run over the 1.13.1 run of one layout."""
    po, pn = pr.price_row(old_row, cache), pr.price_row(new_row, cache)
    measured = pr.measured_step_s(old_row) / pr.measured_step_s(new_row)
    predicted = po["predicted_step_s"] / pn["predicted_step_s"]
    return {"id": new_row["id"], "checkpointed": new_row["layout"]["recompute"] != "none",
            "measured": measured, "predicted": predicted, "error": predicted / measured - 1.0,
            "unchanged_error": 1.0 / measured - 1.0, "old_error": po["error"], "new_error": pn["error"]}


def summary(errs: list[float]) -> str:
    if not errs:
        return "no pairs"
    return (f"median |error| {100 * statistics.median(abs(e) for e in errs):4.1f}%, "
            f"mean signed {100 * statistics.fmean(errs):+5.1f}%")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-write", action="store_true", help="print only; leave benchmarks/results alone")
    args = ap.parse_args()
    todo = pairs(pr.read_mpt_table(OLD_TABLE), pr.load_rows(), pr.read_mpt_table(pr.MPT_TABLE))
    cache: dict = {}
    t0 = time.perf_counter()
    lines = [f"{'layout (2.1.0 row id)':<42} {'ckpt':>4} {'measured':>8} {'predicted':>9} {'error':>7}"
             f"   {'1.13.1 run':>10} {'2.1.0 run':>9}"]
    print(lines[0], flush=True)
    results = []
    for old_row, new_row in todo:
        r = speedups(old_row, new_row, cache)
        results.append(r)
        lines.append(f"{r['id']:<42} {'yes' if r['checkpointed'] else 'no':>4} {r['measured']:>8.3f} "
                     f"{r['predicted']:>9.3f} {100 * r['error']:>+6.1f}%   {100 * r['old_error']:>+9.1f}% "
                     f"{100 * r['new_error']:>+8.1f}%")
        print(lines[-1], flush=True)
    lines.append("")
    lines.append("speed-up of 2.1.0 over 1.13.1 (throughput ratio); error = predicted / measured - 1")
    for label, sel in (("checkpointed", True), ("not checkpointed", False)):
        sub = [r for r in results if r["checkpointed"] == sel]
        lines.append(f"  {label:<17} {len(sub):>3} pairs: simulator {summary([r['error'] for r in sub])};"
                     f"  no change (1.0): {summary([r['unchanged_error'] for r in sub])}")
    lines.append(f"  {'all':<17} {len(results):>3} pairs: simulator {summary([r['error'] for r in results])};"
                 f"  no change (1.0): {summary([r['unchanged_error'] for r in results])}")
    lines.append("each run priced on its own (throughput error, as benchmarks/published_runs.py):")
    for label, key in (("1.13.1 runs", "old_error"), ("2.1.0 runs", "new_error")):
        lines.append(f"  {label:<17} {len(results):>3} runs:  {summary([r[key] for r in results])}")
    lines.append("")
    lines.append(f"{'1.13.1 runs over nodes':<42} {'ckpt':>4} {'measured s':>10} {'predicted s':>11} {'error':>7}")
    over = []
    for row in rows_over_nodes(pr.read_mpt_table(OLD_TABLE), pr.load_rows()):
        r = pr.price_row(row, cache)
        over.append(r["error"])
        lines.append(f"{row['id']:<42} {'yes' if row['layout']['recompute'] != 'none' else 'no':>4} "
                     f"{r['measured_step_s']:>10.3f} {r['predicted_step_s']:>11.3f} {100 * r['error']:>+6.1f}%")
        print(lines[-1], flush=True)
    lines.append(f"  {'over nodes':<17} {len(over):>3} runs:  {summary(over)}")
    lines.append(f"({2 * len(results) + len(over)} runs priced in {time.perf_counter() - t0:.0f} s)")
    print("\n".join(lines[len(results) + 1:len(results) + 10]))
    print(lines[-2])
    if not args.no_write:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text("$ python benchmarks/mpt_revisions.py\n" + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
