"""Process group and DeviceMesh from a plan's mesh.

The backend follows the device: NCCL when CUDA is available, gloo otherwise.  The mesh is
``init_device_mesh(device, dims.shape, mesh_dim_names=dims.axis_names)`` over the plan's named
axes (``core/parallel_dims.py``: ``(dp, pp, cp, tp)``), whose rank layout is
``arange(world).view(*dims.shape)`` -- the layout ``ParallelDims`` defines, so
``dims.coords_by_axis(rank)`` and the DeviceMesh agree.  Size-1 axes stay in the mesh (a size-1
sub-mesh is harmless) and every ``apply_*`` function receives the 1-D mesh it needs, asked for
by name: ``RankContext.get_mesh("tp")`` for one axis, ``get_mesh("grad")`` for a named group of
``ParallelDims.GROUPS`` (dp x cp flattened, torchtitan's ``dp_cp``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from types import MappingProxyType
from typing import Mapping

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autopar.core.plan import Mesh
from autopar.runtime.ports import free_port

PROCESS_GROUP_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class RankContext:
    """Where this process sits: global rank, device, and its coordinate on each named axis."""
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    coords: Mapping[str, int]        # axis name -> this rank's coordinate (ParallelDims.coords_by_axis)
    mesh: DeviceMesh
    dims: Mesh
    _flat: dict = field(default_factory=dict, compare=False, repr=False)    # get_mesh's flattened meshes

    @classmethod
    def build(cls, dims: Mesh, rank: int, local_rank: int, device: torch.device, mesh: DeviceMesh) -> "RankContext":
        return cls(rank=rank, world_size=dims.world_size, local_rank=local_rank, device=device,
                   coords=MappingProxyType(dims.coords_by_axis(rank)), mesh=mesh, dims=dims)

    def get_mesh(self, names) -> DeviceMesh:
        """The 1-D mesh over ``names`` -- an axis name, a group name of ``ParallelDims.GROUPS``
        (``"grad"``: dp x cp) or a list of axis names -- as torchtitan's
        ``parallel_dims.get_mesh(["dp", "cp"])``: the first axis's sub-mesh while the others have
        one rank, else the axes flattened into one dimension named by joining them
        (``mesh["dp", "cp"]._flatten("dp_cp")``), built once.  Its ranks are
        ``dims.get_group(names, rank)``."""
        axes = self.dims.group_axes(names)
        if all(self.dims.size(a) == 1 for a in axes[1:]):
            return self.mesh[axes[0]]
        if axes not in self._flat:
            self._flat[axes] = self.mesh[axes]._flatten("_".join(axes))
        return self._flat[axes]

    @property
    def dp_rank(self) -> int:
        return self.coords["dp"]

    @property
    def pp_rank(self) -> int:
        return self.coords["pp"]

    @property
    def tp_rank(self) -> int:
        return self.coords["tp"]

    @property
    def is_logging_rank(self) -> bool:
        return self.rank == 0


def device_for_local_rank(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def launched_world_size() -> int:
    """WORLD_SIZE from the launcher (torchrun sets it); 1 for a plain ``python -m`` run."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(plan_mesh: Mesh) -> RankContext:
    """Start the process group (if the launcher has not) and build the DeviceMesh of the plan's axes."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = device_for_local_rank(local_rank)
    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:      # a plain single-process run
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
            os.environ.setdefault("RANK", "0")
            os.environ.setdefault("WORLD_SIZE", "1")
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=PROCESS_GROUP_TIMEOUT, store=_attempt_store(),
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                                device_id=device if device.type == "cuda" else None)
    mesh = init_device_mesh(device.type, plan_mesh.shape, mesh_dim_names=plan_mesh.axis_names)
    return RankContext.build(plan_mesh, dist.get_rank(), local_rank, device, mesh)


#: set by ``autopar.elastic.agent`` for its workers: the rendezvous round they belong to
ATTEMPT_ENV = "AUTOPAR_ATTEMPT"


def _attempt_store() -> dist.Store | None:
    """Under torchrun, the agent's store with a prefix per restart attempt.

    torchrun keeps one rendezvous store across ``--max-restarts`` attempts; without a prefix,
    a restarted rank can read the previous attempt's gloo addresses and fail to connect.
    ``None`` (plain ``env://``) outside torchrun.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=False, timeout=PROCESS_GROUP_TIMEOUT)
    # an elastic run's agent names the rendezvous round instead (autopar.elastic.agent): a
    # membership change restarts the workers without counting a restart
    attempt = os.environ.get(ATTEMPT_ENV) or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"autopar/attempt_{attempt}", store)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
