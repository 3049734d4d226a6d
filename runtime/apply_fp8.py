"""Float8 training of the linears of a plan's ``precision: fp8`` layers, through torchao.

torchao (``pip install autopar[fp8]``) swaps an ``nn.Linear`` for its ``Float8Linear``
(``torchao.float8.convert_to_float8_training``): the module keeps its bf16 parameters (the
same FQNs, so materialisation and checkpoints are unchanged) and runs its three GEMMs on
float8 operands -- e4m3 inputs and weights, e5m2 output gradients for ``tensorwise``, e4m3
throughout for ``rowwise`` -- scaled by each tensor's (``tensorwise``) or each row's
(``rowwise``) absolute maximum (torchao.float8 README, "float8 training"; the configs are
``Float8LinearConfig.from_recipe_name``).  The plan carries the recipe (``Plan.fp8_recipe``).

Which linears: exactly those inside a layer whose plan says ``fp8`` and

* whose class is ``nn.Linear`` itself: a subclass has its own forward or is called through
  its weight (``nn.MultiheadAttention``'s ``out_proj``), which ``Float8Linear`` would lose;
* whose weight's two dims divide by 16: ``torch._scaled_mm`` (the fp8 GEMM) needs both GEMM
  dims of its operands in multiples of 16 (the alignment torchao's own filter examples and
  torchtitan's float8 converter require).

Every other linear, and every linear of a bf16 layer, is left in bf16 with the reason, and the
record (``Float8Record``) goes to the run log and measured.json.

Under tensor parallelism a split linear's GEMM runs on its shard: it is converted only if both
of its dims divide by 16 x tp (the split dim's shard then divides by 16 whichever way it is split;
the same rule prices it, simulator/float8.converts).

Where in the order (runtime/parallelize.py): on the meta model before tensor parallelism,
recompute, compile and FSDP2 -- the conversion replaces modules, which every later step wraps
(torchtitan converts its model the same way, before parallelising).  Tensor parallelism then
splits the ``Float8Linear`` modules with the plain DTensor styles: the activations' TP
collectives run in bf16 and each shard's GEMM in float8 (torchao's float8 tensors go through
DTensor; what torchtitan does for the rowwise recipe).  torchao's ``Float8ColwiseParallel`` /
``Float8RowwiseParallel``, which also cast the tensorwise recipe's TP all-gathers to fp8, are
not wired in.

Under FSDP2 with the ``tensorwise`` recipe the weights are all-gathered in float8
(``enable_fsdp_float8_all_gather``: each rank casts its shard with a scale from the global
amax, 1 byte per element on the wire instead of bf16's 2), and after every optimizer step
``precompute_float8_dynamic_scale_for_fsdp`` computes all those scales in one all-reduce
(torchao.float8 README, "float8 all-gather"; its docstring says to call it after the
optimizer step).  ``rowwise`` all-gathers bf16 (torchao supports the fp8 all-gather for
tensorwise scaling only).  An offloaded (CPU) fp8 layer keeps the bf16 all-gather: torchao's
fp8 weight wrapper is not documented with FSDP2's CPU offload.  So does FSDP2 over a
tensor-parallel model: the scales' precompute stacks the amaxes of every fp8 weight, which then
live on two meshes (dp x tp for the split linears, dp for the rest), and DTensor refuses that
(seen on gloo, dp = 2 x tp = 2).
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any, Callable

import torch.nn as nn

from autopar.core.dtypes import FP8_DIM_MULTIPLE

INSTALL_HINT = "pip install autopar[fp8]"


def torchao_available() -> bool:
    """Whether torchao's float8 training can be imported (the ``autopar[fp8]`` extra)."""
    if importlib.util.find_spec("torchao") is None:
        return False
    try:
        import torchao.float8  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken install is as good as none
        return False
    return True


@dataclass
class Float8Record:
    """What the conversion did: the linears converted, those left in bf16 and why."""
    recipe: str
    fsdp_float8_all_gather: bool = False
    converted: list[str] = field(default_factory=list)          # module FQNs
    left_bf16: dict[str, str] = field(default_factory=dict)     # module FQN -> reason

    def merge(self, other: "Float8Record") -> None:
        """Add another part's (or rank's) conversion; a module named by both counts once."""
        self.converted += [f for f in other.converted if f not in self.converted]
        self.left_bf16.update(other.left_bf16)
        self.fsdp_float8_all_gather = self.fsdp_float8_all_gather or other.fsdp_float8_all_gather

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Float8Record":
        return cls(recipe=d["recipe"], fsdp_float8_all_gather=d["fsdp_float8_all_gather"],
                   converted=list(d["converted"]), left_bf16=dict(d["left_bf16"]))

    def to_dict(self) -> dict[str, Any]:
        return {"recipe": self.recipe, "fsdp_float8_all_gather": self.fsdp_float8_all_gather,
                "converted": list(self.converted), "left_bf16": dict(self.left_bf16)}

    def summary(self) -> str:
        text = (f"float8 ({self.recipe}): {len(self.converted)} linear(s) converted, {len(self.left_bf16)} left in "
                f"bf16; FSDP float8 all-gather {'on' if self.fsdp_float8_all_gather else 'off'}")
        reasons: dict[str, list[str]] = {}
        for fqn, why in self.left_bf16.items():
            reasons.setdefault(why, []).append(fqn)
        for why, names in reasons.items():
            text += f"; {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}: {why}"
        return text


def shape_reason(module: nn.Linear, tp: int = 1) -> str | None:
    """Why ``module``'s shape does not suit an fp8 GEMM (on its shard, split over ``tp``), or None."""
    out_f, in_f = module.weight.shape
    m = FP8_DIM_MULTIPLE * tp
    if out_f % m or in_f % m:
        split = f" x tp = {m} (it is split over {tp} ranks)" if tp > 1 else ""
        return (f"weight [{out_f}, {in_f}] has a dim not divisible by {FP8_DIM_MULTIPLE}{split} (torch._scaled_mm's "
                f"alignment)")
    return None


def choose_linears(part: nn.Module, layers: list[tuple[list[str], str]], tp_split: dict[str, str] | None = None,
                   tp: int = 1) -> tuple[list[str], dict[str, str]]:
    """(the FQNs inside ``part`` to convert, the linears left in bf16 -> reason); ``layers``: per
    layer held by ``part``, (its module paths in ``part``, its precision: 'fp8' or other);
    ``tp_split``: the FQNs tensor parallelism splits (over ``tp`` ranks)."""
    tp_split = tp_split or {}
    convert, left = [], {}
    seen: set[str] = set()
    for paths, precision in layers:
        for path in paths:
            root = part.get_submodule(path)
            for name, mod in root.named_modules():
                fqn = f"{path}.{name}" if name else path
                if fqn in seen or not isinstance(mod, nn.Linear):
                    continue
                seen.add(fqn)
                if precision != "fp8":
                    left[fqn] = "its layer's precision is bf16"
                elif type(mod) is not nn.Linear:
                    left[fqn] = (f"a subclass of nn.Linear ({type(mod).__name__}) whose own forward Float8Linear "
                                 f"would replace")
                elif shape_reason(mod, tp if fqn in tp_split else 1):
                    left[fqn] = shape_reason(mod, tp if fqn in tp_split else 1)
                else:
                    convert.append(fqn)
    return convert, left


def float8_config(recipe: str, fsdp_all_gather: bool):
    """torchao's ``Float8LinearConfig`` for ``recipe``, with the FSDP2 float8 all-gather (tensorwise)."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(recipe)
    if fsdp_all_gather:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    return config


def apply_fp8(part: nn.Module, layers: list[tuple[list[str], str, str]], recipe: str, fsdp: bool,
              compile: bool = False, tp_split: dict[str, str] | None = None, tp: int = 1) -> Float8Record:
    """Convert, in place, the chosen linears of ``part`` (module docstring) to torchao's
    ``Float8Linear``; ``layers``: per held layer, (its module paths in ``part``, its precision,
    its offload); ``fsdp``: the part is sharded by FSDP2 (ZeRO-2/3) later; ``tp_split``: the
    FQNs inside ``part`` tensor parallelism splits over ``tp`` ranks later."""
    convert, left = choose_linears(part, [(paths, precision) for paths, precision, _ in layers], tp_split, tp)
    offloaded = any(precision == "fp8" and offload != "none" for _, precision, offload in layers)
    gather = fsdp and recipe == "tensorwise" and not offloaded and bool(convert) and tp == 1
    record = Float8Record(recipe=recipe, fsdp_float8_all_gather=gather, converted=convert, left_bf16=left)
    if not convert:
        return record
    from torchao.float8 import convert_to_float8_training

    if compile and recipe == "rowwise":
        # inductor fuses rowwise's scale and cast and may round the fp32 scale differently from
        # eager unless told to emulate the eager casts (pytorch/pytorch issue 150859; torchao's
        # and torchtitan's rowwise runs set it)
        import torch._inductor.config

        torch._inductor.config.emulate_precision_casts = True
    wanted = set(convert)
    convert_to_float8_training(part, config=float8_config(recipe, gather),
                               module_filter_fn=lambda mod, fqn: fqn in wanted)
    return record


def after_optimizer_step(parts: list[nn.Module]) -> Callable[[], None]:
    """The call to make after each optimizer step with the FSDP2 float8 all-gather: the scales of
    the next step's fp8 weights in one all-reduce (``precompute_float8_dynamic_scale_for_fsdp``)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    def run() -> None:
        for part in parts:
            precompute_float8_dynamic_scale_for_fsdp(part)
    return run
