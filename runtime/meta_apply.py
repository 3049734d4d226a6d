"""What the runtime's compile and float8 steps do to a plan's model, worked out on the meta device.

The planner reports which blocks a plan compiles and which linears it trains in float8 (the plan
summary, plan.json's provenance).  It asks the runtime, through the two functions here, instead of
driving the runtime's internals itself: each builds the model on the meta device, cuts it into the
plan's layer units as the runtime does (``parallelize.layer_module_paths``) and applies the runtime's own
step -- ``apply_compile.apply_compile`` (which wraps blocks without compiling anything: compiling on
fake tensors would generate code for nothing, minutes on a CPU) or ``apply_fp8.apply_fp8`` (which
swaps the linears without running an fp8 GEMM).  ``FP8_INSTALL_HINT`` (and
``apply_fp8.torchao_available``) say whether float8 can run at all.  Imports only core/ and the runtime.
"""
from __future__ import annotations

from autopar.core.graph import OpGraph
from autopar.core.plan import Plan
from autopar.runtime.apply_fp8 import INSTALL_HINT as FP8_INSTALL_HINT

__all__ = ["compile_blocks", "float8_conversion", "FP8_INSTALL_HINT"]


def _meta_units(plan: Plan, graph: OpGraph, model_file):
    """(the model on the meta device, each layer's module paths, each layer's spec)."""
    from autopar.runtime.materialize import build_meta_model
    from autopar.runtime.parallelize import layer_module_paths
    from autopar.runtime.plan_check import layer_specs

    meta = build_meta_model(model_file, dict(plan.model.args))
    held = layer_specs(plan, graph)
    return meta, layer_module_paths(meta, held), held


def compile_blocks(plan: Plan, graph: OpGraph, model_file) -> list[str]:
    """The block modules the runtime's compile step wraps for ``plan``'s model (its layers other
    than the ``pre`` and ``post`` units)."""
    from autopar.runtime.apply_compile import apply_compile

    meta, units, held = _meta_units(plan, graph, model_file)
    return apply_compile(meta, [paths for paths, layer in zip(units, held) if layer.name not in ("pre", "post")])


def float8_conversion(plan: Plan, graph: OpGraph, model_file):
    """What the runtime's float8 step converts for ``plan`` (runtime/apply_fp8.py): a ``Float8Record``."""
    from autopar.runtime.apply_dp import data_parallel_kind
    from autopar.runtime.apply_fp8 import apply_fp8

    meta, units, held = _meta_units(plan, graph, model_file)
    fsdp = data_parallel_kind(plan.zero, plan.mesh) == "fsdp"
    return apply_fp8(meta, [(paths, plan.layer_precision(layer.index), layer.plan.offload)
                            for paths, layer in zip(units, held)], plan.fp8_recipe, fsdp=fsdp)
