"""Figures print in the unit that shows them (core/units.py), in the CLIs' summaries too (issue 32:
a small model printed "0.0 GiB" in every column and "0 TFLOP/s")."""
import pytest

from autopar.core.units import byte_unit, fmt_bytes, fmt_count, fmt_flop_rate, fmt_flops, fmt_in


@pytest.mark.parametrize("n,text", [
    (0, "0 B"), (512, "512 B"), (1023, "1023 B"), (1024, "1.00 KiB"),
    (8.2 * 1024, "8.20 KiB"), (281.9 * 1024, "282 KiB"), (1023 * 1024, "1023 KiB"),
    (134 * 2**20, "134 MiB"), (80 * 2**30, "80.0 GiB"), (2.5 * 2**40, "2.50 TiB"), (-3 * 2**20, "-3.00 MiB"),
])
def test_bytes_in_binary_units(n, text):
    assert fmt_bytes(n) == text


@pytest.mark.parametrize("rate,text", [
    (0, "0 FLOP/s"), (97.6e6, "97.6 MFLOP/s"), (1.2e9, "1.20 GFLOP/s"), (148e12, "148 TFLOP/s"),
    (989.4e12, "989 TFLOP/s"), (1.979e15, "1.98 PFLOP/s"),
])
def test_flop_rates_in_decimal_units(rate, text):
    assert fmt_flop_rate(rate) == text


def test_flops_and_counts():
    assert fmt_flops(2.5e9) == "2.50 GFLOP"
    assert fmt_count(175.0e9) == "175B" and fmt_count(1280) == "1.28K" and fmt_count(512) == "512"


def test_a_table_unit_shows_its_largest_figure():
    assert byte_unit(0) == ("B", 1.0)
    assert byte_unit(227 * 1024) == ("KiB", 1024.0)
    assert byte_unit(70 * 2**30) == ("GiB", float(2**30))
    unit, scale = byte_unit(227 * 1024)
    assert [fmt_in(x, scale) for x in (227 * 1024, 40.9 * 1024, 512, 0)] == ["227", "40.9", "0.50", "0"]


def test_simulate_prints_a_small_model_in_kib(capsys):
    """`autopar simulate` on a model of ~20 K parameters: the memory table in KiB, rates in MFLOP/s or
    GFLOP/s -- never the "0.00" GiB / "0.0" TFLOP/s that hid every figure."""
    from pathlib import Path

    from autopar.cli import main

    model = Path(__file__).resolve().parents[1] / "zoo" / "tied_lm.py"
    rc = main(["simulate", str(model), "--cluster", "local-cpu", "--dp", "2", "--pp", "2", "--global-batch", "8",
               "--precision", "fp32"])
    out = capsys.readouterr().out
    assert rc in (0, None), out
    assert "Memory per device (KiB)" in out, out
    assert "TFLOP/s" not in out and ("MFLOP/s" in out or "GFLOP/s" in out), out


def test_report_figures_in_their_unit():
    from autopar.report.html_page import fmt_value as _fmt

    assert _fmt(200 * 1024, "B") == "200 KiB"
    assert _fmt(3 * 2**30, "B") == "3.00 GiB"


def test_durations_in_the_unit_that_shows_them():
    """SI submultiples of the second, three significant figures: a CPU step of a tiny model reads
    in µs rather than '0.000 s', and rounding moves to the next unit (9.9996e-4 s is 1.00 ms)."""
    from autopar.core.units import fmt_seconds

    assert [fmt_seconds(t) for t in (2.375, 3.756e-4, 0.0123, 65.2, 9.9996e-4, 4.2e-8)] == \
        ["2.38 s", "376 µs", "12.3 ms", "65.2 s", "1.00 ms", "42.0 ns"]
