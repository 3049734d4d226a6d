"""The fast path's memo of derived rows: what ``PlanEvaluator.evaluate`` reads per layer, kept
for later plans so that a plan that changes a few layers looks up a few rows and redoes only the
reductions over layers (evaluator.py)."""
from __future__ import annotations

from itertools import compress
from operator import is_not
from typing import Callable

import numpy as np

from autopar.core.errors import InfeasibleError
from autopar.core.plan import Plan
from autopar.simulator.step.context import Context, memo_settings
from autopar.simulator.step.layer_rows import LayerRows
from autopar.simulator.step.layer_table import COLUMN_INDEX, LayerTable
from autopar.simulator.axes.dp_sync import last_reduce_scatter
from autopar.simulator.step.compose import layer_effective_times

#: columns whose maximum over a model chunk's layers enters memory (transient and FSDP buffers)
MAX_COLUMNS = [COLUMN_INDEX[c] for c in ("transient_bytes", "fsdp_param_buffer_bytes", "fsdp_grad_buffer_bytes")]
_ACTIVATION, _OUTPUT, _ZERO, _OFFLOAD, _RS, _D2H = (
    COLUMN_INDEX[c] for c in ("activation_bytes", "output_bytes", "zero", "offload", "dp_reducescatter_s", "d2h_s"))
#: the fast path's derived table (derived_table): per layer the effective forward
#: and backward time, the activation bytes, the three MAX_COLUMNS, the
#: dp_sync.last_reduce_scatter term on the first layer of each model chunk (zero elsewhere) and
#: the output bytes on its last layer (zero elsewhere) -- both nonnegative, so a chunk's maximum of
#: them is the value at its first / last layer -- then the columns (as many as the registered
#: terms make: PlanEvaluator._table_width)
FWD, BWD, ACT, MAXIMA, LAST_RS, OUT_END = 0, 1, 2, 3, 6, 7
NUM_DERIVED = 8



class LayerMemo:
    """What ``prepare`` and ``layer_effective_times`` derive per layer, kept for later plans.

    Layer k's derived row (its row after sharded_dp, then its effective forward and backward
    time and the other per-layer terms of derived_table) is a function of the rows
    of layers k-1, k, k+1 and of k's place in its model chunk: sharded_dp.with_sharded_dp_costs
    reads the neighbours k-1 and k+1 and leaves the columns layer_effective_times reads of a
    layer's successor (its forward communication: dp_allgather_s, h2d_s, zero, offload) a function
    of the layer's own row (both say so; tests/simulator/test_simulator_fast_path.py holds them to it).
    Both apply elementwise IEEE operations to each layer, so layer k's numbers are the same bits
    whatever the other layers hold.  Two whole-table tests choose what is computed at all -- does any layer run
    sharded (ZeRO >= 2), is any offloaded -- so the values are kept per answer to both.
    ``values`` maps (those two answers and k's position class in one integer, the row ids of
    k-1, k, k+1) to the derived row; ``layers``, ``ids``, ``table``, ``counts``: the last plan's
    layer plans, row ids, derived table and its numbers of sharded, of offloaded and of ZeRO-1
    layers.
    """
    __slots__ = ("values", "layers", "ids", "table", "counts")

    #: entries kept before the memo starts afresh (each holds one row of about 40 floats)
    ENTRIES = 1 << 14

    def __init__(self):
        self.values: dict[tuple, np.ndarray] = {}
        self.layers: tuple | None = None
        self.ids: list[int] | None = None
        self.table: np.ndarray | None = None
        self.counts = (0, 0, 0)


def derived_table(plan: Plan, ctx: Context, layer_rows: LayerRows, derive: Callable[[LayerTable, Context], LayerTable],
                  table_width: int) -> tuple[np.ndarray, tuple[int, int, int]]:
    """((layers, table_width) table, (layers that run sharded, are offloaded, run ZeRO-1)): the plan's derived
    rows (``derive``: PlanEvaluator._derive), then per layer its effective forward and backward time
    (layer_effective_times), its activation bytes, its MAX_COLUMNS and its
    dp_sync.last_reduce_scatter -- the layers unchanged since the last plan of this context
    taken from it and the changed ones' neighbourhoods from the memo (LayerMemo): the same
    numbers as computing them all."""
    layers = plan.layers
    num_layers = layer_rows.num_layers
    if len(layers) != num_layers:
        raise InfeasibleError(f"plan has {len(layers)} layer entries, the model {num_layers} layers")
    settings = memo_settings(ctx)
    memo = ctx.memos.get(settings)
    if memo is None:
        memo = ctx.memos[settings] = LayerMemo()
    old_layers = memo.layers
    row_flags = layer_rows.row_flags
    changed = rows = None
    if old_layers is None:
        # (the rows of the last plan of another context with the same rows_key serve)
        rows, ids = layer_rows.rows_and_ids(plan, ctx)
        counts = tuple(sum(row_flags[i][j] for i in ids) for j in range(3))
    elif layers is old_layers:
        return memo.table, memo.counts
    else:
        # the layers that are other objects (in C: a search keeps the unchanged ones), then
        # those of them whose row differs
        moved = compress(range(num_layers), map(is_not, layers, old_layers))
        last = memo.ids
        ids = None
        changed = []
        for i in moved:
            row_id = layer_rows.row(i, layers[i], ctx)[1]
            if row_id != last[i]:
                if ids is None:
                    ids = last.copy()             # the last plan's ids are never written
                ids[i] = row_id
                changed.append(i)
        if ids is None:
            memo.layers = layers
            return memo.table, memo.counts
        n_sharded, n_offloaded, n_zero1 = memo.counts
        for k in changed:
            new, old = row_flags[ids[k]], row_flags[last[k]]
            n_sharded += new[0] - old[0]
            n_offloaded += new[1] - old[1]
            n_zero1 += new[2] - old[2]
        counts = (n_sharded, n_offloaded, n_zero1)
    # the two whole-table answers and the position class in one small integer
    code = 16 * (counts[0] > 0) + 8 * (counts[1] > 0)
    table = None
    wanted = []
    if changed is not None and len(changed) <= num_layers // 4:
        # (a layer named twice is looked up twice: the same value)
        affected = [j for k in changed for j in (k - 1, k, k + 1) if 0 <= j < num_layers]
        values = memo.values
        cls = ctx.position_class
        last_layer = num_layers - 1
        table = memo.table.copy()
        for k in affected:
            key = (code + cls[k], ids[k - 1] if k else -1, ids[k], ids[k + 1] if k < last_layer else -1)
            vec = values.get(key)
            if vec is None:
                wanted.append((k, key))
            else:
                table[k] = vec
    if table is None or wanted:
        if rows is None:
            rows, _ = layer_rows.rows_and_ids(plan, ctx)
        derived = derive(LayerTable(rows), ctx)
        fwd, bwd = layer_effective_times(derived, ctx.head, ctx.tail, ctx.not_tail, ctx.pipeline_m)
        data = derived.data
        table = np.empty((num_layers, table_width))
        table[:, NUM_DERIVED:] = data
        table[:, FWD] = fwd
        table[:, BWD] = bwd
        table[:, ACT] = data[:, _ACTIVATION]
        table[:, MAXIMA:MAXIMA + 3] = data[:, MAX_COLUMNS]
        last_rs = last_reduce_scatter(data[:, _RS], data[:, _D2H], data[:, _OFFLOAD], data[:, _ZERO])
        table[:, LAST_RS] = last_rs * ctx.head
        table[:, OUT_END] = data[:, _OUTPUT] * ctx.tail
        if len(memo.values) + len(wanted) > LayerMemo.ENTRIES:
            memo.values.clear()
        for k, key in wanted:
            memo.values[key] = table[k].copy()
    memo.layers, memo.ids, memo.table, memo.counts = layers, ids, table, counts
    return table, counts
