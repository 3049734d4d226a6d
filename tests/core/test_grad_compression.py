"""The plan's grad_compression: parsing, where each kind may run, and old plan files loading."""
from __future__ import annotations

import json

import pytest

from autopar.core.errors import PlanFileError
from autopar.core.grad_compression import GradCompression, compression_problem, powersgd_compresses
from autopar.core.plan import ModelRef, Plan, uniform_plan

REF = ModelRef(file="m.py", args={}, name="m", fingerprint="f")


def test_parse_and_print():
    assert GradCompression.parse("powersgd:4") == GradCompression("powersgd", 4)
    assert str(GradCompression.parse("BF16")) == "bf16" and not GradCompression.parse("fp16").lossy
    assert GradCompression.parse("powersgd:1").lossy
    for bad in ("powersgd", "powersgd:0", "int8", "powersgd:-1", ""):
        with pytest.raises(ValueError):
            GradCompression.parse(bad)


def test_where_each_kind_runs():
    from autopar.core.parallel_dims import ParallelDims as M

    assert compression_problem("bf16", M(dp=2), 3) is None                 # FSDP2 reduce_dtype
    assert compression_problem("fp16", M(dp=2, tp=2), 0) is None           # replicate
    assert compression_problem("powersgd:2", M(dp=4), 1) is None           # DDP + ZeRO-1
    assert "FSDP2" in compression_problem("powersgd:2", M(dp=4), 2)
    assert "FSDP2" in compression_problem("powersgd:2", M(dp=2, pp=2), 0)  # a pipeline runs replicate
    assert "dp x cp = 1" in compression_problem("bf16", M(tp=2), 0)
    assert compression_problem("bf16", M(cp=2), 0) is None                 # cp ranks reduce gradients too


def test_torch_compression_rule():
    # torch's _should_compress: (n + m) * r * 2 < n * m, r capped at min(n, m)
    assert powersgd_compresses(96, 32, 2) and not powersgd_compresses(96, 1, 1)
    assert powersgd_compresses(4, 4, 1) is False          # (4 + 4) * 1 * 2 = 16, not < 16
    assert powersgd_compresses(5, 5, 1)                   # 20 < 25


def test_plan_round_trip_identity_and_old_files():
    plain = uniform_plan(model=REF, num_layers=2, dp=2)
    psgd = uniform_plan(model=REF, num_layers=2, dp=2, grad_compression="powersgd:4")
    d = plain.to_dict()
    assert "grad_compression" not in d                     # old plan files have no key ...
    assert Plan.from_dict(json.loads(json.dumps(d))).grad_compression == "none"   # ... and load as none
    back = Plan.from_dict(json.loads(psgd.to_json()))
    assert back.grad_compression == "powersgd:4" and back.identity == psgd.identity != plain.identity


@pytest.mark.parametrize("kw, says", [(dict(dp=2, zero=3, grad_compression="powersgd:2"), "FSDP2"),
                                      (dict(dp=1, grad_compression="bf16"), "dp x cp = 1"),
                                      (dict(dp=2, grad_compression="int4"), "powersgd:R")])
def test_plan_file_refuses_what_cannot_run(kw, says):
    d = uniform_plan(model=REF, num_layers=2, **{**kw, "grad_compression": "none"}).to_dict()
    d["grad_compression"] = kw["grad_compression"]
    with pytest.raises(PlanFileError, match="grad_compression") as e:
        Plan.from_dict(d, source="plan file p.json")
    assert says in str(e.value)
