"""Regional ``torch.compile``: each repeated block's forward compiled on its own.

What is compiled: the forward of every block layer's module (the layers capture found as a run
of same-class children -- ``blocks.3`` -- not "pre"/"post", whose embeddings and head run once
and would only add compile time).  Compiling one block instead of the whole model is what
torchtitan does (per-TransformerBlock compile): the blocks share their code, so dynamo compiles
it once and every other block reuses the graph (its parameters are graph inputs, the guards are
on the module's class and shapes), and graph breaks in the model's glue stay outside.

Where in the order (``runtime/parallelize``): after tensor parallelism and recompute, before
FSDP2 / replicate / DDP -- torchtitan's order (TP -> activation checkpoint -> compile -> FSDP):

* the block's TP hooks (DTensor ``ColwiseParallel`` / ``RowwiseParallel`` on its linears) and
  its recompute wrapper (a ``CheckpointWrapper`` now standing at the block's path) are inside
  the compiled forward, so the collectives of TP and the checkpoint region are traced with it;
* FSDP2's and DDP's hooks stay outside: they run on the block module's ``__call__``, and only
  its ``forward`` is replaced -- the eager all-gather / reduce-scatter around a compiled region,
  as torchtitan's ``OptimizedModule`` wrapped by ``fully_shard``.

The forward is replaced on the module itself (an instance attribute) rather than by wrapping
the module in an ``OptimizedModule``: the module keeps its path and class, so parameter FQNs
(materialisation, checkpoints, the plan's TP module names) are the same as without compile.

Pipeline stages cut from the ``torch.export`` graph (models torch.fx cannot trace) call none
of the model's modules, so there is no block to compile: they run eager and the run says so in
its notes (compiling the whole exported stage instead would compile one graph per stage, none
shared, and trace the pipelining's stage interface -- left for later).
"""
from __future__ import annotations

import torch
import torch.nn as nn

COMPILED_ATTR = "_autopar_compiled"


def compile_module_forward(module: nn.Module, backend: str = "inductor") -> None:
    """Replace ``module.forward`` by its ``torch.compile``d version (once)."""
    if getattr(module, COMPILED_ATTR, False):
        return
    module.forward = torch.compile(module.forward, backend=backend)
    setattr(module, COMPILED_ATTR, True)


def apply_compile(part: nn.Module, block_paths: list[list[str]], backend: str = "inductor") -> list[str]:
    """Compile, inside ``part``, the forward of each listed block module; returns the paths
    compiled.  ``block_paths``: per block layer, its module paths present in ``part``;
    ``backend``: torch.compile's (the runtime always uses inductor)."""
    done = []
    for paths in block_paths:
        for path in paths:
            compile_module_forward(part.get_submodule(path), backend)
            done.append(path)
    return done


def is_compiled(module: nn.Module) -> bool:
    return bool(getattr(module, COMPILED_ATTR, False))
