"""How the pipeline's point-to-point exchange between stages runs, per runtime.

Two runtimes are described:

* ``TORCH_PIPELINING`` (autopar's runtime, runtime/apply_pp.py: torch.distributed.pipelining):
  a stage's output is sent with ``isend`` on NCCL's stream and the receiver waits only before
  the task that needs it, so the send overlaps the sender's next task.  Every tensor-parallel
  rank sends its own (replicated) copy of the boundary activation.  The step model charges the
  sends where the first micro-batch waits for them (pp.pipeline_time).
* ``MEGATRON_2021`` (Megatron-LM as the runs of Narayanan et al. 2021, Tables 1-2, ran it):
  ``p2p_communication._communicate`` posts the sends and receives with ``batch_isend_irecv``,
  waits on every request and then calls ``torch.cuda.synchronize()``, so the exchange holds the
  rank until it has completed: each task's send is part of the task (Narayanan et al. 2021,
  Sec. 2.2.2: the interleaved schedule does v times as many of them).  With the scatter/gather
  optimisation (Sec. 4.1, on in the paper's end-to-end runs, Sec. 5.1) each of the t
  tensor-parallel ranks sends 1/t of the activation over the inter-node link and the receiver
  all-gathers the pieces over NVLink within its tensor-parallel group.

Which one is priced is the cost model's training code (``TrainingCode.p2p``,
simulator/training_code.py): ``TORCH_PIPELINING`` for every plan the planner writes;
benchmarks/published_runs.py prices the PTD-P rows with ``MEGATRON_2021``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class P2PRuntime:
    """One runtime's pipeline exchange (module docstring)."""
    name: str
    blocking: bool            # the exchange holds the rank's compute until it has completed
    scatter_gather: bool      # 1/t of the activation per tensor-parallel rank, all-gathered on arrival


TORCH_PIPELINING = P2PRuntime("torch.distributed.pipelining", blocking=False, scatter_gather=False)
MEGATRON_2021 = P2PRuntime("Megatron-LM 2021 (batch_isend_irecv + synchronize, scatter/gather)",
                           blocking=True, scatter_gather=True)


def exchange_time(cm, boundary_bytes: float, tp: int, pp_link, pp_level: str, tp_link, tp_level: str,
                  processes: int | None) -> tuple[float, bool]:
    """(seconds, measured) of one activation exchange between neighbouring stages under the
    cost model's code (``cm.code.p2p``): one send of the whole tensor, or with scatter/gather a
    send of 1/t of it followed by the all-gather of the t pieces over the tensor-parallel group."""
    if not (cm.code.p2p.scatter_gather and tp > 1):
        return cm.collective_time_ex("p2p", boundary_bytes, 2, pp_link, pp_level, processes=processes)
    send, m1 = cm.collective_time_ex("p2p", boundary_bytes / tp, 2, pp_link, pp_level, processes=processes)
    gather, m2 = cm.collective_time_ex("all_gather", boundary_bytes, tp, tp_link, tp_level, processes=processes)
    return send + gather, m1 and m2


def task_lengths(f_g: np.ndarray, b_g: np.ndarray, send_s: float,
                 blocking: bool) -> tuple[np.ndarray, np.ndarray, float]:
    """(forward and backward length of each model chunk's task, the send left for the pipeline
    formula to charge): a blocking exchange is the last part of every task that sends (each
    chunk's forward but the last chunk's, each chunk's backward but the first's), and nothing is
    left outside the tasks; an asynchronous send stays outside them.  ``blocking``: the priced
    code's ``P2PRuntime.blocking``."""
    if not blocking or len(f_g) < 2:
        return f_g, b_g, send_s
    f_g = f_g.copy()
    b_g = b_g.copy()
    f_g[:-1] += send_s
    b_g[1:] += send_s
    return f_g, b_g, 0.0
