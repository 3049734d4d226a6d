"""The reference of the FSDP2 float8 run in tests/integration/test_runtime_fp8.py: plain torch FSDP2 and
torchao, no autopar.

    python tests/fp8_fsdp_reference.py OUT.json STEPS ARGS_JSON GLOBAL_BATCH CHUNKS PORT

One process, a one-rank gloo group.  The model file's model (tests/plain_loop.py: its init under
the seed, its batches, AdamW with the runtime's documented defaults) has its linears whose dims
divide by 16 converted by torchao with the FSDP2 float8 all-gather (tensorwise), each block and
then the whole model ``fully_shard``ed with bf16 parameters and fp32 gradient reduction, and the
scales of the fp8 weights precomputed after each optimizer step -- the float8 recipe of
torchao's README and torchtitan's float8 runs.  ``CHUNKS`` > 1: each step runs the batch as that
many row blocks, gradients summed (the rows of each data-parallel rank: torchao scales the
activations of each block by its own amax, as each rank does).  Writes the losses.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plain_loop import BETAS, EPS, LR, SEED, WEIGHT_DECAY, _loss, draw_batch, load  # noqa: E402

GPT = Path(__file__).resolve().parent.parent / "examples" / "gpt.py"


def main() -> None:
    out, steps, args, global_batch = Path(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
    chunks = int(sys.argv[5])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", sys.argv[6])
    dist.init_process_group("gloo", rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torchao.float8 import (Float8LinearConfig, convert_to_float8_training,
                                precompute_float8_dynamic_scale_for_fsdp)

    module = load(GPT)
    torch.manual_seed(SEED)
    model = module.build_model(**args)
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True),
                               module_filter_fn=lambda m, fqn: m.in_features % 16 == 0 and m.out_features % 16 == 0)
    mesh = init_device_mesh("cpu", (1,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    losses = []
    for step in range(steps):
        inputs, target = draw_batch(module, global_batch, args, SEED, step)
        total = 0.0
        for i in range(chunks):
            loss = _loss(module, model(*(x.chunk(chunks)[i] for x in inputs)), target.chunk(chunks)[i]) / chunks
            loss.backward()
            total += float(loss.detach())
        opt.step()
        precompute_float8_dynamic_scale_for_fsdp(model)
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    dist.destroy_process_group()
    out.write_text(json.dumps(losses))


if __name__ == "__main__":
    main()
