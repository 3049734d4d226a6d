"""PowerSGD on gloo runs with every gradient in one DDP bucket (runtime/apply_dp.py
``one_bucket_on_gloo``): torch's hook waits, inside one bucket's future callback, for a collective
that gloo queues behind the next bucket's, so two buckets hang both ranks
(benchmarks/grad_compression_loss.py's 1.9 MB model did, with DDP's 1 MiB first bucket)."""
import torch.nn as nn

from autopar.runtime.apply_dp import one_bucket_on_gloo


def test_one_bucket_above_the_gradients_only_for_powersgd_on_gloo():
    model = nn.Sequential(nn.Linear(512, 1024), nn.Linear(1024, 512))     # 1.05 M fp32 elements: 4 MiB
    grad_mib = sum(p.numel() * 4 for p in model.parameters()) / 2**20
    kw = one_bucket_on_gloo(model, "powersgd:2", "gloo")
    assert kw["bucket_cap_mb"] > grad_mib > 1          # above DDP's 1 MiB first bucket and the whole model
    assert one_bucket_on_gloo(model, "powersgd:2", "nccl") == {}
    assert one_bucket_on_gloo(model, "bf16", "gloo") == {} == one_bucket_on_gloo(model, "none", "gloo")
