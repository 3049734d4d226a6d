"""``autopar simulate``: predict step time, throughput and memory of a configuration or a plan.json.

    autopar simulate examples/gpt.py --model-arg size=gpt3-1.3b --cluster CLUSTER --dp 8 --tp 1
    autopar simulate plan.json --trace trace.json --json      # the cluster the plan was made for

The work is ``autopar.simulate(...)`` (simulator/simulate_api.py); this module parses the
arguments, calls it, and prints what it returns.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from autopar.core.plan import OFFLOAD
from autopar.core.units import byte_unit, fmt_bytes, fmt_count, fmt_flop_rate, fmt_in, fmt_seconds

SCHEDULE_CHOICES = ("gpipe", "1f1b", "interleaved", "interleaved-zb", "zbv", "dualpipev")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", metavar="MODEL_FILE|PLAN_JSON",
                        help="a model .py file (then give the configuration flags) or a plan.json to evaluate")
    parser.add_argument("--model-arg", dest="model_args", action="append", default=[], metavar="KEY=VALUE",
                        help="argument for build_model / make_batch (repeatable)")
    from autopar.core.cluster_file import available_clusters

    parser.add_argument("--cluster", metavar="PATH_OR_NAME", default=None,
                        help="cluster file (YAML, docs/cluster-file.md) or a bundled cluster: "
                             f"{', '.join(available_clusters())}; required for a model file, a plan.json "
                             "defaults to the cluster it was made for")
    parser.add_argument("--nodes", metavar="N", type=int, default=None,
                        help="scale a single-group cluster to N nodes (what-if; the file stays as it is)")
    from autopar.core import cli_types as T

    g = parser.add_argument_group("configuration (ignored for a plan.json)")
    from autopar.core.parallel_dims import AXIS_BY_NAME, DEGREE_NAMES

    for name in DEGREE_NAMES:        # one flag per parallel axis; the batch axis takes the devices left
        axis = AXIS_BY_NAME[name]
        if axis.splits == "batch":
            g.add_argument(f"--{name}", type=T.positive, default=None, help=f"{axis.help} (default: the devices left)")
        else:
            g.add_argument(f"--{name}", type=T.positive, default=1, help=f"{axis.help} (default 1)")
    g.add_argument("--ep", type=T.positive, default=1,
                   help="expert-parallel degree: the routed experts split over N of the dp x cp ranks (default 1)")
    g.add_argument("--micro-batch", type=T.positive, default=1, help="samples per micro-batch per data-parallel rank")
    g.add_argument("--global-batch", type=T.global_batch, default=None, help="samples per step (default dp x micro-batch x pp)")
    g.add_argument("--schedule", choices=SCHEDULE_CHOICES, default="1f1b")
    g.add_argument("--virtual-stages", type=T.positive, default=2,
                   help="model chunks per pipeline rank (interleaved and interleaved-zb; zbv and dualpipev run 2)")
    g.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0, help="0 DDP, 1-3 ZeRO stage")
    g.add_argument("--recompute", choices=("none", "selective", "full"), default="none")
    g.add_argument("--offload", choices=OFFLOAD, default="none")
    g.add_argument("--precision", choices=("fp32", "bf16", "fp16", "fp8"), default=None,
                   help="default bf16 on GPU clusters, fp32 on gloo (CPU) clusters; fp8: bf16 with every layer's "
                        "linears in float8 (simulator/float8.py; those whose dims divide by 16)")
    g.add_argument("--fp8-recipe", choices=("tensorwise", "rowwise"), default="tensorwise",
                   help="torchao's float8 scaling with --precision fp8 (default tensorwise)")
    g.add_argument("--sequence-parallel", action="store_true", help="split activations over tp between regions")
    g.add_argument("--compile", action="store_true",
                   help="regional torch.compile of every block (simulator/compile_fusion.py)")
    parser.add_argument("--grad-clip", action="store_true",
                        help="price the step as a run that clips gradients by their global norm (autopar run "
                             "--grad-clip C); a plan made with 'autopar plan --grad-clip' is priced so already")
    parser.add_argument("--profile", default=None, help="profile name or JSON (default: the cluster's GPU type)")
    parser.add_argument("--trace", default=None, metavar="PATH", help="write a Chrome trace (open in Perfetto)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def main(args: argparse.Namespace) -> int:
    from autopar.core.modelfile import parse_model_args
    from autopar.core.parallel_dims import DEGREE_NAMES
    from autopar.simulator.simulate_api import simulate

    sim = simulate(args.target, cluster=args.cluster, nodes=args.nodes,
                   model_args=parse_model_args(args.model_args) if Path(args.target).suffix != ".json" else None,
                   degrees={name: getattr(args, name) for name in DEGREE_NAMES}, ep=args.ep,
                   micro_batch=args.micro_batch, global_batch=args.global_batch, schedule=args.schedule,
                   virtual_stages=args.virtual_stages, zero=args.zero, recompute=args.recompute,
                   offload=args.offload, precision=args.precision, fp8_recipe=args.fp8_recipe,
                   sequence_parallel=args.sequence_parallel, compile=args.compile, grad_clip=args.grad_clip,
                   profile=args.profile, trace=args.trace)
    if args.json:
        json.dump(sim.to_dict(), sys.stdout, indent=2, default=float)
        print()
        return 0
    _print_rich(sim.graph, sim.plan, sim.cluster, sim.result, sim.capture_s, sim.simulate_s, args.trace)
    return 0


def _gb(x: float) -> str:
    """Bytes in the unit that shows them (core/units.py): a small model's KiB, not "0.00" GiB."""
    return fmt_bytes(x)


def _print_rich(graph, plan, cluster, r, capture_s, sim_s, trace) -> None:
    from rich.console import Console

    from autopar.simulator.simulate_api import trace_end_s
    from rich.table import Table

    con = Console()
    m = plan.mesh
    trainable = (f", {fmt_count(graph.trainable_params)} trainable"
                 if graph.trainable_params != graph.params_total else "")
    con.print(f"[bold]{graph.model_name}[/] ({fmt_count(graph.params_total)} parameters{trainable}) on "
              f"[bold]{cluster.name}[/] "
              f"({cluster.world_size} devices): {m.describe()}"
              f"{' + sequence parallel' if m.sequence_parallel else ''}{f' + ep {m.ep}' if m.ep > 1 else ''}, {plan.pipeline.schedule} with "
              f"{len(plan.pipeline.stages)} stages, {plan.pipeline.num_microbatches} micro-batches of "
              f"{plan.micro_batch}, global batch {plan.global_batch}, {plan.precision}")
    t = Table(title="Predicted step", show_header=False)
    t.add_row("step time", fmt_seconds(r.step_time_s))
    t.add_row("throughput", f"{r.samples_per_s:.4g} samples/s, {r.tokens_per_s:.4g} tokens/s")
    t.add_row("model FLOP/s per GPU (MFU)", f"{fmt_flop_rate(r.tflops_per_gpu * 1e12)} ({100 * r.mfu:.1f}% of "
              f"{fmt_flop_rate(r.peak_flops_per_gpu)})")
    t.add_row("hardware FLOP/s per GPU (with recompute)", fmt_flop_rate(r.hw_tflops_per_gpu * 1e12))
    t.add_row("pipeline bubble", f"{100 * r.bubble_fraction:.1f}%")
    world = max(1, plan.mesh.world_size)
    t.add_row("sent per device per step (mean)", f"intra-node {fmt_bytes(r.comm_bytes['intra'] / world)}, "
              f"inter-node {fmt_bytes(r.comm_bytes['inter'] / world)}")
    t.add_row("cost figures", f"{r.sources['measured']} measured, {r.sources['estimated']} estimated")
    con.print(t)
    # one unit for the table, the one that shows its largest figure (core/units.py)
    unit, scale = byte_unit(max([b.total_bytes for b in r.memory] + [b.host_bytes for b in r.memory], default=0.0))
    mt = Table(title=f"Memory per device ({unit}), capacity {_gb(r.capacity_bytes)}")
    for col in ("pipeline rank", "params", "grads", "optimizer", "activations", "comm buffers", "total", "host"):
        mt.add_column(col, justify="right")
    for i, b in enumerate(r.memory):
        style = "red" if b.total_bytes > r.capacity_bytes else None
        mt.add_row(str(i), *(fmt_in(x, scale) for x in (b.params_bytes, b.grads_bytes, b.optimizer_bytes,
                                                          b.activations_bytes, b.comm_buffer_bytes, b.total_bytes,
                                                          b.host_bytes)), style=style)
    con.print(mt)
    host = (f"host memory: {_gb(r.host_bytes_per_node)} offloaded on the fullest node, of "
            f"{_gb(r.host_capacity_bytes)}")
    con.print(host if r.host_fits else f"[red]{host}: does NOT fit[/]")
    if r.nvme_bytes_per_node:
        from autopar.core.rules import nvme_contents

        nvme = (f"NVMe tier: {_gb(r.nvme_bytes_per_node)} of {nvme_contents(lp.offload for lp in plan.layers)} on "
                f"the fullest node, of "
                f"{_gb(r.nvme_capacity_bytes)}")
        con.print(nvme if r.nvme_fits else f"[red]{nvme}: does NOT fit[/]")
    con.print("[green]fits in memory[/]" if r.fits else
              "[red]does NOT fit in memory on every device[/]" if not r.device_fits else
              "[red]does NOT fit in host memory on every node (offloaded state)[/]" if not r.host_fits else
              "[red]does NOT fit on the NVMe tier of every node (the cluster file's nvme capacity)[/]")
    if trace:
        con.print(f"Chrome trace written to {trace} (open in https://ui.perfetto.dev)")
        end = trace_end_s(r.timeline)
        if end > r.step_time_s * (1 + 1e-9):
            con.print(f"[yellow]the trace ends at {end:.4g} s, after the predicted step: the pipeline formula "
                      f"charges the sends between stages only in the fill and drain (docs/design.md)[/]")
    con.print(f"[dim]capture {capture_s:.1f} s, simulate {sim_s:.2f} s[/]")
