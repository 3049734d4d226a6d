"""``runtime/weights_in.py`` in one process: which blocks a rank reads, and what the check accepts.

The blocks are checked against ``distribute_tensor`` (torch's own cut of a full tensor to a
rank's placements) on each rank of a fake 2 x 2 process group (torch's ``FakeStore``: no
communication happens, the placements are computed as on a real mesh)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from safetensors.torch import save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from autopar.runtime.weights_in import Match, WeightsError, WeightsFile, WeightsSource, check_weights, local_block

# (placements on a (dp 2, tp 2) mesh, rows): uneven ZeRO-3 rows, FSDP2 over TP on one dim, a
# fused projection split per part (alone, and with FSDP2 on its other dim), 2-D splits
PLACEMENTS = [((Shard(0), Shard(0)), 30), ((_StridedShard(0, split_factor=2), Shard(0)), 28),
              ((Shard(1), _StridedShard(0, split_factor=3)), 36), ((Replicate(), _StridedShard(0, split_factor=3)), 36),
              ((Shard(0), Shard(1)), 30), ((Shard(0), Replicate()), 30)]


def test_a_rank_reads_exactly_its_local_tensor(tmp_path):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    gen = torch.Generator().manual_seed(0)
    fulls = {f"w{i}": torch.randn(rows, 12, generator=gen) for i, (_, rows) in enumerate(PLACEMENTS)}
    save_file(fulls, tmp_path / "w.safetensors")
    weights = WeightsFile.open(tmp_path / "w.safetensors")
    for rank in range(4):
        dist.init_process_group("fake", rank=rank, world_size=4, store=FakeStore())
        try:
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            for i, (placements, _) in enumerate(PLACEMENTS):
                want = distribute_tensor(fulls[f"w{i}"], mesh, placements, src_data_rank=None)
                assert local_block(want) is not None, (rank, placements)
                got = distribute_tensor(torch.zeros_like(fulls[f"w{i}"]), mesh, placements, src_data_rank=None)
                source = WeightsSource(weights, Match({f"w{i}": f"w{i}"}, []), None)
                assert source.read_local(f"w{i}", got), (rank, placements)
                assert torch.equal(got.to_local(), want.to_local()), (rank, placements)
                assert not source.full_reads
        finally:
            dist.destroy_process_group()


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.ones(4))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))


def test_check_resolves_ties_keeps_missing_buffers_and_casts_floats(tmp_path):
    model = Tied()
    save_file({"embed.weight": torch.randn(8, 4).to(torch.bfloat16)}, tmp_path / "a.safetensors")
    match = check_weights(WeightsFile.open(tmp_path / "a.safetensors"), model)
    assert match.key_of == {"embed.weight": "embed.weight", "head.weight": "embed.weight"}
    assert "bfloat16 values cast to the model's float32" in match.notes[0]


@pytest.mark.parametrize("state,fragment", [
    ({"head.weight": torch.zeros(8, 4), "extra": torch.zeros(1)}, "does not have: extra"),
    ({"embed.weight": torch.zeros(8, 5)}, "shapes differ: embed.weight [8, 5]"),
    ({"embed.weight": torch.zeros(8, 4), "steps": torch.zeros(())}, "dtypes differ"),
    ({"scale": torch.ones(4)}, "parameter(s) embed.weight"),
])
def test_check_refuses_what_does_not_fit(tmp_path, state, fragment):
    save_file(state, tmp_path / "b.safetensors")
    with pytest.raises(WeightsError) as e:
        check_weights(WeightsFile.open(tmp_path / "b.safetensors"), Tied())
    assert fragment in str(e.value)


def test_torch_state_dict_and_folders(tmp_path):
    model = Tied()
    torch.save(model.state_dict(), tmp_path / "sd.pt")
    assert set(check_weights(WeightsFile.open(tmp_path / "sd.pt"), model).key_of) == {"embed.weight", "head.weight",
                                                                               "scale", "steps"}
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightsError, match="holds neither"):
        WeightsFile.open(tmp_path / "empty")
    (tmp_path / "bad.pt").write_bytes(b"not a pickle")
    with pytest.raises(WeightsError, match="cannot be read as a torch state dict"):
        WeightsFile.open(tmp_path / "bad.pt")
