"""A model file captured again at another batch size reuses the module built and its fx trace
(core/capture._BUILT, core/trace_fx._TRACED): the graph is the one a fresh build and trace give."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from autopar.core import capture as capture_mod
from autopar.core.capture import capture_model_file

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CASES = {
    "moe.py": dict(layers=3, hidden=64, heads=4, kv_heads=2, experts=8, top_k=2, expert_ffn=32, shared_ffn=32,
                   dense_layers=1, seq=32, vocab=101),
    "gpt.py": dict(layers=2, hidden=64, heads=4, seq=32, vocab=101),
}


def _content(graph) -> dict:
    """The graph without its timings."""
    out = {f.name: getattr(graph, f.name) for f in dataclasses.fields(graph) if f.name not in ("notes", "capture_s")}
    out["notes"] = [n for n in graph.notes if not n.startswith(("build_model + make_batch", "trace + shapes"))]
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_capture_again_at_another_batch_equals_a_fresh_capture(name):
    path, args = EXAMPLES / name, CASES[name]
    fresh = {}
    for b in (1, 3):
        capture_mod._BUILT.clear()
        fresh[b] = _content(capture_model_file(path, args, b))
    capture_mod._BUILT.clear()
    first = capture_model_file(path, args, 3)
    built = next(iter(capture_mod._BUILT.values()))
    again = capture_model_file(path, args, 1)
    assert next(iter(capture_mod._BUILT.values())) is built          # reused, not rebuilt
    assert _content(first) == fresh[3]
    assert _content(again) == fresh[1]
    assert [o.output_shape for o in again.ops] != [o.output_shape for o in first.ops]   # the new batch
    capture_mod._BUILT.clear()
