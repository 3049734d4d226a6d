"""Model-file loading: argument parsing and every bad-input case (exit code 2, one paragraph)."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from autopar.cli import main as cli_main
from autopar.core.errors import ModelFileError, UserError
from autopar.core.modelfile import add_model_arguments, load_model_file, parse_model_args

GPT = Path(__file__).resolve().parents[2] / "examples" / "gpt.py"

GOOD = '''
import torch, torch.nn as nn
def build_model(hidden=4):
    return nn.Linear(hidden, 2)
def make_batch(batch_size, hidden=4):
    return torch.randn(batch_size, hidden), torch.randn(batch_size, 2)
'''


def test_parse_model_args_types():
    got = parse_model_args(["size=gpt2-small", "layers=4", "dropout=0.1", "flag=true",
                            "other=False", "name=a=b"])
    assert got == {"size": "gpt2-small", "layers": 4, "dropout": 0.1, "flag": True,
                   "other": False, "name": "a=b"}
    assert isinstance(got["layers"], int) and isinstance(got["dropout"], float)
    with pytest.raises(UserError, match="KEY=VALUE"):
        parse_model_args(["layers"])


def test_add_model_arguments_defaults():
    p = argparse.ArgumentParser()
    add_model_arguments(p)
    a = p.parse_args(["m.py", "--model-arg", "x=1", "--model-arg", "y=z"])
    assert (a.model_file, a.model_args, a.batch_size) == ("m.py", ["x=1", "y=z"], 8)


def test_load_and_call(tmp_path):
    path = tmp_path / "good.py"
    path.write_text(GOOD)
    mf = load_model_file(path)
    model = mf.build(hidden=3)
    inputs, target = mf.make_batch(5, hidden=3)
    assert isinstance(inputs, tuple) and inputs[0].shape == (5, 3)
    loss = mf.loss(model(*inputs), target)                 # default: MSE for float targets
    assert loss.dim() == 0
    # two files with the same stem do not collide
    other = tmp_path / "sub"
    other.mkdir()
    (other / "good.py").write_text(GOOD.replace("nn.Linear(hidden, 2)", "nn.Linear(hidden, 7)"))
    assert load_model_file(other / "good.py").build().out_features == 7
    assert load_model_file(path).build().out_features == 2


BAD_CASES = {
    "missing_file": (None, [], ["does not exist", "build_model"]),
    "syntax": ("def build_model(:\n    pass\n", [], ["syntax error", "line 1"]),
    "import": ("import torch\nimport no_such_module_xyz\n", [], ["failed to import", "no_such_module_xyz", "line 2"]),
    "no_make_batch": ("def build_model():\n    return None\n", [], ["does not define make_batch"]),
    "not_callable": ("build_model = 3\ndef make_batch(b):\n    pass\n", [], ["build_model", "not a function"]),
    "build_raises": (GOOD.replace("return nn.Linear(hidden, 2)", "raise RuntimeError('boom')"), [],
                     ["build_model", "RuntimeError: boom", "line 4"]),
    "not_a_module": (GOOD.replace("return nn.Linear(hidden, 2)", "return 42"), [],
                     ["build_model returned int", "torch.nn.Module"]),
    "unknown_arg": (GOOD, ["--model-arg", "hiden=3"], ["hiden", "It accepts: hidden"]),
    "make_batch_raises": (GOOD.replace("return torch.randn(batch_size, hidden), torch.randn(batch_size, 2)",
                                       "raise ValueError('bad batch')"), [], ["make_batch", "bad batch"]),
    "malformed_arg": (GOOD, ["--model-arg", "oops"], ["KEY=VALUE"]),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_input_exits_2_with_one_paragraph(case, tmp_path, capsys):
    text, extra, needles = BAD_CASES[case]
    path = tmp_path / f"{case}.py"
    if text is not None:
        path.write_text(text)
    rc = cli_main(["inspect", str(path), *extra])
    err = capsys.readouterr().err
    assert rc == 2
    assert "Traceback" not in err
    assert err.startswith("autopar inspect: error:")
    if case not in ("malformed_arg",):
        assert path.name in err
    for needle in needles:
        assert needle in err.replace("\n", " "), (needle, err)


def test_untraceable_root_forward_is_a_model_file_error(tmp_path, capsys):
    path = tmp_path / "root.py"
    path.write_text('''
import torch, torch.nn as nn
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
    def forward(self, x):
        if x.sum() > 0:
            return self.lin(x)
        return x
def build_model():
    return Net()
def make_batch(b):
    return torch.randn(b, 4), torch.randn(b, 4)
''')
    rc = cli_main(["inspect", str(path)])
    err = capsys.readouterr().err.replace("\n", " ")
    assert rc == 2 and "cannot be traced" in err and "root.py" in err and "Traceback" not in err


def test_build_accepting_kwargs_takes_any_arg(tmp_path):
    path = tmp_path / "kw.py"
    path.write_text(GOOD.replace("def build_model(hidden=4):", "def build_model(hidden=4, **extra):"))
    mf = load_model_file(path)
    mf.check_args({"anything": 1})
    with pytest.raises(ModelFileError):
        load_model_file(tmp_path / "absent.py")
