"""Sharded data parallelism on a plan's layer table: the "sharded_dp" cost term's rewrite
(builtin_terms.py), the glue between the evaluator's context and sharded_dp.py's mechanism.

Its own module so that sharded_dp.py, which training_code.py imports for the runtimes it
describes, does not import the layer table (layer_table -> layer_cost -> cost_model ->
training_code would close a loop: tests/integration/test_import_cycles.py)."""
from __future__ import annotations

from autopar.simulator.axes import sharded_dp
from autopar.simulator.step.layer_table import COLUMN_INDEX, LayerTable


def plan_table_costs(rows, ctx, per_gpu_network_GBps: float, fetch_units=None):
    """``with_sharded_dp_costs`` on a GPU plan's LayerTable ``rows`` (a CPU profile's ranks take
    turns already) in evaluator context ``ctx`` (the "sharded_dp" term of builtin_terms.py);
    ``per_gpu_network_GBps``: one GPU's share of its node's network (the cluster's inter_node);
    ``fetch_units``: a callable giving each layer's gathered units, read where the priced code
    drains the device at each fetch (sharded_dp.py item 4c)."""
    cm = ctx.rank_cm[0]
    if cm.host_dispatch_bound or ctx.serial_comm:
        return rows
    # the arguments depend on the context, the training code priced (cm.code) and the fitted
    # constants (cm.calibration, evaluator._memo_settings): worked out once per context and calibration
    settings = cm.calibration
    if ctx.sharded_args is None or ctx.sharded_args[0] != settings:
        dp, code = ctx.links.dp, cm.code
        ctx.sharded_args = (settings,
            (COLUMN_INDEX, COLUMN_INDEX["zero"], cm.memory_bandwidth_Bps, cm.efficiency.get("memory_bound", 1.0)),
            dict(reduce_factor=sharded_dp.reduce_scale(ctx.precision, code.reduce_bytes),
                 **sharded_dp.collective_terms(code.sharded, dp.level, dp.size, dp.link.bandwidth_GBps,
                                    dp.link.latency_s, per_gpu_network_GBps,
                                    cm.collective_efficiency.get("inter", 1.0), cm.calibration)))
        if code.sharded.drains_each_fetch and fetch_units is not None:
            ctx.sharded_args[2]["units"] = fetch_units()
    _, args, kwargs = ctx.sharded_args
    return LayerTable(sharded_dp.with_sharded_dp_costs(rows.data, *args, pipeline_m=ctx.pipeline_m, **kwargs))
