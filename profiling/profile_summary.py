"""What ``autopar profile`` prints after writing: the summary figures and where they came from."""
from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table


def print_summary(prof: dict, path: Path, elapsed_s: float) -> None:
    console = Console()
    table = Table(title=f"profile {prof['name']} -> {path}  ({elapsed_s:.1f} s)")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("source")
    src = prof.get("sources", {})
    for dt, rate in prof.get("peak_flops", {}).items():
        table.add_row(f"peak_flops.{dt}", f"{rate / 1e12:.4f} TFLOP/s", src.get(f"peak_flops.{dt}", ""))
    if prof.get("memory_bandwidth_Bps"):
        table.add_row("memory_bandwidth", f"{prof['memory_bandwidth_Bps'] / 1e9:.2f} GB/s", src.get("memory_bandwidth_Bps", ""))
    for kind, eff in prof.get("efficiency", {}).items():
        table.add_row(f"efficiency.{kind}", f"{eff:.3f}", src.get(f"efficiency.{kind}", ""))
    for level, link in prof.get("fitted_links", {}).items():
        table.add_row(f"{level} link (fit)", f"{link['bandwidth_GBps']:.2f} GB/s, {link['latency_us']:.1f} us", link["source"])
    table.add_row("op_table", f"{len(prof.get('op_table', []))} rows", src.get("op_table", ""))
    table.add_row("collective_table", f"{len(prof.get('collective_table', []))} rows", src.get("collective_table", ""))
    console.print(table)
