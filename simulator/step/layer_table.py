"""LayerTable: a plan's per-layer costs as named numpy columns.

One row per layer, one column per ``LayerCost`` field (layer_cost.py: seconds per micro-batch,
bytes per device) plus three columns of the layer's plan: ``zero`` (the ZeRO stage that runs,
axes/sharded_dp.effective_zero), ``offload`` (1.0 when offloaded to the host) and ``recompute``
(RECOMPUTE_CODE).  The columns share one (layers, columns) array so that a plan differing from
the last one in a few layers updates only those rows, and per-rank sums are one matrix product
(``LayerTable(onehot @ table.data)`` is the table of per-rank sums); readers address columns
by name: ``table.fwd_s``, ``table.zero``.  A registered cost term may add columns after these
(term_registry.py: ``add_columns``), before any table is built.
"""
from __future__ import annotations

import numpy as np

from autopar.simulator.step.layer_cost import LAYER_COST_FIELDS

RECOMPUTE_CODE = {"none": 0, "selective": 1, "full": 2}
PLAN_FIELDS = ("zero", "offload", "recompute")
COLUMNS = LAYER_COST_FIELDS + PLAN_FIELDS
COLUMN_INDEX = {name: i for i, name in enumerate(COLUMNS)}


class LayerTable:
    """Named columns over a (layers, len(COLUMNS)) float array (module docstring)."""
    __slots__ = ("data", "_columns")

    def __init__(self, data: np.ndarray):
        assert data.ndim == 2 and data.shape[1] == len(COLUMNS), data.shape
        self.data = data
        self._columns = data.T             # column i is _columns[i], a view

    def __len__(self) -> int:
        return self.data.shape[0]

    def column(self, name: str) -> np.ndarray:
        return self.data[:, COLUMN_INDEX[name]]

    def with_columns(self, **columns: np.ndarray) -> "LayerTable":
        """A copy with the named columns replaced."""
        out = self.data.copy()
        for name, values in columns.items():
            out[:, COLUMN_INDEX[name]] = values
        return LayerTable(out)

    def at(self, index) -> "LayerTable":
        """The rows at ``index`` (an index array) as a table."""
        return LayerTable(self.data[index])


def _column_property(name: str, i: int) -> property:
    return property(lambda self: self._columns[i], doc=f"the {name} column")


for _name, _i in COLUMN_INDEX.items():
    setattr(LayerTable, _name, _column_property(_name, _i))


def add_columns(names: tuple[str, ...]) -> None:
    """Append columns (a cost term's: term_registry.register) to COLUMNS, COLUMN_INDEX and the
    table's named properties."""
    global COLUMNS
    for name in names:
        if name in COLUMN_INDEX or hasattr(LayerTable, name):
            raise ValueError(f"layer table column {name!r} exists already")
    for name in names:
        COLUMN_INDEX[name] = len(COLUMNS)
        COLUMNS = COLUMNS + (name,)
        setattr(LayerTable, name, _column_property(name, COLUMN_INDEX[name]))


def remove_columns(names: tuple[str, ...]) -> None:
    """Undo ``add_columns`` of the last columns added (a test's toy term: term_registry.unregister)."""
    global COLUMNS
    if names and COLUMNS[-len(names):] != tuple(names):
        raise ValueError(f"columns {names} are not the last ones added")
    for name in names:
        del COLUMN_INDEX[name]
        delattr(LayerTable, name)
    COLUMNS = COLUMNS[:len(COLUMNS) - len(names)]
