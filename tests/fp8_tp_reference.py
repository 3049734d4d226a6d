"""The reference of the tensor-parallel float8 run in tests/integration/test_runtime_fp8.py: plain DTensor
tensor parallelism and torchao, no autopar.

    torchrun --nproc-per-node 2 tests/fp8_tp_reference.py OUT.json STEPS

The small GPT of tests/runtime_support.py (its init under the seed, its batches, AdamW with the
runtime's documented defaults: tests/plain_loop.py) with every linear torchao's Float8Linear
(tensorwise), each block's attention and MLP split Megatron-style with torch's
``ColwiseParallel`` / ``RowwiseParallel`` over the 2 ranks, the forward under bf16 autocast
(fp32 master weights).  Rank 0 writes the losses.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plain_loop import BETAS, EPS, LR, SEED, WEIGHT_DECAY, _loss, draw_batch, load  # noqa: E402

GPT = Path(__file__).resolve().parent.parent / "examples" / "gpt.py"
ARGS = {"layers": 4, "hidden": 32, "heads": 4, "seq": 16, "vocab": 64, "dropout": 0.0}   # runtime_support's
GLOBAL_BATCH = 4


def main() -> None:
    out, steps = Path(sys.argv[1]), int(sys.argv[2])
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    module = load(GPT)
    torch.manual_seed(SEED)
    model = module.build_model(**ARGS)
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        parallelize_module(block, mesh, {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                                         "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()})
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    losses = []
    for step in range(steps):
        inputs, target = draw_batch(module, GLOBAL_BATCH, ARGS, SEED, step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _loss(module, model(*inputs), target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    if dist.get_rank() == 0:
        out.write_text(json.dumps(losses))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
