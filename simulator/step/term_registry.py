"""The step's cost terms, declared: which layer-table columns each one reads or adds, whether it
is local to a layer, and how it enters the critical path.

Every reader of the step iterates over what is registered here instead of naming the terms:
the step's composition (compose.py: the step model in both forms, the planner's folded tables'
and screening bound's per-layer terms), the evaluator's fast path (evaluator._derive and the
LayerMemo invariant) and the trace (trace.py).
The built-in terms are declared in builtin_terms.py, which the package's __init__.py imports
(so they are registered before any simulator module is used, and before any term a caller
adds); a new term is one
module that calls ``register`` (docs/design.md, "Adding a cost term").

How a term enters the step (``Term.enters``):

* ``"compute"``: seconds on the layer's critical path in each pass -- ``fwd`` names the column
  added to the layer's forward, ``bwd`` the one added to its backward.  overlap.compute_per_pass
  sums the layer's own work in registration order, then adds the sum of the terms marked
  ``collective`` (the in-layer collectives: tp, cp, ep), also in registration order (so the
  built-in terms' sums are the same floating-point operations as when cp and ep were part of the
  tp columns); a full recompute reruns the forward's collectives (cpu_node.with_meeting_waits
  reads them apart: overlap.collectives_per_pass); the trace draws each term as an event on its
  ``stream``;
* ``"traffic"``: per-layer transfers on the data-parallel stream, overlapped with compute --
  ``traffic(src, zero, offload, pipeline_m)`` gives (before forward, before backward, after
  backward) per micro-batch or None (``pipeline_m``: a pipeline's micro-batches, None without one); overlap.fsdp_traffic sums them in registration order (built in: the FSDP all-gather and
  reduce-scatter, the offload copies), the trace draws each part under ``gather_label`` and
  ``scatter_label`` on the term's ``stream``;
* ``"table"``: a rewrite of the plan's whole layer table before the step is composed
  (``derive(rows, ctx, evaluator)``), e.g. DDP's buckets, sharded data parallelism's copies;
* ``"pipeline"``: the schedule over the model chunks (pp.pipeline_time);
* ``"after_backward"``: per pipeline rank after its last backward (dp_sync.after_backward).

``local``: a layer's contribution depends only on its own row and its neighbours' (k-1, k+1),
so the evaluator may memoise each layer's derived row (step/layer_memo.LayerMemo).  A term that is
not local declares ``acts(ctx)``: whether it can change anything in that context; where one
does, the evaluator prices every plan of the context in full.

``columns``: the columns the term adds to the layer table (layer_table.COLUMNS, after
``LayerCost``'s and the layer plan's), each with ``fill(layer_cost, layer_plan, mesh)`` giving a
layer's value; ``reads``: the existing columns its price reads (documentation, and
tests/simulator/test_simulator_terms.py checks they exist).

Registration happens before an evaluator is built: the evaluator reads the table width when it
is constructed.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Iterator

from autopar.simulator.step import layer_table
from autopar.simulator.step.layer_cost import layer_cost_row

ENTRIES = ("compute", "traffic", "table", "pipeline", "after_backward")


@dataclass(frozen=True)
class Column:
    """A column a term adds to the layer table; ``fill(layer_cost, layer_plan, mesh)`` -> float."""
    name: str
    fill: Callable


@dataclass(frozen=True)
class Term:
    """One cost term of the step (module docstring)."""
    name: str
    enters: str
    local: bool = True
    reads: tuple[str, ...] = ()
    columns: tuple[Column, ...] = ()
    fwd: str | None = None              # "compute": the column added to the layer's forward
    bwd: str | None = None              # ... to its backward
    stream: str = "compute"             # the trace stream of its "compute" events
    collective: bool = False            # "compute": an in-layer collective (summed with the others)
    fwd_label: str = ""                 # the trace's event names ("<label> L<layer>")
    bwd_label: str = ""
    traffic: Callable | None = None     # "traffic": (src, zero, offload, pipeline_m) -> (fwd, bwd gather, after bwd) or None
    gather_label: str = ""              # "traffic": trace names of its parts before a pass and after backward
    scatter_label: str = ""
    derive: Callable | None = None      # "table": (rows, ctx, evaluator) -> rows
    acts: Callable | None = None        # not local: (ctx) -> bool, whether it changes this context's rows
    source: str = ""                    # where its mechanism and math live

    def __post_init__(self):
        if self.enters not in ENTRIES:
            raise ValueError(f"term {self.name!r}: enters {self.enters!r}, not one of {ENTRIES}")
        if self.enters == "table" and self.derive is None:
            raise ValueError(f"term {self.name!r} enters the table and has no derive function")
        if self.enters == "traffic" and self.traffic is None:
            raise ValueError(f"term {self.name!r} is traffic and has no traffic function")
        if not self.local and self.acts is None:
            raise ValueError(f"term {self.name!r} is not local and says not when it acts (acts)")


_TERMS: list[Term] = []
#: derived views of _TERMS, rebuilt on every change (read on the hot path)
_view = SimpleNamespace(fwd=(), bwd=(), events=((), ()), traffic=(), tables=(), nonlocal_tables=(), extra=())


def _rebuild() -> None:
    compute = [t for t in _TERMS if t.enters == "compute"]
    own = [t for t in compute if not t.collective]
    collectives = [t for t in compute if t.collective]
    _view.fwd = (tuple(t.fwd for t in own if t.fwd), tuple(t.fwd for t in collectives if t.fwd))
    _view.bwd = (tuple(t.bwd for t in own if t.bwd), tuple(t.bwd for t in collectives if t.bwd))
    _view.events = (tuple((t.fwd, t.fwd_label, t.stream) for t in compute if t.fwd),
                    tuple((t.bwd, t.bwd_label, t.stream) for t in compute if t.bwd))
    _view.traffic = tuple(t for t in _TERMS if t.enters == "traffic")
    _view.tables = tuple(t for t in _TERMS if t.enters == "table")
    _view.nonlocal_tables = tuple(t for t in _TERMS if not t.local)
    _view.extra = tuple(c for t in _TERMS for c in t.columns)


def register(term: Term) -> Term:
    """Add ``term`` after those registered (its columns after theirs); returns it."""
    if any(t.name == term.name for t in _TERMS):
        raise ValueError(f"a term named {term.name!r} is registered already")
    layer_table.add_columns(tuple(c.name for c in term.columns))
    _TERMS.append(term)
    _rebuild()
    return term


def unregister(name: str) -> None:
    """Remove the term ``name`` (a test's toy term); its columns must be the last ones added."""
    term = next(t for t in _TERMS if t.name == name)
    layer_table.remove_columns(tuple(c.name for c in term.columns))
    _TERMS.remove(term)
    _rebuild()


@contextmanager
def registered(term: Term) -> Iterator[Term]:
    """``term`` registered for the ``with`` block."""
    register(term)
    try:
        yield term
    finally:
        unregister(term.name)


def terms() -> tuple[Term, ...]:
    """The registered terms, in registration order."""
    return tuple(_TERMS)


def pass_columns() -> tuple[tuple[tuple[str, ...], tuple[str, ...]], tuple[tuple[str, ...], tuple[str, ...]]]:
    """(forward, backward), each (the columns the "compute" terms add to the pass, those the
    ``collective`` ones add -- the in-layer collectives), in registration order."""
    return _view.fwd, _view.bwd


def pass_events() -> tuple[tuple, tuple]:
    """(forward, backward): per "compute" term, (column, event label, stream), in order."""
    return _view.events


def traffic_terms() -> tuple[Term, ...]:
    """The "traffic" terms, in the order their parts are summed and drawn."""
    return _view.traffic


def table_terms() -> tuple[Term, ...]:
    """The "table" terms, in the order they rewrite the table."""
    return _view.tables


def memo_safe(ctx) -> bool:
    """Whether every term that acts in context ``ctx`` is local (step/layer_memo.LayerMemo may serve)."""
    return not any(t.acts(ctx) for t in _view.nonlocal_tables)


def extra_columns() -> tuple[Column, ...]:
    """The columns the terms add to the layer table, in table order."""
    return _view.extra


def layer_row(lc, zero: float, offload: float, recompute: float, lp, mesh) -> tuple[float, ...]:
    """A layer's row of the table: its ``LayerCost`` fields, its plan's three columns
    (layer_table.PLAN_FIELDS) and the registered terms' columns."""
    row = layer_cost_row(lc) + (zero, offload, recompute)
    extra = _view.extra
    if extra:
        row += tuple(float(c.fill(lc, lp, mesh)) for c in extra)
    return row


def with_term_columns(lc, lp, mesh):
    """``lc`` (a LayerCost) readable by every column name: itself where no term adds a column,
    else a namespace with the terms' columns too (planner/layer_tables.py, screen_bound.py)."""
    extra = _view.extra
    if not extra:
        return lc
    ns = SimpleNamespace(**{f: getattr(lc, f) for f in layer_table.LAYER_COST_FIELDS})
    for c in extra:
        setattr(ns, c.name, float(c.fill(lc, lp, mesh)))
    return ns
