"""Run a plan.json with native torch.distributed (docs/design.md, "The runtime").

    torchrun --nproc-per-node 4 -m autopar.runtime plan.json --steps 50
    autopar run plan.json --steps 50

Modules, in the order a run uses them:

* ``run_cli`` / ``run_launch`` / ``launch`` / ``launch_cli`` -- the ``autopar run`` verb (its
  flags; ``run_launch``: torchrun through ``launch``, which reports a failure once, or the
  per-node commands; ``run_plan``, the same launch for other verbs) and ``autopar launch
  --slurm`` (``slurm_script``); ``__main__`` is one training process (``stop_signals``: SIGTERM /
  Ctrl-C stop at a step boundary);
* ``options``        -- the command-line flags and the ``RunOptions`` the trainer receives;
* ``output_paths``, ``checkpoint_lock`` -- the outputs probed for writing before any work, one run
  per checkpoint folder;
* ``plan_check``     -- load the plan and its model file, capture, refuse a mismatch (exit 2),
  with ``tp_check`` (splits the tp degree divides) and ``fp8_check`` (float8 where it can run);
* ``data_check``     -- ``--data`` / ``--val-data`` token files refused before training (exit 2)
  (``token_data``: the file and its sample rule);
* ``mesh``           -- process group (NCCL on CUDA, gloo on CPU) and the DeviceMesh over the plan's
  axes (dp, pp, cp, tp); ``RankContext.get_mesh`` gives a 1-D mesh by axis or group name
  (``"grad"``: dp x cp flattened, ``ParallelDims.GROUPS``);
* ``ties``           -- weight ties found on the meta model and kept through every step;
* ``parallelize``    -- the one documented order that applies a plan, one ``apply_*`` module per
  technique: ``apply_pp`` (stages) -> ``apply_fp8`` (float8 linears) -> ``apply_tp`` (TP / SP;
  ``fused_tp``, ``expert_tp``) -> ``apply_ep`` (experts; ``expert_calls``) -> ``recompute`` ->
  ``apply_compile`` -> ``apply_dp`` (FSDP2 / replicate) -> ``materialize`` (shards only;
  ``weights_in``: ``--init-from``) -> ``apply_dp`` (DDP, ZeRO-1) -> optimizers; ``apply_cp``
  (context parallelism) slices the batch and runs attention over the cp group;
* ``optimizer_control`` -- around each optimizer step: the learning rate of ``lr_schedule``
  (warm-up, constant / linear / cosine), the global gradient norm and ``--grad-clip``
  (``grad_norm``: each piece of the model counted once, whatever the layout), betas and weight decay;
* ``train``          -- the loop (``Trainer``: setup, one ``step`` per step, ``finish``): batches
  (``batches``: synthetic, a token file's rows of this rank prefetched a step ahead, or the model
  file's ``batches()``; ``batch_check``), evaluation (``evaluate``: ``--val-data``), loss
  (``loss_guard``: stop on non-finite), checkpoints (``checkpointing``: DCP with a verified
  manifest; ``state_names``: one key per tensor), measurements (``measure``,
  ``profile_breakdown``, ``model_state``) into measured.json; ``metrics``: the log line (lr, grad
  norm, tokens/s, MFU, memory), ``--metrics`` jsonl, TensorBoard and the progress line;
* ``api``            -- ``autopar.prepare``: a plan applied inside the user's own loop
  (``PreparedJob.step`` is the trainer's step), docs/runtime.md;
* ``rank_errors``    -- the first failing rank's message and exit code, from any rank;
* ``export`` / ``export_cli`` -- ``autopar export``: a checkpoint's weights as safetensors;
* ``dry_run``        -- one plan applied by ``parallelize`` and run forward and backward on fake
  ranks in one process, the first error as text (the planner's runtime check calls it);
  ``meta_apply`` -- what the compile and float8 steps do to a plan's model, on the meta device
  (the planner's plan summary asks it).

Only ``autopar.core`` is imported: never the planner or the simulator.
"""
