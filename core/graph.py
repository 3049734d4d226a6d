"""OpGraph: the captured forward of a model, on the meta device, with shapes and costs.

The graph is the planner's and simulator's view of a model (docs/design.md, "Contracts"):

* ``OpNode`` -- one operation of the forward: what kind it is, which module owns it, its
  shapes and dtype, forward/backward FLOPs, bytes moved, the parameters it uses and the
  activation bytes it keeps for backward.
* ``Layer`` -- a run of ops that belong to one repeated block of the module tree (a
  transformer block), or to the part before / after the blocks.  Layers are the unit of
  pipeline stages, recompute and FSDP wrapping.
* ``OpGraph`` -- ops in topological order plus layers, totals and a stable fingerprint.

This module holds data only; ``autopar.core.capture`` builds it from a model.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

#: Op kinds the cost model distinguishes.  Every OpNode.kind is one of these.
OP_KINDS = (
    "linear",       # nn.Linear / F.linear / addmm: y = x W^T (+ b)
    "matmul",       # matmul / bmm / baddbmm between two activations
    "attention",    # fused scaled_dot_product_attention
    "conv",         # convolutions
    "embedding",    # table lookups
    "norm",         # layer norm, RMS norm, batch norm, group norm
    "softmax",      # softmax / log_softmax
    "elementwise",  # activations, adds, muls, residuals, rotary arithmetic
    "dropout",
    "reduction",    # sum / mean / pooling
    "loss",         # cross entropy, mse
    "view",         # reshape, transpose, slicing, cat: no arithmetic
    "rnn",          # nn.LSTM / nn.GRU / nn.RNN: per time step and layer, the gate GEMMs and the cell
    "leaf",         # a module kept opaque because no tracer could enter it
    "other",
)


@dataclass(frozen=True)
class OpNode:
    name: str                                # unique within the graph (fx node name)
    kind: str                                # one of OP_KINDS
    target: str                              # the traced callable, e.g. "torch.nn.Linear" or "aten.mm"
    module_path: str                         # owning module's qualified name ("" for the root)
    layer: int                               # index into OpGraph.layers
    inputs: tuple[str, ...]                  # names of the ops (or "input:<name>") it reads
    input_shapes: tuple[tuple[int, ...], ...]
    output_shape: tuple[int, ...]
    dtype: str                               # dtype of the output, e.g. "float32"
    fwd_flops: float                         # forward floating-point operations (multiply-add = 2)
    bwd_flops: float                         # backward FLOPs (input + weight gradients)
    bytes_moved: float                       # forward bytes read + written (roofline traffic)
    params: tuple[str, ...] = ()             # qualified names of parameters it uses
    param_numel: int = 0                     # elements in those parameters (each counted once graph-wide)
    saved_bytes: int = 0                     # activation bytes kept for backward (deduplicated graph-wide)
    output_bytes: int = 0                    # bytes of its output
    copy_bytes: float = 0.0                  # forward bytes written by copies its operands' strides force
    causal: bool = False                     # fused attention with is_causal: the FLOPs stay the full
                                             # square, a flash kernel skips the masked half (cost_model)
    requires_grad: bool = True               # False: autograd records no backward for it (a mask or
                                             # position built from shapes, an op on raw inputs only)
    frozen_params: tuple[str, ...] = ()      # those of ``params`` with requires_grad=False (a LoRA
                                             # base weight): no gradient, no optimizer state
    frozen_numel: int = 0                    # elements of param_numel that are frozen (trainable:
                                             # param_numel - frozen_numel)
    tied_numel: int = 0                      # elements of parameters it uses that an op of an earlier
                                             # layer counted (a tied weight: not in param_numel)
    tied_frozen_numel: int = 0               # ... of which frozen

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["inputs"] = list(self.inputs)
        d["input_shapes"] = [list(s) for s in self.input_shapes]
        d["output_shape"] = list(self.output_shape)
        d["params"] = list(self.params)
        d["frozen_params"] = list(self.frozen_params)
        return d


@dataclass(frozen=True)
class Layer:
    index: int
    name: str                                # module path of the block ("blocks.3"), or "pre" / "post"
    kind: str                                # block class name ("Block"), or "pre" / "post"
    module_paths: tuple[str, ...]            # top-level modules making up this layer
    ops: tuple[str, ...]                     # names of its ops, in order
    param_numel: int
    fwd_flops: float
    bwd_flops: float
    saved_bytes: int                         # activations kept for backward by this layer (one micro-batch)
    input_bytes: int                         # bytes of the activation entering the layer (pipeline send size)
    output_bytes: int                        # bytes of the activation leaving the layer
    signature: str                           # equal for structurally identical layers (solved once)
    frozen_numel: int = 0                    # of param_numel, elements with requires_grad=False
    #: parameters it uses that an earlier layer holds (a tied LM head): (canonical name, that
    #: layer's index, elements); a pipeline stage holding this layer but not that one keeps a copy
    tied_params: tuple[tuple[str, int, int], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["module_paths"] = list(self.module_paths)
        d["ops"] = list(self.ops)
        d["tied_params"] = [list(t) for t in self.tied_params]
        return d


@dataclass
class OpGraph:
    model_name: str                          # a readable name ("gpt3-175b", or the file stem)
    model_file: str
    model_args: dict[str, Any]
    batch_size: int                          # the batch the graph was captured with
    ops: list[OpNode]
    layers: list[Layer]
    params_total: int                        # unique parameter elements in the module
    param_dtype: str                         # dtype of the parameters as built ("float32")
    seq_len: int | None = None               # tokens per sample where the model has a sequence
    capture_method: str = "symbolic_trace"   # "symbolic_trace", "export" or "leaf_fallback"
    leaf_modules: tuple[str, ...] = ()       # modules kept opaque by the fallback
    # each opaque module's ``topk`` calls as (k, size of the dim chosen from), in call order: the
    # routing of a mixture of experts the graph cannot show op by op (core/trace_fx._TopkRecorder)
    leaf_routing: dict[str, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    sequential_layers: bool = False          # forward is layer 0 -> 1 -> ... with one activation
                                             # tensor crossing each boundary (pipeline-cuttable)
    notes: list[str] = field(default_factory=list)
    capture_s: float = 0.0

    # ------------------------------------------------------------------ totals
    @property
    def fwd_flops(self) -> float:
        return sum(layer.fwd_flops for layer in self.layers)

    @property
    def bwd_flops(self) -> float:
        return sum(layer.bwd_flops for layer in self.layers)

    @property
    def flops_per_step(self) -> float:
        """Forward + backward FLOPs for one pass over ``batch_size`` samples (no recompute)."""
        return self.fwd_flops + self.bwd_flops

    @property
    def flops_per_sample(self) -> float:
        """Model FLOPs of one training sample: forward + backward over the captured batch, per
        sample (recompute left out).  The numerator of MFU (Chowdhery et al. 2022, PaLM,
        Appendix B: model FLOPs, not hardware FLOPs); for a transformer it is close to Kaplan
        et al. 2020's 6 x parameters x tokens, the backward being about twice the forward."""
        return self.flops_per_step / max(1, self.batch_size)

    @property
    def trainable_params(self) -> int:
        """Parameter elements that require grad (frozen ones, ``OpNode.frozen_numel``, left out)."""
        return self.params_total - sum(o.frozen_numel for o in self.ops)

    @property
    def saved_bytes(self) -> int:
        return sum(layer.saved_bytes for layer in self.layers)

    def op(self, name: str) -> OpNode:
        return self._ops_by_name()[name]

    def layer_ops(self, index: int) -> list[OpNode]:
        by_name = self._ops_by_name()
        return [by_name[n] for n in self.layers[index].ops]

    def _ops_by_name(self) -> dict[str, OpNode]:
        cache = self.__dict__.get("_by_name")
        if cache is None or len(cache) != len(self.ops):
            cache = {o.name: o for o in self.ops}
            self.__dict__["_by_name"] = cache
        return cache

    # ------------------------------------------------------------ identity
    @property
    def fingerprint(self) -> str:
        """A stable hash of the model's structure, independent of the batch size.

        It covers the parameters (names, shapes via numel, dtype) and the sequence of ops
        (kind, target, owning module).  Two captures of the same model file with the same
        model arguments give the same fingerprint; a different model or different
        arguments give another.  Parameter-free ``view`` ops (views, expands, reshapes) are
        left out: ``torch.export`` specialises a batch of 1 and drops the ``expand`` of a
        broadcast to the batch (transformers' Mixtral builds its positions so), so the same
        model captured at micro-batch 1 (the runtime's check) and at 2 (the planner's capture)
        would differ by that op alone.
        """
        return self._hash(skip_views=True)

    @property
    def fingerprints(self) -> tuple[str, str]:
        """(``fingerprint``, the fingerprint autopar wrote before it left the views out): what a
        plan file or a checkpoint of this model may carry.  Plans and checkpoints written before
        that change hold the second; the runtime accepts both (runtime/plan_check.py,
        runtime/checkpointing.py), so they still run and resume."""
        return self._hash(skip_views=True), self._hash(skip_views=False)

    def _hash(self, skip_views: bool) -> str:
        h = hashlib.sha256()
        h.update(json.dumps(
            {"params_total": self.params_total, "param_dtype": self.param_dtype,
             "model_args": {k: self.model_args[k] for k in sorted(self.model_args)}},
            sort_keys=True, default=str).encode())
        for o in self.ops:
            if skip_views and o.kind == "view" and not o.params:
                continue
            h.update(f"{o.kind}|{o.target}|{o.module_path}|{','.join(o.params)}|{o.param_numel}\n".encode())
        return h.hexdigest()[:16]

    # ------------------------------------------------------------- exports
    def to_networkx(self):
        """A ``networkx.DiGraph`` view: one node per op (attributes = OpNode fields)."""
        import networkx as nx

        g = nx.DiGraph(model=self.model_name, fingerprint=self.fingerprint)
        for o in self.ops:
            g.add_node(o.name, **o.to_dict())
        for o in self.ops:
            for src in o.inputs:
                if src in g:
                    g.add_edge(src, o.name)
        return g

    def summary(self) -> dict[str, Any]:
        """The machine-readable form printed by ``autopar inspect --json``."""
        return {
            "model": self.model_name,
            "model_file": self.model_file,
            "model_args": self.model_args,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "params": self.params_total,
            "trainable_params": self.trainable_params,
            "param_dtype": self.param_dtype,
            "fwd_flops": self.fwd_flops,
            "bwd_flops": self.bwd_flops,
            "flops_per_step": self.flops_per_step,
            "saved_activation_bytes": self.saved_bytes,
            "num_ops": len(self.ops),
            "capture_method": self.capture_method,
            "capture_s": round(self.capture_s, 3),
            "leaf_modules": list(self.leaf_modules),
            "leaf_routing": {k: [list(c) for c in v] for k, v in self.leaf_routing.items()},
            "sequential_layers": self.sequential_layers,
            "notes": list(self.notes),
            "fingerprint": self.fingerprint,
            "layers": [
                {k: v for k, v in layer.to_dict().items() if k != "ops"} | {"num_ops": len(layer.ops)}
                for layer in self.layers
            ],
        }
