"""Run a plan.json with native torch.distributed (docs/design.md, "The runtime").

    torchrun --nproc-per-node 4 -m autopar.runtime plan.json --steps 50
    autopar run plan.json --steps 50

Modules, in the order a run uses them:

* ``options``        -- the command-line flags and the ``RunOptions`` the trainer receives;
* ``output_paths``   -- ``--checkpoint-dir``, ``--measured``, ``--metrics`` and ``--tensorboard``
  probed for writing before any work;
* ``plan_check``     -- load the plan and its model file, capture, refuse a mismatch (exit 2),
  with ``tp_check`` (tensor-parallel splits the tp degree divides);
* ``data_check``     -- ``--data`` / ``--val-data`` token files refused before training (exit 2):
  missing, truncated, too short, ids outside the vocabulary (``token_data``: the file and its
  sample rule);
* ``mesh``           -- process group (NCCL on CUDA, gloo on CPU) and the dp x pp x tp DeviceMesh;
* ``ties``           -- weight ties found on the meta model and kept through every step;
* ``parallelize``    -- the one documented order that applies a plan:
  ``apply_pp`` (stages) -> ``apply_tp`` (TP / SP) -> ``recompute`` -> ``apply_dp`` (FSDP2 /
  replicate) -> ``materialize`` (shards only) -> ``apply_dp`` (DDP, ZeRO-1) -> optimizers;
* ``optimizer_control`` -- around each optimizer step: the learning rate of ``lr_schedule``
  (warm-up, constant / linear / cosine), the global gradient norm and ``--grad-clip``
  (``grad_norm``: each piece of the model counted once, whatever the layout), betas and weight decay;
* ``train``          -- the loop (``Trainer``: setup, one ``step`` per step, ``finish``): batches
  (``batches``: synthetic, a token file's rows of this rank prefetched a step ahead, or the model
  file's ``batches()``; ``batch_check``), evaluation (``evaluate``: ``--val-data``), steps, loss (``loss_guard``: stop on non-finite), checkpoints
  (``checkpointing``: DCP with a verified manifest), measurements (``measure``,
  ``profile_breakdown``, ``model_state``) into measured.json; ``metrics``: the log line (lr, grad
  norm, tokens/s, MFU, memory), ``--metrics`` jsonl, TensorBoard and the progress line;
* ``api``            -- ``autopar.prepare``: a plan applied inside the user's own loop
  (``PreparedJob.step`` is the trainer's step), docs/runtime.md;
* ``rank_errors``    -- the first failing rank's message and exit code, from any rank;
* ``run_cli``        -- the ``autopar run`` verb: its flags, then ``run_launch.launch``;
* ``run_launch``     -- start torchrun for a plan (through ``launch``), or print the per-node
  commands; ``run_plan`` is the same launch for other verbs (``autopar plan --trial-steps``);
* ``dry_run``        -- one plan applied by ``parallelize`` and run forward and backward on fake
  ranks in one process, the first error as text (the planner's runtime check calls it).

Only ``autopar.core`` is imported: never the planner or the simulator.
"""
