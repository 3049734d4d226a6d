"""The rulebook (core/rules.py): torch-free, and each rule against hand cases, then the places
that read it (Plan.validate, the planner's space, the runtime's machinery choice)."""
import subprocess
import sys
from dataclasses import replace

import pytest

from autopar.core import rules
from autopar.core.errors import PlanFileError
from autopar.core.plan import Mesh, ModelRef, uniform_plan


def test_the_rulebook_imports_without_torch():
    """core/rules.py (and core/plan.py, which reads it) import with torch and numpy unimportable."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'numpy'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import autopar.core.rules, autopar.core.plan\n"
        "assert not any(m.split('.')[0] in ('torch', 'numpy') for m in sys.modules), 'torch or numpy imported'\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_zero_families_and_mixing():
    assert [rules.zero_family_of(z) for z in (0, 1, 2, 3)] == ["ddp", "zero1", "fsdp", "fsdp"]
    assert all(rules.zero_family_of(z) == f for f, zs in rules.ZERO_FAMILIES.items() for z in zs)
    assert rules.zeros_mix({2, 3}) and rules.zeros_mix({0}) and rules.zeros_mix({1}) and rules.zeros_mix(set())
    assert not rules.zeros_mix({0, 2}) and not rules.zeros_mix({1, 3}) and not rules.zeros_mix({0, 1})


def test_offload_and_zero1():
    assert [rules.offload_allowed(z) for z in (0, 1, 2, 3)] == [False, False, True, True]
    assert not rules.zero1_shards(1) and rules.zero1_shards(2)


@pytest.mark.parametrize("zero,dp,splits,kind,eff", [
    (0, 4, False, "ddp", 0), (1, 4, False, "zero1", 1), (2, 4, False, "fsdp", 2), (3, 4, True, "fsdp", 3),
    (0, 4, True, "replicate", 0), (1, 4, True, "fsdp", 2), (0, 1, True, "none", 0), (1, 1, False, "none", 1),
    (3, 1, False, "fsdp", 3)])
def test_data_parallel_machinery(zero, dp, splits, kind, eff):
    assert rules.native_data_parallel(zero, dp, splits) == kind
    assert rules.zero_stage_that_runs(zero, splits) == eff


def test_interleaved_microbatches():
    assert rules.interleaved_microbatches_ok(8, 4) and rules.interleaved_microbatches_ok(4, 4)
    assert not rules.interleaved_microbatches_ok(6, 4)


def test_mesh_admission():
    ok = [t for t in range(1, 17) if rules.tp_admitted(t, gpus_per_node=8)]
    assert ok == [1, 2, 4, 8]
    assert [t for t in range(1, 17) if rules.tp_admitted(t, gpus_per_node=8, tp_inside_node=False)] == [1, 2, 4, 8, 16]
    assert [t for t in range(1, 17) if rules.tp_admitted(t, gpus_per_node=8, max_tp=4)] == [1, 2, 4]
    assert [t for t in range(1, 9) if rules.tp_admitted(t, gpus_per_node=6)] == [1, 2]     # 4 does not divide 6
    assert rules.tp_cap(8, None, True) == 8 and rules.tp_cap(8, None, False) is None and rules.tp_cap(8, 2, True) == 2
    assert rules.pp_admitted(4, 4) and not rules.pp_admitted(5, 4)
    assert rules.dp_admitted(4, 16) and not rules.dp_admitted(3, 16)
    # the space enumerates exactly these: 16 GPUs of 2 nodes, 4 layers, batch 16 -- by hand,
    # tp in {1, 2, 4, 8} x pp in {1, 2, 4} with tp pp dividing 16 (dp = 16 / (tp pp) then divides
    # the batch), sp on and off for tp > 1
    from autopar.planner.space import mesh_candidates

    got = {(m.dp, m.tp, m.pp, m.sequence_parallel) for m in
           mesh_candidates(16, gpus_per_node=8, num_layers=4, global_batch=16)}
    want = {(16 // (t * p), t, p, sp) for t in (1, 2, 4, 8) for p in (1, 2, 4)
            if t * p <= 16 for sp in ((False,) if t == 1 else (False, True))}
    assert got == want


def _plan(**kw):
    model = ModelRef(file="m.py", args={}, name="m", fingerprint="f")
    return uniform_plan(model=model, num_layers=8, **kw)


def test_plan_validate_reads_the_rules():
    _plan(dp=2, zero=2, offload="cpu").validate(8)
    with pytest.raises(PlanFileError, match="offload"):
        _plan(dp=2, zero=1, offload="cpu").validate(8)
    p = _plan(dp=2, zero=2)
    with pytest.raises(PlanFileError, match="zero"):
        replace(p, layers=(replace(p.layers[0], zero=0),) + p.layers[1:]).validate(8)
    _plan(pp=2, num_microbatches=4, schedule="interleaved", virtual_stages=2).validate(8)
    with pytest.raises(PlanFileError, match="num_microbatches"):   # was priced infeasible, now refused here
        _plan(pp=2, num_microbatches=3, schedule="interleaved", virtual_stages=2).validate(8)
    _plan(pp=2, num_microbatches=3, schedule="1f1b").validate(8)    # 1F1B takes any count


def test_nvme_offloads_name_what_goes_to_the_tier():
    """An offload value says which states the NVMe tier holds; a plan of any of them round-trips
    through its JSON, a plan written before parameters and gradients could go there ("nvme")
    still loads as the moments only, and a value outside the list is refused naming them."""
    from autopar.core.plan import Plan

    assert [rules.nvme_states(o) for o in ("none", "cpu", "nvme", "nvme+params", "nvme+grads",
                                             "nvme+params+grads")] == [
        (), (), ("moments",), ("moments", "params"), ("moments", "grads"), ("moments", "params", "grads")]
    for offload in rules.NVME_OFFLOADS:
        plan = _plan(dp=2, zero=3, offload=offload)
        again = Plan.from_dict(plan.to_dict())
        again.validate(8)
        assert {lp.offload for lp in again.layers} == {offload}
    with pytest.raises(PlanFileError, match=r"offload.*nvme\+params\+grads"):
        _plan(dp=2, zero=3, offload="nvme+optimizer").validate(8)


def test_no_copy_of_the_rules_left():
    """The rules' literal forms appear in core/rules.py only, element sizes in core/dtypes.py only
    (the copies issue 33 counted)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    patterns = [r'\{"ddp": \(0,\), "zero1": \(1,\), "fsdp": \(2, 3\)\}', r'\{0: "ddp", 1: "zero1"',
                r'zero < 2\b', r'gpus_per_node if \w+\.tp_inside_node else None',
                # element sizes: core/dtypes.py is the one table
                r'"float32": 4\b', r'"fp32": 4\b', r'== "fp32" else 2', r'\("bf16", "fp16"\) else 4',
                r'\(2\.0, 2\.0, 12\.0\)']
    found = [f"{p.relative_to(root)}: {pat}" for p in root.rglob("*.py") if p.name not in ("rules.py", "dtypes.py")
             and "tests" not in p.relative_to(root).parts for pat in patterns if re.search(pat, p.read_text())]
    assert not found, found
