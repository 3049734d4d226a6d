"""The micro-batch sizes the search leaves out because the model cannot take them.

``refuse_micro_batches`` asks core/micro_batch_probe.py which of the sizes the search may use
(the divisors of the global batch up to ``max_micro_batch``, or the fixed ``--micro-batch``) the
model's own forward and loss fail at -- a BatchNorm model at one sample per micro-batch -- and
returns the options with those sizes refused plus one ``left out`` line per size for the plan
summary and plan.json.  A fixed ``--micro-batch`` the model cannot take, or a global batch
none of whose sizes it can, is a UserError that says so.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from autopar.core.errors import UserError
from autopar.core.graph import OpGraph
from autopar.planner.integers import divisors


@dataclass(frozen=True)
class MicroBatchNote:
    kind: str
    reason: str

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "reason": self.reason}


def refuse_micro_batches(options, graph: OpGraph, model_file) -> tuple[object, list[MicroBatchNote]]:
    """(``options`` with ``refused_micro_batches`` set, a left-out note per refused size)."""
    from autopar.core.micro_batch_probe import refused_sizes

    if options.micro_batch is not None:
        sizes = [options.micro_batch]
    else:
        sizes = [s for s in divisors(options.global_batch)
                 if options.max_micro_batch is None or s <= options.max_micro_batch]
    refused = refused_sizes(model_file, dict(graph.model_args), graph.batch_size, sizes)
    if not refused:
        return options, []

    def samples(n: int) -> str:
        return f"{n} sample{'s' if n != 1 else ''}"

    if options.micro_batch is not None:
        raise UserError(f"--micro-batch {options.micro_batch}: the model cannot train on "
                        f"{samples(options.micro_batch)} per micro-batch: {refused[options.micro_batch]}. "
                        f"Use a larger --micro-batch, or leave --micro-batch out.")
    if len(refused) == len(sizes):
        raise UserError(f"--global-batch {options.global_batch}: the model cannot train on micro-batches of "
                        f"{' or '.join(samples(s) for s in sizes)}: {refused[sizes[0]]}. Use a larger --global-batch.")
    notes = [MicroBatchNote(f"micro-batch {s}", f"the model cannot train on {samples(s)} per micro-batch: {why}; "
                                                f"plans with larger micro-batches are searched")
             for s, why in sorted(refused.items())]
    return replace(options, refused_micro_batches=frozenset(refused)), notes
