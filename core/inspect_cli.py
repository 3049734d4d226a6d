"""``autopar inspect``: capture a model file on the meta device and show its layers.

    autopar inspect examples/gpt.py --model-arg size=gpt3-175b --batch-size 8 [--json] [--all]

The table lists every layer with its parameters, forward/backward FLOPs per step (for
``--batch-size`` samples) and the activation bytes it keeps for backward.  Consecutive
structurally identical layers are folded into one row ("blocks.0-95 (x96)") whose figures
are PER LAYER; ``--all`` prints every layer.  ``--json`` prints ``OpGraph.summary()``.
"""
from __future__ import annotations

import argparse
import json
import sys

from autopar.core.modelfile import add_model_arguments, parse_model_args
from autopar.core.units import fmt_bytes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the graph summary as JSON")
    parser.add_argument("--all", action="store_true",
                        help="one row per layer (do not fold identical consecutive layers)")


def main(args: argparse.Namespace) -> int:
    from autopar.core.capture import capture_model_file

    model_args = parse_model_args(args.model_args)
    graph = capture_model_file(args.model_file, model_args, args.batch_size)
    if args.json:
        json.dump(graph.summary(), sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
        return 0
    _print_table(graph, fold=not args.all)
    return 0


def fold_repeated_layers(layers: list) -> list[tuple[list, bool]]:
    """Runs of consecutive layers with the same signature: [(layers, folded?)]."""
    runs: list[list] = []
    for layer in layers:
        if runs and runs[-1][-1].signature == layer.signature and layer.kind not in ("pre", "post"):
            runs[-1].append(layer)
        else:
            runs.append([layer])
    return [(run, len(run) > 1) for run in runs]


def _print_table(graph, fold: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 120))
    title = (f"{graph.model_name} -- batch {graph.batch_size}"
             + (f", sequence {graph.seq_len}" if graph.seq_len else "")
             + f", parameters {graph.param_dtype}")
    table = Table(title=title, title_justify="left")
    for col, justify in (("layer", "left"), ("kind", "left"), ("params", "right"),
                         ("fwd FLOPs", "right"), ("bwd FLOPs", "right"),
                         ("saved act.", "right"), ("out act.", "right"), ("ops", "right")):
        table.add_column(col, justify=justify, no_wrap=True)
    groups = fold_repeated_layers(graph.layers) if fold else [([layer], False) for layer in graph.layers]
    for run, folded in groups:
        first = run[0]
        name = first.name
        if folded:
            name = f"{first.name}-{run[-1].name.rsplit('.', 1)[-1]} (x{len(run)})" \
                if "." in first.name else f"{first.name}..{run[-1].name} (x{len(run)})"
        table.add_row(name, first.kind, _count(first.param_numel), _flops(first.fwd_flops),
                      _flops(first.bwd_flops), _bytes(first.saved_bytes), _bytes(first.output_bytes),
                      str(len(first.ops)))
    table.add_section()
    table.add_row("total", "", _count(graph.params_total), _flops(graph.fwd_flops),
                  _flops(graph.bwd_flops), _bytes(graph.saved_bytes), "",
                  str(len(graph.ops)), style="bold")
    console.print(table)
    if fold and any(folded for _, folded in groups):
        console.print("Folded rows (xN) show the figures of ONE layer; totals count all of them.")
    if graph.trainable_params != graph.params_total:
        console.print(f"trainable parameters: {_count(graph.trainable_params)} of {_count(graph.params_total)} "
                      f"(the others have requires_grad=False: no gradient, no optimizer state)")
    console.print(f"FLOPs per step (forward + backward, no recompute): {_flops(graph.flops_per_step)}"
                  f"; saved activations per step: {_bytes(graph.saved_bytes)}")
    console.print(f"capture: {graph.capture_method} in {graph.capture_s:.2f} s; "
                  f"layers sequential (pipeline-cuttable): {'yes' if graph.sequential_layers else 'no'}; "
                  f"fingerprint {graph.fingerprint}")
    if graph.leaf_modules:
        console.print(f"opaque (leaf) modules: {', '.join(graph.leaf_modules)}")
    for note in graph.notes:
        console.print(f"note: {note}", highlight=False)


def _count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{int(n)}"


def _flops(n: float) -> str:
    for unit, scale in (("EF", 1e18), ("PF", 1e15), ("TF", 1e12), ("GF", 1e9), ("MF", 1e6), ("KF", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} F"


def _bytes(n: float) -> str:
    return fmt_bytes(n)            # core/units.py: the unit that shows the figure
