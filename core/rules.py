"""The rulebook: what makes a plan legal, which data-parallel machinery runs it, which meshes a
cluster admits.  Each rule is written here once; ``Plan.validate`` (core/plan.py), the planner's
space, moves and constraints (planner/space.py, moves.py, constraints.py), the simulator
(layer_cost.effective_zero) and the runtime (runtime/apply_dp.py) import it.

Plain Python over ints and strings: no torch, no numpy (tests/core/test_core_rules.py imports it with
torch blocked), so the planner, the CLI's checks and the runtime read the same rules.
"""
from __future__ import annotations

# ------------------------------------------------------------------ ZeRO families
#: ZeRO "families" (Rajbhandari et al. 2020): DDP (stage 0) and ZeRO-1 (1) apply to the whole
#: model, one optimizer over all parameters; stages 2 and 3 may be mixed per layer, since FSDP
#: wraps layers one by one (``zeros_mix``)
ZERO_FAMILIES: dict[str, tuple[int, ...]] = {"ddp": (0,), "zero1": (1,), "fsdp": (2, 3)}
_FAMILY_OF = {zero: family for family, zeros in ZERO_FAMILIES.items() for zero in zeros}


def zero_family_of(zero: int) -> str:
    """The family of a ZeRO stage: ``"ddp"`` (0), ``"zero1"`` (1), ``"fsdp"`` (2, 3)."""
    return _FAMILY_OF[zero]


def zeros_mix(zeros) -> bool:
    """Whether a plan may give its layers these ZeRO stages together: DDP (0) and ZeRO-1 (1) are
    one choice for every layer; only 2 and 3 (FSDP units) may be mixed."""
    zeros = set(zeros)
    return len(zeros) <= 1 or not zeros & {0, 1}


def offload_allowed(zero: int) -> bool:
    """CPU offload runs through FSDP (``CPUOffloadPolicy`` of FSDP2, runtime/apply_dp.py): a layer
    may offload only at ZeRO 2 or 3."""
    return zero >= 2


#: what an offload value keeps in files on the NVMe tier (runtime/nvme_tier.py): "nvme" AdamW's
#: moments; "nvme+params" also the sharded parameters, "nvme+grads" the sharded gradients,
#: "nvme+params+grads" both (the rest of the layer's state in host memory, as "cpu")
NVME_OFFLOADS = ("nvme", "nvme+params", "nvme+grads", "nvme+params+grads")


def nvme_states(offload: str) -> tuple[str, ...]:
    """The states ``offload`` puts on the NVMe tier: ("moments", ["params"], ["grads"]); () for
    "none" and "cpu"."""
    if offload not in NVME_OFFLOADS:
        return ()
    return ("moments", *offload.split("+")[1:])


def nvme_contents(offloads) -> str:
    """What the layers' ``offloads`` keep on the NVMe tier, in words ("AdamW moments",
    "AdamW moments and gradients", "AdamW moments, parameters and gradients")."""
    held = {s for o in offloads for s in nvme_states(o)}
    words = ["AdamW moments"] + [w for s, w in (("params", "parameters"), ("grads", "gradients")) if s in held]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def zero1_shards(dp: int) -> bool:
    """ZeRO-1 shards optimizer state over the data-parallel ranks: with one it shards nothing."""
    return dp > 1


# ------------------------------------------------------------------ data-parallel machinery
def zero_stage_that_runs(zero: int, splits_model: bool) -> int:
    """The ZeRO stage that runs.  When another axis splits the model (tensor or pipeline
    parallelism: ``Mesh.splits_model``) ZeRO-1 runs as FSDP2 without reshard, i.e. ZeRO-2
    (``ZeroRedundancyOptimizer`` cannot broadcast DTensor parameters; ``native_data_parallel``)."""
    return 2 if zero == 1 and splits_model else zero


def native_data_parallel(zero: int, dp: int, splits_model: bool) -> str:
    """Which native part runs a layer's data parallelism.

    ``ddp`` (ZeRO-0), ``zero1`` (DDP + ZeroRedundancyOptimizer), ``fsdp`` (ZeRO-2/3).  When
    another axis splits the model, ZeRO-0 runs as ``replicate`` (DDP semantics on FSDP2's
    machinery: it takes DTensor parameters, which ``DistributedDataParallel`` does not, and the
    pipeline schedules drive its gradient sync per micro-batch, which DDP's reducer does not
    survive) and ZeRO-1 as FSDP2 without reshard (``zero_stage_that_runs``) -- the same arithmetic,
    with the gradients sharded as well.  ``none``: one dp rank and nothing to shard or offload.
    """
    if zero >= 2:
        return "fsdp"
    if dp == 1:
        return "none"
    if splits_model:
        return "fsdp" if zero == 1 else "replicate"
    return "zero1" if zero == 1 else "ddp"


# ------------------------------------------------------------------ pipeline
def interleaved_microbatches_ok(num_microbatches: int, pp: int) -> bool:
    """The interleaved 1F1B schedule runs micro-batches in groups of ``pp`` (Narayanan et al.
    2021, Sec. 2.2.2; torch.distributed.pipelining's ``ScheduleInterleaved1F1B`` asks the same):
    the count must be a multiple of the pipeline ranks."""
    return num_microbatches % pp == 0


#: schedules that split each backward into its input and weight gradients (Qi et al. 2024, "Zero
#: Bubble Pipeline Parallelism"): torch.distributed.pipelining's ScheduleInterleavedZeroBubble,
#: ScheduleZBVZeroBubble and ScheduleDualPipeV
SPLIT_BACKWARD_SCHEDULES = ("interleaved-zb", "zbv", "dualpipev")
#: schedules that run several model chunks per pipeline rank
MULTI_CHUNK_SCHEDULES = ("interleaved", "interleaved-zb", "zbv", "dualpipev")
#: schedules that place the chunks in a V (stage i and 2 pp - 1 - i on pp rank i): ZB-V (Qi et al.
#: 2024, Sec. 6) and DualPipeV; torch's classes take exactly two stages per rank
V_SCHEDULES = ("zbv", "dualpipev")


def stage_rank(schedule: str, stage_index: int, pp: int) -> int:
    """The pp rank that runs a stage: stage i on rank i % pp (looped), or for the V schedules
    rank i on the way down and 2 pp - 1 - i on the way back (torch's
    ``generate_stage_to_rank_mapping(style="v")``)."""
    if schedule in V_SCHEDULES:
        return stage_index if stage_index < pp else 2 * pp - 1 - stage_index
    return stage_index % pp


def schedule_microbatches_problem(schedule: str, num_microbatches: int, pp: int, num_stages: int) -> str | None:
    """Why torch's class for ``schedule`` refuses this many micro-batches / stages, or None.

    Interleaved 1F1B and interleaved zero bubble run the micro-batches in rounds of ``pp``
    (``interleaved_microbatches_ok``); the V schedules need exactly 2 stages per rank (torch's
    ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` raise otherwise); ``ScheduleDualPipeV``
    needs at least as many micro-batches as stages (2 pp)."""
    if schedule in V_SCHEDULES and num_stages != 2 * pp:
        return f"exactly 2 stages per pipeline rank ({2 * pp} stages on {pp} ranks) for the {schedule} schedule"
    if schedule == "dualpipev" and num_microbatches < num_stages:
        return (f"at least as many micro-batches as stages ({num_stages}) for the dualpipev schedule "
                f"(torch's ScheduleDualPipeV)")
    if (schedule in ("interleaved", "interleaved-zb") and num_stages > pp
            and not interleaved_microbatches_ok(num_microbatches, pp)):
        return f"a multiple of mesh.pp = {pp} micro-batches for the {schedule} schedule (core/rules.py)"
    return None


def split_backward_problem(schedule: str, recompute: str, zero: int, offload: str, compile: bool) -> str | None:
    """Why a split-backward schedule (SPLIT_BACKWARD_SCHEDULES) cannot run a layer's choice, or None.

    * selective recompute: torch's selective activation checkpoint allows one backward through a
      region ("Trying to backward an extra time ... under selective activation checkpoint"), and the
      input and the weight gradients are two;
    * ZeRO-3 (and offload, which shards as ZeRO-3): under torch 2.13 the split backward of an FSDP2
      unit that reshards its parameters after forward trains another model (losses off the plain
      loop's from the second step: tests/integration/test_runtime_zero_bubble.py); ZeRO-2 matches;
    * compile: torch's zero-bubble classes refuse compiled stage modules
      (``_check_torch_compile_compatibility``: no input/weight split of a compiled backward)."""
    if schedule not in SPLIT_BACKWARD_SCHEDULES:
        return None
    if recompute == "selective":
        return (f"the {schedule} schedule splits each backward into input and weight gradients, and torch's "
                f"selective activation checkpoint allows one backward per region: use recompute 'full' or 'none'")
    if zero >= 3 or offload != "none":
        return (f"the {schedule} schedule's split backward under FSDP2 with parameters resharded after forward "
                f"(ZeRO-3, offload) does not reproduce the plain loop's gradients in torch 2.13: use ZeRO 0-2")
    if compile:
        return f"torch's {schedule} schedule class refuses compiled stage modules: plan without compile"
    return None


# ------------------------------------------------------------------ mesh admission
def tp_cap(gpus_per_node: int, max_tp: int | None, tp_inside_node: bool) -> int | None:
    """The largest tensor-parallel degree asked for: ``max_tp`` (--max-tp), else the GPUs of a node
    when tp stays inside one, else none."""
    return max_tp or (gpus_per_node if tp_inside_node else None)


def tp_admitted(tp: int, *, gpus_per_node: int, max_tp: int | None = None, tp_inside_node: bool = True) -> bool:
    """A tensor-parallel degree the planner may use: a power of two (head and hidden counts are),
    at most ``max_tp`` and, with ``tp_inside_node``, a divisor of the GPUs per node, so that a tp
    group (consecutive ranks) never crosses a node."""
    if tp < 1 or tp & (tp - 1):
        return False
    if max_tp is not None and tp > max_tp:
        return False
    return not tp_inside_node or (tp <= gpus_per_node and gpus_per_node % tp == 0)


def pp_admitted(pp: int, num_layers: int) -> bool:
    """A pipeline degree: at most one stage per layer."""
    return 1 <= pp <= num_layers


def dp_admitted(dp: int, global_batch: int) -> bool:
    """A data-parallel degree: it divides the global batch (every replica takes as many samples)."""
    return dp >= 1 and global_batch % dp == 0
