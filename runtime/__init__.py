"""Run a plan.json with native torch.distributed (docs/design.md, "The runtime").

    torchrun --nproc-per-node 4 -m autopar.runtime plan.json --steps 50
    autopar run plan.json --steps 50

Modules, in the order a run uses them:

* ``options``        -- the command-line flags and the ``RunOptions`` the trainer receives;
* ``plan_check``     -- load the plan and its model file, capture, refuse a mismatch (exit 2);
* ``mesh``           -- process group (NCCL on CUDA, gloo on CPU) and the dp x pp x tp DeviceMesh;
* ``parallelize``    -- the one documented order that applies a plan:
  ``apply_pp`` (stages) -> ``apply_tp`` (TP / SP) -> ``recompute`` -> ``apply_dp`` (FSDP2 /
  replicate) -> ``materialize`` (shards only) -> ``apply_dp`` (DDP, ZeRO-1) -> optimizers;
* ``train``          -- the loop (``Trainer``: setup, one ``step`` per step, ``finish``): batches,
  steps, loss, checkpoints (``checkpointing``, DCP), measurements (``measure``,
  ``profile_breakdown``, ``model_state``) into measured.json;
* ``reference``      -- the single-process trainer the parity tests compare against;
* ``run_cli``        -- the ``autopar run`` verb (starts torchrun, or prints per-node commands).

Only ``autopar.core`` is imported: never the planner or the simulator.
"""
