"""The report's figures as text: each value in its unit (``fmt_value``), the signed error
(``fmt_error``), and the self-contained HTML page ``autopar report --html`` writes."""
from __future__ import annotations

import html
import math

from autopar.core.units import fmt_bytes


def fmt_value(value: float, unit: str) -> str:
    if not math.isfinite(value):
        return str(value)
    if unit == "s":
        return f"{value * 1e3:.3f} ms"
    if unit == "B":
        return fmt_bytes(value)
    if unit == "":
        return f"{value:.4f}"
    return f"{value:.4g} {unit}"


def fmt_error(e: float) -> str:
    return f"{e:+.1%}" if math.isfinite(e) else "n/a"


def render_html(figures, summary, notes, png: bytes, plan_path, measured_path, profile_name, calibration=None,
                curves_png: bytes | None = None) -> str:
    from autopar.report.figures import png_data_uri

    esc = html.escape
    rows = "\n".join(
        f"<tr><td>{esc(f.label)}</td><td>{esc(fmt_value(f.simulated, f.unit))}</td><td>{esc(fmt_value(f.measured, f.unit))}</td>"
        f"<td class='{'ok' if abs(f.error) <= 0.10 else 'bad'}'>{esc(fmt_error(f.error))}</td></tr>" for f in figures)
    summ = (f"<p>median |error| {summary['median_abs_error']:.1%}, worst {summary['worst_abs_error']:.1%} "
            f"(error = (simulated &minus; measured) / measured)</p>") if summary else ""
    note_html = "".join(f"<p class='note'>{esc(n)}</p>" for n in notes)
    cal = ""
    if calibration is not None and calibration.changes:
        cal = "<h2>calibration</h2><table><tr><th>factor</th><th>efficiency</th><th>time &times;</th><th>why</th></tr>" + "".join(
            f"<tr><td>{esc(c.factor)}</td><td>{c.old_efficiency:.4g} &rarr; {c.new_efficiency:.4g}</td>"
            f"<td>{c.time_scale:.3f}</td><td>{esc(c.why)}</td></tr>" for c in calibration.changes) + "</table>"
    curves = "" if curves_png is None else (
        f'\n<h2>training curves</h2>\n<img alt="loss and step time per step" src="{png_data_uri(curves_png)}">')
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>autopar report: {esc(str(plan_path))}</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 10px;text-align:right}} td:first-child{{text-align:left}}
.ok{{color:#1a7f37}} .bad{{color:#c0392b}} .note{{color:#555;font-size:90%}} img{{max-width:100%}}</style></head>
<body><h1>simulated vs measured</h1>
<p>plan {esc(str(plan_path))}, measurement {esc(str(measured_path))}, profile {esc(profile_name)}</p>
<table><tr><th>figure</th><th>simulated</th><th>measured</th><th>error</th></tr>
{rows}
</table>{summ}{note_html}{cal}
<h2>timelines and memory per rank</h2>
<img alt="simulated and measured timelines, memory per rank" src="{png_data_uri(png)}">{curves}
</body></html>
"""
