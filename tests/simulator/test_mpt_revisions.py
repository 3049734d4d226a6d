"""benchmarks/mpt_revisions.py: the pairs of runs of llm-foundry's MPT table before and after its
re-run on torch 2.1, against the README figures of both revisions by hand."""
from pathlib import Path

import pytest
from plain_loop import load          # a file loaded as a module once, cached in sys.modules

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    return load(ROOT / "benchmarks" / "mpt_revisions.py")


@pytest.fixture(scope="module")
def pairs(bench):
    pr = bench.pr
    return {new["id"]: (old, new) for old, new in
            bench.pairs(pr.read_mpt_table(bench.OLD_TABLE), pr.load_rows(), pr.read_mpt_table(pr.MPT_TABLE))}


def test_pairs_of_distinct_runs(bench, pairs):
    """Every layout both A100 80GB tables ran, less the two 70B runs the re-run table kept as they were
    (same figures to the last digit): 86 rows at 300cc5c58, 61 at 061f2c7c, 57 layouts in both."""
    old = bench.pr.read_mpt_table(bench.OLD_TABLE)
    assert len(old) == 86
    assert len(pairs) == 55
    assert not any("70b" in rid for rid in pairs)
    kept = [t for t in old if t["size"] == "70b" and t["gpus"] in ("32", "64")]
    assert [(t["tokens_per_s_per_gpu"], t["precision"], t["mp_mode"]) for t in kept] == [
        ("410", "bf16", "PURE"), ("373", "bf16", "PURE")]


def test_old_run_of_a_pair_from_the_readme(bench, pairs):
    """300cc5c58's row "30b | 2048 | 8 | a100_80gb | 47.57 | 63.43 | 3 | 21 | 504 | 3 | 6305 | 788 | ...
    | bf16 | PURE | FULL_SHARD | True" against 061f2c7c's "... | 55.3 | 73.74 | ... | 916 | ... |
    amp_bf16 | DEFAULT | ...": the step of each and the measured speed-up, by hand."""
    from autopar.simulator.axes import sharded_dp

    old, new = pairs["mpt_a100_80gb_30b_seq2048_8gpu_mbs3"]
    pr = bench.pr
    assert pr.measured_step_s(old) == pytest.approx(504 * 2048 / (788 * 8), rel=1e-12)
    assert pr.measured_step_s(new) == pytest.approx(504 * 2048 / (916 * 8), rel=1e-12)
    assert old["measured"]["mfu"] == pytest.approx(0.4757)
    # the old run is priced as 1.13.1's code: FSDP1 with its pad, bf16 parameters, no early stop
    code = pr.row_code(old)
    assert code.sharded is sharded_dp.FSDP1_TORCH_1_13 and not code.recompute_early_stop
    assert code.autocast == "low_params"
    new_code = pr.row_code(new)
    assert new_code.sharded is sharded_dp.FSDP1_TORCH_2_2 and new_code.recompute_early_stop
    assert new_code.autocast == "fp32_params"
    assert old["layout"]["micro_batch"] == new["layout"]["micro_batch"] == 3


def test_speedup_and_its_error(bench, pairs):
    """The measured speed-up is the throughput ratio of the two runs (the READMEs' 125m at 2048 on 8 GPUs,
    micro-batch 32: 140438 tokens/s a GPU at 300cc5c58, 141737 at 061f2c7c); the error compares the
    predicted ratio with it."""
    old, new = pairs["mpt_a100_80gb_125m_seq2048_8gpu_mbs32"]
    r = bench.speedups(old, new, {})
    t_old, t_new = old["measured"]["value"], new["measured"]["value"]
    assert (t_old, t_new) == (140438, 141737)
    assert r["measured"] == pytest.approx(141737 / 140438, rel=1e-12)
    assert r["error"] == pytest.approx(r["predicted"] / r["measured"] - 1.0, rel=1e-12)
    assert r["unchanged_error"] == pytest.approx(t_old / t_new - 1.0, rel=1e-12)
    assert not r["checkpointed"]


def test_runs_over_nodes_from_the_readme(bench):
    """The first revision's runs on 16-64 GPUs the re-run did not repeat: 8 sizes x 3 GPU counts,
    the 70B pair aside; "30b | 2048 | 64 | a100_80gb | 52.93 | 70.57 | 16 | 3 | 3072 | ... | 876 |
    ... | bf16 | PURE | FULL_SHARD | True" by hand, on 8 nodes of 8 GPUs."""
    pr = bench.pr
    rows = {r["id"]: r for r in bench.rows_over_nodes(pr.read_mpt_table(bench.OLD_TABLE), pr.load_rows())}
    assert len(rows) == 24 and not any("70b" in rid for rid in rows)
    row = rows["mpt_a100_80gb_30b_seq2048_64gpu_mbs16_torch113"]
    assert row["torch"] == "1.13.1" and row["layout"]["autocast"] == "low_params"
    assert (row["cluster"]["gpus"], row["cluster"]["gpus_per_node"]) == (64, 8)
    assert row["layout"]["recompute"] == "full" and row["layout"]["global_batch"] == 3072
    assert row["model"]["hidden"] == 7168 and row["model"]["layers"] == 48
    assert pr.measured_step_s(row) == pytest.approx(3072 * 2048 / (876 * 64), rel=1e-12)
