"""Print a search result for a person: the plan, its prediction, the runner-ups, how to run it."""
from __future__ import annotations

import contextlib

from autopar.core.rules import MULTI_CHUNK_SCHEDULES, nvme_contents
from autopar.core.units import byte_unit, fmt_bytes, fmt_flop_rate, fmt_in, fmt_seconds
from autopar.planner.candidate import describe_difference


def _gib(x: float) -> str:
    """Bytes in the unit that shows them (core/units.py): a small model's KiB, not "0.0 GiB"."""
    return fmt_bytes(x)


def fold_layers(plan) -> list[tuple[int, int, str]]:
    """(first, last, description) for runs of consecutive layers with the same choice."""
    runs: list[tuple[int, int, str]] = []
    for lp in plan.layers:
        tp = ("tp " + ", ".join(f"{k.split('.', 2)[-1] if k.count('.') >= 2 else k}:{v[0]}" for k, v in lp.tp)
              if lp.tp else "replicated")
        zero = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3 (FSDP)"}[lp.zero]
        text = f"{tp}; {zero}; recompute {lp.recompute}" + (f"; offload {lp.offload}" if lp.offload != "none" else "")
        if runs and runs[-1][2] == text and runs[-1][1] == lp.layer - 1:
            runs[-1] = (runs[-1][0], lp.layer, text)
        else:
            runs.append((lp.layer, lp.layer, text))
    return runs


def print_plan(console, graph, cluster, result, *, output: str, command: str | None, capture_s: float,
               confidence=None, left_out=(), headroom: float = 0.0, whole=()) -> None:
    """The plan summary; ``whole``: the lines of planner/whole_layers.py (layers tp leaves whole);
    ``command``: None where the output is not a regular file (a device keeps nothing to run)."""
    from rich.markup import escape
    from rich.table import Table

    best = result.best
    plan, pred = best.plan, best.plan.predicted
    m = plan.mesh
    console.print(f"[bold]autopar plan[/bold]  {graph.model_name}  on  {cluster.name} "
                  f"({cluster.world_size} devices)  global batch {plan.global_batch}, {plan.precision}")
    console.print(escape(f"  searched {result.num_settings} settings, priced {result.num_evaluated} plans "
                         f"({result.num_infeasible} did not fit or run) in {plan.provenance.get('search_s', 0):.1f} s "
                         f"[{result.method}, seed {plan.provenance.get('seed')}]; capture {capture_s:.1f} s"))
    sp = (", sequence parallel" if m.sequence_parallel else "") + (f", expert parallel ep {m.ep}" if m.ep > 1 else "")
    console.print(f"\n[bold]mesh[/bold]        {m.describe()}{sp}  "
                  f"(ranks = arange({m.world_size}).view({', '.join(m.axis_names)}))")
    pl = plan.pipeline
    v = len(pl.stages) // m.pp
    sched = pl.schedule + (f", {v} virtual stages per rank" if pl.schedule in MULTI_CHUNK_SCHEDULES else "")
    console.print(f"[bold]batching[/bold]    micro-batch {plan.micro_batch} x {pl.num_microbatches} micro-batches "
                  f"x {m.describe(splits='batch')} = {plan.global_batch}")
    if m.pp > 1 or v > 1:
        sizes = [s.end - s.start for s in pl.stages]
        console.print(f"[bold]pipeline[/bold]    {sched}; {len(pl.stages)} stages of "
                      f"{'/'.join(map(str, sizes))} layers")
    t = Table(title="per-layer choices", show_edge=False)
    t.add_column("layers", justify="right")
    t.add_column("names")
    t.add_column("choice")
    for a, b, text in fold_layers(plan):
        names = graph.layers[a].name + ("" if a == b else f" .. {graph.layers[b].name}")
        t.add_row(f"{a}" if a == b else f"{a}-{b}", names, text)
    console.print(t)
    console.print(f"[bold]predicted[/bold]   step {fmt_seconds(pred['step_time_s'])}, {pred['tokens_per_s']:,.0f} tokens/s, "
                  f"{pred['samples_per_s']:,.1f} samples/s, {fmt_flop_rate(pred['tflops_per_gpu'] * 1e12)} per GPU, "
                  f"MFU {100 * pred['mfu']:.1f}%, bubble {100 * pred.get('bubble_fraction', 0):.1f}%")
    errs, close, why = confidence or ([None] * (1 + len(result.runner_ups)), [False] * (1 + len(result.runner_ups)), "")
    if errs[0] is not None:
        console.print("[bold]validated[/bold]   " + escape(f"{errs[0].describe()} (benchmarks/published_runs.py); {why}"))
    elif why:
        console.print("[bold]validated[/bold]   " + escape(why))
    full = min(g.gpu_memory_bytes for g in cluster.groups)
    stages = pred.get("memory_per_stage", [])
    # one unit for the table, the one that shows its largest figure (core/units.py)
    # (the capacity, usually far larger, carries its own)
    unit, scale = byte_unit(max([mb["total_bytes"] for mb in stages], default=0.0))
    mt = Table(title=f"memory per device (each pipeline rank), {unit}; capacity = {_gib(full)} less "
                     f"{100 * headroom:.1f}% headroom for allocator fragmentation and workspaces",
               show_edge=False)
    for col in ("pp rank", "params", "grads", "optimizer", "activations", "buffers", "total", "capacity"):
        mt.add_column(col, justify="right")
    for r, mb in enumerate(stages):
        mt.add_row(str(r), *(fmt_in(mb[k], scale) for k in ("params_bytes", "grads_bytes", "optimizer_bytes",
                                                           "activations_bytes", "comm_buffer_bytes", "total_bytes")),
                   _gib(pred["capacity_bytes"]))
    console.print(mt)
    if "host_bytes_per_node" in pred:
        console.print(f"[bold]host memory[/bold] {_gib(pred['host_bytes_per_node'])} offloaded on the fullest "
                      f"node, of {_gib(pred['host_capacity_bytes'])}")
    if pred.get("nvme_bytes_per_node"):
        paths = sorted({g.nvme.path for g in cluster.groups if g.nvme is not None})
        note = f" -- {result.tier_note}" if getattr(result, "tier_note", "") else ""
        console.print("[bold]NVMe tier[/bold]   " + escape(
            f"{_gib(pred['nvme_bytes_per_node'])} of {nvme_contents(lp.offload for lp in plan.layers)} on the "
            f"fullest node, of "
            f"{_gib(pred['nvme_capacity_bytes'])}{note}; run with --nvme-path {paths[0] if paths else 'DIR'}"))
    if result.runner_ups:
        rt = Table(title="runner-ups", show_edge=False)
        rt.add_column("#")
        rt.add_column("step", justify="right")
        rt.add_column("vs winner", justify="right")
        rt.add_column("validation")
        rt.add_column("what differs")
        for k, ev in enumerate(result.runner_ups, 1):
            e = errs[k] if k < len(errs) else None
            val = (f"{e.family} ±{100 * e.median_abs:.0f}%" if e else "-") + \
                (", too close to call" if k < len(close) and close[k] else "")
            rt.add_row(str(k), fmt_seconds(ev.step_time_s), f"{100 * (ev.step_time_s / best.step_time_s - 1):+.1f}%",
                       val, describe_difference(best.candidate, ev.candidate))
        console.print(rt)
    if left_out:
        console.print("[bold]left out[/bold]    (micro-batch sizes the model cannot take; what the runtime cannot apply "
                      "to this model, checked on fake ranks; why context and expert parallelism are used or not)")
        for x in left_out:
            console.print(escape(f"  - {x.kind}: {x.reason}"))
    for line in whole:
        console.print(escape(line))
    if command is None:
        console.print(escape(f"\nwrote the plan to {output}, which is not a regular file: nothing is kept to run. "
                             f"To run this plan, write it to a file with -o PLAN.json, then 'autopar run PLAN.json'."))
    else:
        console.print(f"\nwrote [bold]{output}[/bold]; run it with:\n  {command}")


def print_outcome(console, out) -> None:
    """``autopar plan``'s summary of ``out`` (plan_api.PlanOutcome): ``print_plan``, the compile
    and float8 choices, the trials."""
    from autopar.planner.whole_layers import lines as whole_lines

    print_plan(console, out.graph, out.cluster, out.result, output=out.output, command=out.command,
               capture_s=out.capture_s, confidence=out.validation, left_out=out.left_out, headroom=out.headroom,
               whole=whole_lines(out.whole, out.plan))
    (console.print if console is not None else print)(out.compile_choice.summary())
    if console is not None:          # (no markup: the install hint's [fp8] is text)
        console.print(out.float8_choice.summary(), markup=False)
    else:
        print(out.float8_choice.summary())
    (console.print if console is not None else print)(out.compression_choice.summary())
    if out.trial is not None:
        from autopar.planner.trial_steps import summary_lines

        for line in summary_lines(out.trial):
            console.print(line, markup=False, highlight=False)


def console():
    """A rich console on stdout, or None where rich is not installed."""
    try:
        from rich.console import Console
    except ImportError:
        return None
    return Console(stderr=False)


@contextlib.contextmanager
def progress_bar(console):
    """A progress callback for the search drawing rich bars on ``console``, started at its first
    report (an error before the search shows no bar) and gone once the context ends; None
    without a console."""
    if console is None:
        yield None
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with contextlib.ExitStack() as stack:
        tasks: dict[str, int] = {}
        bars: list[Progress] = []

        def progress(phase: str, done: int, total: int) -> None:
            if not bars:
                bars.append(stack.enter_context(Progress(
                    TextColumn("{task.description:<28}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                    TimeElapsedColumn(), console=console, transient=True)))
            bar = bars[0]
            if phase not in tasks:
                tasks[phase] = bar.add_task(phase, total=max(1, total))
            bar.update(tasks[phase], completed=min(done, total), total=max(1, total))

        yield progress
