"""``autopar.prepare`` refuses what it must before any process group starts (one process): run
options it does not know, a decaying schedule without ``steps``, and a ``build_model`` function
that builds another model than the plan's (the plan check's fingerprint)."""
from __future__ import annotations

import pytest

from autopar.core.errors import PlanFileError, UserError


def test_import_autopar_is_cheap_and_prepare_is_lazy():
    import subprocess
    import sys

    code = "import sys, autopar; assert 'torch' not in sys.modules; autopar.prepare; assert 'torch' in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unknown_run_option_and_missing_steps(tmp_path):
    import autopar

    with pytest.raises(UserError, match=r"learning_rate.*not a run option.*grad_clip"):
        autopar.prepare(tmp_path / "plan.json", learning_rate=1e-3)
    with pytest.raises(UserError, match="pass steps=T"):
        autopar.prepare(tmp_path / "plan.json", lr_schedule="cosine")


def test_build_model_function_must_build_the_plans_model(tmp_path):
    from runtime_support import GPT, make_plan
    from plain_loop import load

    from autopar.runtime.api import _model_file
    from autopar.runtime.plan_check import check_plan

    plan = make_plan(tmp_path / "plan.json", dp=2, micro_batch=2)
    gpt = load(GPT)
    same = _model_file(plan, None, gpt.build_model, None, None)
    assert check_plan(plan, None, same).model_file.module.build_model is gpt.build_model

    def wider(**args):
        return gpt.build_model(**{**args, "hidden": 64})

    with pytest.raises(PlanFileError, match="captures to"):
        check_plan(plan, None, _model_file(plan, None, wider, None, None))
