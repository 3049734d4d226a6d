"""The simulator as the planner reaches it: the one module the planner imports from the simulator.

What a search needs, and nothing else: the fast path that prices plans (``PlanEvaluator``,
evaluator.py), the cost model (``CostModel``, device/cost_model.py), the price of a written plan
(``price_plan``, ``plan_graph``: plan_price.py), and the terms the planner's own bounds and
tables read (the layer table's columns, the step's composition of one layer alone
(step/compose.py), the step model's closed forms, memory, sharded data
parallelism's collective terms, the pipeline's tied copies, the axes' degree rules).  Each name
is defined in the room that owns it (simulator/device, axes, step); this module only names them.
"""
from autopar.simulator.axes.ep import ep_degrees, ep_refusal
from autopar.simulator.axes.float8 import converts as float8_converts
from autopar.simulator.axes.grad_compression import compressed_fraction
from autopar.simulator.axes.pp import interleaved_time
from autopar.simulator.axes.pp_tied_copies import held_share as tied_held_share
from autopar.simulator.axes.pp_tied_copies import range_held_bytes as tied_range_held_bytes
from autopar.simulator.axes.pp_tied_copies import uses as tied_uses
from autopar.simulator.axes.pp_zero_bubble import screen_bubble_share
from autopar.simulator.axes.sharded_dp import collective_terms, effective_zero, layer_among_equals, reduce_scale
from autopar.simulator.device.cost_model import CostModel
from autopar.simulator.device.topology import stage_groups
from autopar.simulator.evaluator import PlanEvaluator
from autopar.simulator.plan_price import plan_graph, price_plan
from autopar.simulator.simulate import plan_cost_models
from autopar.simulator.step.compose import folded_layer_time, layer_floor
from autopar.simulator.step.cpu_node import serial_communication
from autopar.simulator.step.layer_cost import LAYER_COST_FIELDS, LayerCost
from autopar.simulator.step.layer_table import COLUMN_INDEX, RECOMPUTE_CODE
from autopar.simulator.step.memory import ddp_bucket_bytes, fsdp_buffer_bytes, inflight_microbatches, p2p_buffer_bytes
from autopar.simulator.step.term_registry import layer_row, with_term_columns

__all__ = [
    "COLUMN_INDEX", "CostModel", "LAYER_COST_FIELDS", "LayerCost", "PlanEvaluator", "RECOMPUTE_CODE",
    "collective_terms", "compressed_fraction", "ddp_bucket_bytes", "effective_zero", "ep_degrees", "ep_refusal",
    "float8_converts", "folded_layer_time", "fsdp_buffer_bytes", "inflight_microbatches", "interleaved_time",
    "layer_among_equals", "layer_floor", "layer_row", "p2p_buffer_bytes", "plan_cost_models", "plan_graph", "price_plan", "reduce_scale",
    "screen_bubble_share", "serial_communication", "stage_groups", "tied_held_share", "tied_range_held_bytes",
    "tied_uses", "with_term_columns",
]
