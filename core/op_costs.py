"""Per-op cost rules: FLOPs, bytes moved and the activations autograd keeps for backward.

Pure rules over shapes; no tracing here.  ``autopar.core.capture`` turns every traced node into
an ``OpFacts`` (canonical op name, tensor operands in a canonical order, outputs, a few scalar
attributes) and calls ``cost(facts)``.

Conventions and sources
-----------------------
* A multiply-add is 2 FLOPs.  Matmul-class forward = 2*m*n*k (Kaplan et al. 2020, Table 1;
  Narayanan et al. 2021, Sec. 5.1 / Appendix).  Backward = 2x forward: one matmul for the
  input gradient and one for the weight gradient (same references); an operand that does
  not require grad skips its half (the first Linear on raw data only computes dW).
* Attention (fused scaled_dot_product_attention): forward 2*b*h*s_q*s_k*d for Q K^T plus
  2*b*h*s_q*s_k*d_v for A V -- the full square, not halved for causal masking, as Megatron's
  count does (Narayanan et al. 2021, Appendix); backward 2x forward.
* Grouped GEMM of routed experts (``_grouped_mm``): 2*M*K*N for M rows, as a matmul
  (``_grouped_mm``); before this rule it fell to "other", one FLOP per output element.
* einsum: every combination of the equation's index values is one term, so
  forward = prod(size of every index) * (operands - 1 multiplies + 1 add when an index is
  summed) -- 2*m*n*k for "mk,kn->mn", as a matmul (the count opt_einsum uses for a
  contraction, Smith & Gray 2018, "opt_einsum", JOSS 3(26)); backward one forward per operand
  that requires grad, each keeping the others.
* Convolution: 2 * out_numel * (C_in / groups) * prod(kernel) (+ out_numel for the bias).
* Recurrent modules (nn.LSTM, nn.GRU, nn.RNN; the equations of their torch.nn documentation):
  every time step of every layer and direction computes its G gates (LSTM 4, GRU 3, RNN 1) as
  two GEMMs, W_ih x_t and W_hh h_{t-1}, so forward = sum over layers and directions of
  2*B*T*G*H*(I_l + H_r) (I_l the layer's input width: input_size, then H_r * directions;
  H_r = proj_size or H), plus the two bias adds (2*B*T*G*H), an LSTM's projection
  (2*B*T*H*P) and the cell's pointwise work per hidden element (our per-element convention
  below: LSTM 3 sigmoids + 2 tanh + 3 mul + 1 add = 24; GRU 2 sigmoids + tanh + 3 mul +
  2 add/sub = 17; RNN tanh 4 or relu 1).  Backward = 2x the GEMMs (input and weight
  gradients; frozen weights skip theirs; no gradient of a zero initial state) + 1x the
  pointwise part -- the GEMM FLOPs both ways are what ``torch.utils.flop_counter`` counts of
  the cells' decomposition (tests/core/test_capture_rnn.py).  Kept for backward: what the cells'
  autograd decomposition (aten ``lstm_cell`` / ``gru_cell`` / ``rnn_tanh_cell``, run where no
  fused kernel applies) saves, see ``_rnn``; a fused kernel keeps about as much (CUDA's
  ``_thnn_fused_lstm_cell`` saves c_{t-1}, c_t and a 4H workspace, derivatives.yaml), oneDNN's
  CPU LSTM less.
* Everything else is memory bound; we count one FLOP per elementary arithmetic operation per
  element, with the number of operations each op evaluates in ``FLOPS_PER_ELEMENT``.  Their
  backward is ``BWD_FACTOR`` x forward: 2 for norms and softmax (a reduction for the mean of
  the gradient plus the recomputed normalised value), 1 for pointwise ops (one multiply by
  the local derivative, which costs about what the op did).  These ops are < 1 % of a
  transformer's FLOPs; they matter for bytes, which is what the roofline uses for them.
* Saved activations follow what autograd keeps (Korthikanti et al. 2022, "Reducing
  Activation Recomputation in Large Transformer Models", Sec. 4.1, and PyTorch's
  tools/autograd/derivatives.yaml): Linear keeps its input; a matmul of two activations keeps
  both; softmax keeps its output; dropout keeps a 1-byte mask (p > 0); GeLU/SiLU keep their
  input; ReLU/sigmoid/tanh keep their output; layer norm keeps its input plus per-row mean
  and rstd (fp32); residual adds and views keep nothing; fused attention keeps q, k, v, the
  output and the logsumexp (fp32, b*h*s_q).  Parameters, buffers and tensors derived only
  from them are not activations and are never counted.  Keys let the caller deduplicate:
  a tensor kept by two ops is counted once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

# ----------------------------------------------------------------------------- vocabulary
# Map every traced name (torch function __name__, Tensor method, aten overload packet,
# nn.Module class) to a canonical op.  Leading/trailing underscores are stripped first
# ("_softmax" -> "softmax", "add_" -> "add").
CANONICAL: dict[str, str] = {
    # matmul class
    "linear": "linear", "Linear": "linear", "NonDynamicallyQuantizableLinear": "linear",
    "addmm": "addmm", "mm": "matmul", "bmm": "matmul", "matmul": "matmul", "baddbmm": "baddbmm",
    "einsum": "einsum",
    # grouped GEMMs of routed experts: torch._grouped_mm, transformers 5's grouped_mm_fallback
    "grouped_mm": "grouped_mm", "grouped_mm_fallback": "grouped_mm",
    "Conv1D": "addmm_conv1d",  # transformers' Conv1D: y = x @ W + b with W [in, out]
    "scaled_dot_product_attention": "sdpa", "MultiheadAttention": "mha",
    "scaled_dot_product_flash_attention": "sdpa", "scaled_dot_product_flash_attention_for_cpu": "sdpa",
    "scaled_dot_product_efficient_attention": "sdpa", "scaled_dot_product_cudnn_attention": "sdpa",
    "convolution": "conv", "conv1d": "conv", "conv2d": "conv", "conv3d": "conv",
    "Conv1d": "conv", "Conv2d": "conv", "Conv3d": "conv",
    "embedding": "embedding", "Embedding": "embedding",
    "LSTM": "rnn", "GRU": "rnn", "RNN": "rnn",
    "lstm": "rnn", "gru": "rnn", "rnn_tanh": "rnn", "rnn_relu": "rnn",     # aten (torch.export)
    # norms
    "layer_norm": "layer_norm", "native_layer_norm": "layer_norm", "LayerNorm": "layer_norm",
    "rms_norm": "rms_norm", "fused_rms_norm": "rms_norm", "RMSNorm": "rms_norm",
    "batch_norm": "batch_norm", "native_batch_norm": "batch_norm", "native_batch_norm_legit": "batch_norm",
    "native_batch_norm_legit_functional": "batch_norm", "native_batch_norm_legit_no_training": "batch_norm",
    "BatchNorm1d": "batch_norm", "BatchNorm2d": "batch_norm", "BatchNorm3d": "batch_norm",
    "group_norm": "group_norm", "native_group_norm": "group_norm", "GroupNorm": "group_norm",
    # softmax
    "softmax": "softmax", "Softmax": "softmax", "safe_softmax": "softmax",
    "scaled_upper_triang_masked_softmax": "softmax",   # Megatron-LM's fused scale + causal mask + softmax
    "log_softmax": "log_softmax", "LogSoftmax": "log_softmax",
    # dropout
    "dropout": "dropout", "native_dropout": "dropout", "Dropout": "dropout", "Dropout1d": "dropout",
    "Dropout2d": "dropout", "Dropout3d": "dropout", "feature_dropout": "dropout",
    # activations
    "gelu": "gelu", "GELU": "gelu", "NewGELUActivation": "gelu", "GELUActivation": "gelu",
    "silu": "silu", "SiLU": "silu", "relu": "relu", "ReLU": "relu", "relu6": "relu",
    "sigmoid": "sigmoid", "Sigmoid": "sigmoid", "tanh": "tanh", "Tanh": "tanh",
    # pointwise arithmetic
    "add": "add", "iadd": "add", "radd": "add", "sub": "sub", "isub": "sub", "rsub": "sub",
    "mul": "mul", "imul": "mul", "rmul": "mul", "div": "div", "truediv": "div", "itruediv": "div",
    "rtruediv": "div", "floordiv": "div", "neg": "neg", "pow": "pow", "square": "pow",
    "rsqrt": "rsqrt", "sqrt": "sqrt", "exp": "exp", "log": "log", "sin": "sin", "cos": "cos",
    "abs": "abs", "clamp": "clamp", "clip": "clamp", "masked_fill": "masked_fill", "where": "where",
    "minimum": "minimum", "maximum": "maximum", "outer": "mul", "diff": "sub",
    # comparisons and logic (no gradient)
    "eq": "compare", "ne": "compare", "lt": "compare", "le": "compare", "gt": "compare",
    "ge": "compare", "logical_not": "compare", "logical_and": "compare", "logical_or": "compare",
    "bitwise_not": "compare", "bitwise_and": "compare", "bitwise_or": "compare", "isinf": "compare",
    "isnan": "compare", "invert": "compare", "and_": "compare", "or_": "compare",
    "and": "compare", "or": "compare", "xor": "compare",
    # dtype casts
    "to": "cast", "type": "cast", "type_as": "cast", "float": "cast", "half": "cast",
    "bfloat16": "cast", "double": "cast", "long": "cast", "int": "cast", "bool": "cast",
    "to_copy": "cast", "to_dtype": "cast",
    # reductions and pooling
    "sum": "sum", "mean": "mean", "amax": "amax", "amin": "amax", "max": "amax", "min": "amax",
    "argmax": "argmax", "argmin": "argmax", "cumsum": "sum", "var": "mean", "std": "mean",
    "max_pool1d": "max_pool", "max_pool2d": "max_pool", "max_pool3d": "max_pool",
    "max_pool2d_with_indices": "max_pool", "MaxPool1d": "max_pool", "MaxPool2d": "max_pool",
    "MaxPool3d": "max_pool",
    "avg_pool1d": "avg_pool", "avg_pool2d": "avg_pool", "avg_pool3d": "avg_pool",
    "AvgPool1d": "avg_pool", "AvgPool2d": "avg_pool", "AvgPool3d": "avg_pool",
    "adaptive_avg_pool1d": "avg_pool", "adaptive_avg_pool2d": "avg_pool", "adaptive_avg_pool3d": "avg_pool",
    "AdaptiveAvgPool1d": "avg_pool", "AdaptiveAvgPool2d": "avg_pool", "AdaptiveAvgPool3d": "avg_pool",
    # losses
    "cross_entropy": "cross_entropy", "CrossEntropyLoss": "cross_entropy",
    "nll_loss": "nll_loss", "nll_loss_forward": "nll_loss", "nll_loss2d_forward": "nll_loss",
    "mse_loss": "mse_loss", "MSELoss": "mse_loss",
    # views (no arithmetic, no data movement)
    "view": "view", "reshape": "view", "unsafe_view": "view", "transpose": "view", "t": "view",
    "permute": "view", "expand": "view", "expand_as": "view", "unsqueeze": "view",
    "squeeze": "view", "flatten": "view", "unflatten": "view", "view_as": "view",
    "Flatten": "view", "Unflatten": "view", "Identity": "view", "alias": "view", "detach": "view",
    "getitem": "view", "slice": "view", "select": "view", "narrow": "view", "unbind": "view",
    "split": "view", "split_with_sizes": "view", "chunk": "view", "tensor_split": "view",
    "contiguous": "view", "lift_fresh_copy": "view", "view_as_real": "view",
    "view_as_complex": "view", "movedim": "view", "swapaxes": "view", "as_strided": "view",
    "diagonal": "view",
    # copies (bytes, no arithmetic)
    "cat": "copy", "concat": "copy", "stack": "copy", "clone": "copy", "repeat": "copy",
    "repeat_interleave": "copy", "roll": "copy", "flip": "copy", "index_select": "copy",
    "gather": "copy", "index": "copy", "pad": "copy", "constant_pad_nd": "copy",
    # tensors created from shapes only (masks, positions): not activations
    "arange": "create", "ones": "create", "zeros": "create", "full": "create", "empty": "create",
    "new_ones": "create", "new_zeros": "create", "new_full": "create", "new_empty": "create",
    "ones_like": "create", "zeros_like": "create", "full_like": "create", "empty_like": "create",
    "scalar_tensor": "create", "tensor": "create", "empty_strided": "create",
    "tril": "tri", "triu": "tri",
}

# Kinds by canonical op (OP_KINDS in autopar.core.graph).
KIND: dict[str, str] = {
    "linear": "linear", "addmm": "linear", "addmm_conv1d": "linear",
    "matmul": "matmul", "baddbmm": "matmul", "einsum": "matmul", "grouped_mm": "matmul",
    "sdpa": "attention", "mha": "attention", "conv": "conv", "embedding": "embedding", "rnn": "rnn",
    "layer_norm": "norm", "rms_norm": "norm", "batch_norm": "norm", "group_norm": "norm",
    "softmax": "softmax", "log_softmax": "softmax", "dropout": "dropout",
    "sum": "reduction", "mean": "reduction", "amax": "reduction", "argmax": "reduction",
    "max_pool": "reduction", "avg_pool": "reduction",
    "cross_entropy": "loss", "nll_loss": "loss", "mse_loss": "loss",
    "view": "view", "copy": "view", "create": "other", "leaf": "leaf", "other": "other",
}

# Elementary operations per output element, forward (our counting convention, see above):
# gelu tanh form 0.5x(1+tanh(c(x+0.044715x^3))) ~ 8; silu x*sigmoid(x) ~ 4 (exp, add,
# divide, multiply); sigmoid/tanh ~ 4; layer norm: mean, subtract, square, mean, rsqrt-scale,
# weight, bias ~ 7 (5 without affine); rms norm: square, mean, rsqrt-scale, weight ~ 4;
# softmax: max, subtract, exp, sum, divide = 5; dropout: draw/compare and scale = 2;
# cross entropy on logits: log-softmax 5 + pick 1 = 6; mse: subtract, square, mean = 3.
FLOPS_PER_ELEMENT: dict[str, float] = {
    "gelu": 8, "silu": 4, "sigmoid": 4, "tanh": 4, "relu": 1,
    "layer_norm": 7, "rms_norm": 4, "batch_norm": 7, "group_norm": 7,
    "softmax": 5, "log_softmax": 5, "dropout": 2, "cross_entropy": 6, "nll_loss": 1, "mse_loss": 3,
    "add": 1, "sub": 1, "mul": 1, "div": 1, "neg": 1, "pow": 1, "rsqrt": 1, "sqrt": 1, "exp": 1,
    "log": 1, "sin": 1, "cos": 1, "abs": 1, "clamp": 1, "masked_fill": 1, "where": 1,
    "minimum": 1, "maximum": 1, "compare": 1, "tri": 1,
}
BWD_FACTOR: dict[str, float] = {
    "layer_norm": 2, "rms_norm": 2, "batch_norm": 2, "group_norm": 2,
    "softmax": 2, "log_softmax": 2, "cross_entropy": 2,
}
POINTWISE = frozenset(FLOPS_PER_ELEMENT) - {"layer_norm", "rms_norm", "batch_norm", "group_norm",
                                            "softmax", "log_softmax", "dropout", "cross_entropy",
                                            "nll_loss", "mse_loss", "compare", "tri"}
for _name in POINTWISE | {"compare", "tri"}:
    KIND.setdefault(_name, "elementwise")
KIND["cast"] = "elementwise"

FP32_BYTES = 4       # mean/rstd/logsumexp are kept in fp32 whatever the activation dtype
MASK_BYTES = 1       # dropout mask: one bool per element (aten native_dropout)
INDEX_BYTES = 8      # int64 indices (max pooling)


def canonical(name: str) -> str:
    """Canonical op for a traced name; "other" when unknown."""
    stripped = name.strip("_")
    return CANONICAL.get(name) or CANONICAL.get(stripped) or "other"


# ----------------------------------------------------------------------------- facts
@dataclass(frozen=True)
class TensorFacts:
    key: str                      # identity for deduplication (views collapse onto their base)
    shape: tuple[int, ...]
    itemsize: int                 # bytes per element
    role: str                     # "act" (depends on the batch), "param", "const"
    requires_grad: bool
    is_float: bool = True

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass
class OpFacts:
    name: str                                   # node name (unique)
    canon: str                                  # canonical op name (see CANONICAL)
    inputs: list[TensorFacts]                   # tensor operands, canonical order per op
    outputs: list[TensorFacts]                  # tensor results (first = main output)
    attrs: dict[str, Any] = field(default_factory=dict)

    @property
    def out(self) -> TensorFacts:
        return self.outputs[0]

    @property
    def requires_grad(self) -> bool:
        return any(t.requires_grad for t in self.outputs)


@dataclass
class OpCost:
    kind: str
    fwd_flops: float
    bwd_flops: float
    bytes_moved: float
    saved: list[tuple[str, int]]                # (key, bytes) of activations kept for backward
    copy_bytes: float = 0.0                     # bytes written by copies the strides force (core/copies.py)
    causal: bool = False                        # fused attention under a causal mask (its kernel skips half)


# ----------------------------------------------------------------------------- rules
def cost(f: OpFacts) -> OpCost:
    rule = _RULES.get(f.canon, _pointwise if f.canon in FLOPS_PER_ELEMENT else _other)
    kind, fwd, bwd, saved = rule(f)
    if not f.requires_grad:
        bwd, saved = 0.0, []
    in_bytes = sum(t.nbytes for t in f.inputs)
    out_bytes = sum(t.nbytes for t in f.outputs)
    identity = f.canon == "view" or (f.canon == "dropout" and fwd == 0.0)   # p = 0 or eval: returns its input
    # torch.empty and kin allocate without a kernel (trace_walk.UNINITIALIZED)
    identity = identity or bool(f.attrs.get("uninitialized"))
    if f.canon == "baddbmm" and f.attrs.get("beta") == 0.0 and len(f.inputs) >= 3:
        in_bytes -= f.inputs[0].nbytes          # beta = 0: the GEMM does not read C (cuBLAS, beta == 0)
    moved = 0.0 if identity else float(in_bytes + out_bytes)
    if f.canon == "embedding":    # a gather reads only the rows it returns
        moved = float(2 * out_bytes + f.inputs[0].nbytes)
    kept = [(k, b) for k, b in saved if b > 0]
    return OpCost(kind=kind, fwd_flops=float(fwd), bwd_flops=float(bwd), bytes_moved=moved, saved=kept,
                  copy_bytes=float(f.attrs.get("copy_bytes", 0.0)), causal=bool(f.attrs.get("causal", False)))


def _act(t: TensorFacts) -> list[tuple[str, int]]:
    """A tensor kept for backward counts only if it is an activation."""
    return [(t.key, t.nbytes)] if t.role == "act" else []


def _synthetic(f: OpFacts, tag: str, nbytes: int) -> list[tuple[str, int]]:
    return [(f"{f.name}:{tag}", int(nbytes))]


def _matmul_bwd(a: TensorFacts, b: TensorFacts, fwd: float) -> float:
    # dA = dY B^T and dB = A^T dY each cost one forward matmul (Narayanan et al. 2021, App.)
    return fwd * (int(a.requires_grad) + int(b.requires_grad))


def _linear(f: OpFacts):
    # inputs: x [..., k], W [n, k], optional bias [n]
    x, w = f.inputs[0], f.inputs[1]
    n, k = (w.shape[0], w.shape[-1]) if len(w.shape) == 2 else (w.shape[0], 1)
    rows = x.numel // max(k, 1)
    fwd = 2.0 * rows * n * k
    bwd = _matmul_bwd(x, w, fwd)
    if len(f.inputs) > 2:                                    # bias add, and its gradient (a sum)
        fwd += rows * n
        bwd += rows * n if f.inputs[2].requires_grad else 0
    saved = _act(x) if w.requires_grad else []
    if x.requires_grad and w.role == "act":
        saved += _act(w)
    return "linear", fwd, bwd, saved


def _addmm(f: OpFacts):
    # inputs: bias [n], x [m, k], W [k, n]  (aten.addmm; transformers' Conv1D has the same shapes)
    if f.canon == "addmm_conv1d":
        x, w = f.inputs[0], f.inputs[1]
        bias = f.inputs[2] if len(f.inputs) > 2 else None
    else:
        bias, x, w = f.inputs[0], f.inputs[1], f.inputs[2]
    k, n = w.shape[0], w.shape[-1]
    rows = x.numel // max(k, 1)
    fwd = 2.0 * rows * n * k
    bwd = _matmul_bwd(x, w, fwd)
    if bias is not None:
        fwd += rows * n
        bwd += rows * n if bias.requires_grad else 0
    saved = (_act(x) if w.requires_grad else []) + (_act(w) if x.requires_grad else [])
    kind = "linear" if "param" in (x.role, w.role) else "matmul"
    return kind, fwd, bwd, saved


def _matmul(f: OpFacts):
    a, b = f.inputs[-2], f.inputs[-1]
    k = a.shape[-1] if a.shape else 1
    fwd = 2.0 * f.out.numel * k
    bwd = _matmul_bwd(a, b, fwd)
    if f.canon == "baddbmm" and f.attrs.get("beta") != 0.0:  # + beta * C
        fwd += f.out.numel
    saved = (_act(a) if b.requires_grad else []) + (_act(b) if a.requires_grad else [])
    kind = "linear" if "param" in (a.role, b.role) else "matmul"
    return kind, fwd, bwd, saved


def _grouped_mm(f: OpFacts):
    """A grouped GEMM (``torch._grouped_mm``; transformers' ``grouped_mm_fallback``): a [M, K]
    (or [G, M, K]) times b [G, K, N], each row of a multiplied by its group's [K, N] (the groups
    partition the rows by the ``offs`` boundaries): 2*M*K*N, the count of M rows of one matmul
    (Kaplan et al. 2020, Table 1), whatever the split of rows between groups.  Backward dA and
    dB, one forward each.  Kind "matmul" whether or not b is a parameter: stacked experts
    (core/sharding.stacked_experts) are recognised by their 3-D operand, not as Linear modules."""
    a, b = f.inputs[0], f.inputs[1]
    k = a.shape[-1] if a.shape else 1
    fwd = 2.0 * f.out.numel * k
    bwd = _matmul_bwd(a, b, fwd)
    saved = (_act(a) if b.requires_grad else []) + (_act(b) if a.requires_grad else [])
    return "matmul", fwd, bwd, saved


def einsum_index_sizes(equation: str, shapes: list[tuple[int, ...]]) -> tuple[dict[str, int], str] | None:
    """({index letter: size}, output indices) of an einsum equation over operands of ``shapes``;
    None when the equation does not match them.  An ellipsis stands for the leading dims it
    covers (each given a letter of its own, shared by every operand, broadcast to the largest)."""
    eq = equation.replace(" ", "")
    lhs, arrow, out = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(shapes):
        return None
    n_ells = [len(shape) - (len(term) - 3) if "..." in term else 0 for term, shape in zip(terms, shapes)]
    if min(n_ells) < 0:
        return None
    ell_letters = "".join(chr(0x2460 + i) for i in range(max(n_ells)))   # symbols no equation uses
    sizes: dict[str, int] = {}
    expanded = []
    for term, shape, n_ell in zip(terms, shapes, n_ells):
        # right-aligned broadcasting: an operand's ellipsis is the last n_ell of the letters
        term = term.replace("...", ell_letters[len(ell_letters) - n_ell:])
        if len(term) != len(shape) or not all(c.isalpha() or ord(c) >= 0x2460 for c in term):
            return None
        expanded.append(term)
        for c, d in zip(term, shape):
            sizes[c] = max(sizes.get(c, 1), int(d))
    if arrow:
        out = out.replace("...", ell_letters)
    else:   # implicit output: the ellipsis, then the letters seen once, in alphabetical order
        counts = {c: sum(t.count(c) for t in expanded) for c in sizes}
        out = ell_letters + "".join(sorted(c for c, k in counts.items() if k == 1 and c not in ell_letters))
    if any(c not in sizes for c in out):
        return None
    return sizes, out


def _einsum(f: OpFacts):
    eq = f.attrs.get("equation")
    parsed = einsum_index_sizes(eq, [t.shape for t in f.inputs]) if isinstance(eq, str) else None
    if parsed is None:
        return _other(f)
    sizes, out = parsed
    summed = any(c not in out for c in sizes)
    terms = float(math.prod(sizes.values()))
    fwd = terms * (max(len(f.inputs) - 1, 0) + (1 if summed else 0))
    grads = [t for t in f.inputs if t.requires_grad]
    bwd = fwd * len(grads)
    saved = []
    for i, t in enumerate(f.inputs):
        if any(o.requires_grad for j, o in enumerate(f.inputs) if j != i):
            saved += _act(t)
    kind = "linear" if any(t.role == "param" for t in f.inputs) else "matmul"
    return kind, fwd, bwd, saved


def _sdpa(f: OpFacts):
    # q [b, h, s_q, d], k [b, h_kv, s_k, d], v [b, h_kv, s_k, d_v]
    q, k, v = f.inputs[0], f.inputs[1], f.inputs[2]
    *batch, s_q, d = q.shape
    s_k, d_v = k.shape[-2], v.shape[-1]
    bh = math.prod(batch)
    fwd = 2.0 * bh * s_q * s_k * d + 2.0 * bh * s_q * s_k * d_v
    bwd = 2.0 * fwd
    saved = _act(q) + _act(k) + _act(v) + _act(f.out) + _synthetic(f, "logsumexp", bh * s_q * FP32_BYTES)
    return "attention", fwd, bwd, saved


def _mha(f: OpFacts):
    """``nn.MultiheadAttention`` kept whole by the fx path: its four projections plus attention.

    Inputs: query, key, value (activations; ``[b, s, E]`` with ``batch_first``, else
    ``[s, b, E]``; ``[s, E]`` unbatched), then masks and the module's parameters.  Forward =
    q/k/v projections 2*E*E per query/key/value row each, the output projection 2*E*E per query
    row, and the attention 2*s_q*s_k*E for Q K^T plus the same for A V per batch element (the
    ``_sdpa`` count with h*d = E); backward 2x forward.  Keeps what its parts keep: the three
    inputs (the projections' inputs), q, k, v and the attention output (the fused attention's
    operands) and the fp32 logsumexp, b*h*s_q.
    """
    acts = [t for t in f.inputs if t.role != "param" and t.is_float]
    e = int(f.attrs.get("embed_dim") or f.out.shape[-1])
    q = acts[0] if acts else f.out
    k = acts[1] if len(acts) > 1 else q
    v = acts[2] if len(acts) > 2 else k
    seq_dim = 1 if f.attrs.get("batch_first") and len(q.shape) == 3 else 0
    rows_q, rows_k = q.numel // max(q.shape[-1], 1), k.numel // max(k.shape[-1], 1)
    s_k = k.shape[seq_dim] if len(k.shape) >= 2 else 1
    fwd = 2.0 * e * e * (2 * rows_q + 2 * rows_k) + 4.0 * rows_q * s_k * e
    heads = int(f.attrs.get("num_heads", 1))
    saved = [s for t in {id(t): t for t in (q, k, v)}.values() for s in _act(t)]
    saved += _synthetic(f, "qkv", (2 * rows_q + rows_k) * e * f.out.itemsize)
    saved += _act(f.out) + _synthetic(f, "logsumexp", rows_q * heads * FP32_BYTES)
    return "attention", fwd, 2.0 * fwd, saved


def _conv(f: OpFacts):
    x, w = f.inputs[0], f.inputs[1]
    fwd = 2.0 * f.out.numel * math.prod(w.shape[1:])          # w: [C_out, C_in/groups, *kernel]
    bwd = _matmul_bwd(x, w, fwd)
    if len(f.inputs) > 2:
        fwd += f.out.numel
        bwd += f.out.numel if f.inputs[2].requires_grad else 0
    return "conv", fwd, bwd, (_act(x) if w.requires_grad else [])


def _embedding(f: OpFacts):
    # inputs: indices, weight.  Forward is a gather (no FLOPs); backward scatter-adds the
    # output gradient into the table (one add per output element).
    idx = f.inputs[0]
    return "embedding", 0.0, float(f.out.numel), _act(idx)


def _norm(f: OpFacts):
    x = f.inputs[0]
    fwd = FLOPS_PER_ELEMENT[f.canon] * x.numel
    bwd = BWD_FACTOR[f.canon] * fwd
    normalized = f.attrs.get("normalized_numel") or (x.shape[-1] if x.shape else 1)
    rows = x.numel // max(int(normalized), 1)
    if f.canon == "layer_norm":
        stats = 2 * rows * FP32_BYTES                         # mean and rstd per row
    elif f.canon == "rms_norm":
        stats = rows * FP32_BYTES                             # rstd per row
    elif f.canon == "batch_norm":
        stats = 2 * (x.shape[1] if len(x.shape) > 1 else 1) * FP32_BYTES
    else:                                                     # group norm: per (sample, group)
        stats = 2 * (x.shape[0] if x.shape else 1) * int(f.attrs.get("groups", 1)) * FP32_BYTES
    return "norm", fwd, bwd, _act(x) + _synthetic(f, "stats", stats)


#: gates per time step (torch.nn.LSTM / GRU / RNN documentation: i, f, g, o; r, z, n; one)
RNN_GATES = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1, "RNN_RELU": 1}
#: the cell's pointwise FLOPs per hidden element (FLOPS_PER_ELEMENT's convention: sigmoid and
#: tanh 4, mul/add 1): LSTM c = f*c + i*g, h = o*tanh(c) after 3 sigmoids and a tanh on the
#: gates; GRU n = tanh(x_n + r*h_n), h = (1-z)*n + z*h after 2 sigmoids
RNN_CELL_FLOPS = {"LSTM": 3 * 4 + 2 * 4 + 3 + 1, "GRU": 2 * 4 + 4 + 3 + 2, "RNN_TANH": 4, "RNN_RELU": 1}


def _rnn(f: OpFacts):
    """nn.LSTM / nn.GRU / nn.RNN as one op (module docstring).  ``attrs``: mode, input_size,
    hidden_size, num_layers, bidirectional, batch_first, proj_size, bias."""
    a = f.attrs
    mode = a.get("mode", "LSTM")
    gates, cell = RNN_GATES.get(mode, 1), RNN_CELL_FLOPS.get(mode, 4)
    H, L = int(a.get("hidden_size", 0)), int(a.get("num_layers", 1))
    P = int(a.get("proj_size", 0) or 0)
    Hr = P or H
    dirs = 2 if a.get("bidirectional") else 1
    x = f.inputs[0]
    if len(x.shape) == 3:
        T, B = (x.shape[1], x.shape[0]) if a.get("batch_first") else (x.shape[0], x.shape[1])
    else:                                                   # unbatched [T, I]
        T, B = (x.shape[0] if x.shape else 1), 1
    w_grad = any(t.requires_grad for t in f.inputs if t.role == "param")
    # an initial state passed in (h_0, c_0) is an activation operand besides x
    state_grad = any(t.requires_grad for t in f.inputs[1:] if t.role == "act")
    gemm = skipped = cellwise = 0.0
    saved_elems = 0
    I = int(a.get("input_size", x.shape[-1] if x.shape else 0))
    for layer in range(L):
        width = I if layer == 0 else Hr * dirs
        gemm += dirs * 2.0 * B * T * gates * H * (width + Hr)
        gemm += dirs * 2.0 * B * T * H * P                    # an LSTM's projection h = W_hr h
        # the sum of the two GEMMs, the two biases, and the cell, per gate / hidden element
        cellwise += dirs * B * T * H * (cell + gates * (1 + (2 if a.get("bias", True) else 0)))
        # backward needs no gradient of a zero initial state (W_hh^T at the first step), nor of a
        # raw input that does not require grad (W_ih^T on x, first layer)
        skipped += 0.0 if state_grad else dirs * 2.0 * B * gates * H * Hr
        if layer == 0 and not x.requires_grad:
            skipped += dirs * 2.0 * B * T * gates * H * width
        # kept: the layer's input (shared by the directions), and per direction and step what the
        # cell's autograd decomposition saves -- LSTM h_{t-1}, the 4 gate activations, c_{t-1} and
        # tanh(c_t); GRU h_{t-1}, r, z, the hidden part of n, n and h_{t-1} - n; RNN its output
        # h_t, which the next step's GEMM keeps as h_{t-1} (so T + 1 states: h_0 .. h_T)
        per_dir = (B * (T + 1) * H if mode.startswith("RNN")
                   else B * T * (Hr + gates * H + 2 * H))
        saved_elems += B * T * width + dirs * per_dir
    fwd = gemm + cellwise
    # one GEMM per forward GEMM for the gradients of x_t and h_{t-1} (the recurrence needs them at
    # every step), a second for the weight gradients
    bwd = gemm - skipped + (gemm if w_grad else 0.0) + cellwise
    saved = _synthetic(f, "rnn", saved_elems * x.itemsize) if (x.requires_grad or w_grad) else []
    return "rnn", fwd, bwd, saved


def _softmax(f: OpFacts):
    fwd = FLOPS_PER_ELEMENT[f.canon] * f.out.numel
    return "softmax", fwd, BWD_FACTOR[f.canon] * fwd, _act(f.out)


def _dropout(f: OpFacts):
    p = float(f.attrs.get("p", 0.0))
    if p <= 0.0 or not f.attrs.get("train", True):
        return "dropout", 0.0, 0.0, []                        # identity: nothing kept
    fwd = FLOPS_PER_ELEMENT["dropout"] * f.out.numel
    saved = _synthetic(f, "mask", f.out.numel * MASK_BYTES) if f.inputs[0].role == "act" else []
    return "dropout", fwd, f.out.numel, saved                 # backward: grad * mask * scale


# which tensors pointwise ops keep (derivatives.yaml): "in" the input, "out" the output
_POINTWISE_KEEPS = {"gelu": "in", "silu": "in", "log": "in", "sin": "in", "cos": "in",
                    "abs": "in", "clamp": "in", "pow": "in",
                    "relu": "out", "sigmoid": "out", "tanh": "out", "exp": "out",
                    "rsqrt": "out", "sqrt": "out"}


def _pointwise(f: OpFacts):
    fwd = FLOPS_PER_ELEMENT.get(f.canon, 1) * f.out.numel
    bwd = fwd * BWD_FACTOR.get(f.canon, 1)
    saved: list[tuple[str, int]] = []
    ins = f.inputs
    keeps = _POINTWISE_KEEPS.get(f.canon)
    if keeps == "in" and ins:
        saved = _act(ins[0])
    elif keeps == "out":
        saved = _act(f.out)
    elif f.canon == "mul" and len(ins) == 2:                  # d(a*b): keeps the other operand
        a, b = ins
        saved = (_act(b) if a.requires_grad else []) + (_act(a) if b.requires_grad else [])
    elif f.canon == "div" and len(ins) == 2:                  # d(a/b): b for a; a and b for b
        a, b = ins
        saved = _act(b) if (a.requires_grad or b.requires_grad) else []
        saved += _act(a) if b.requires_grad else []
    elif f.canon in ("masked_fill", "where") and ins:         # keeps the boolean mask
        saved = [(t.key, t.nbytes) for t in ins if not t.is_float and t.role == "act"]
    elif f.canon in ("minimum", "maximum"):
        saved = [s for t in ins for s in _act(t)]
    if f.canon in ("compare", "tri"):
        bwd = 0.0
    return KIND.get(f.canon, "elementwise"), fwd, bwd, saved


def _reduction(f: OpFacts):
    x = f.inputs[0] if f.inputs else f.out
    fwd = float(x.numel)
    saved: list[tuple[str, int]] = []
    if f.canon == "amax":
        saved = _act(x) + _act(f.out)
    elif f.canon == "max_pool":
        saved = _act(x) + _synthetic(f, "indices", f.out.numel * INDEX_BYTES)
    elif f.canon == "avg_pool":
        saved = _act(x)
    bwd = 0.0 if f.canon == "argmax" else float(x.numel)
    return "reduction", fwd, bwd, saved


def _loss(f: OpFacts):
    x = f.inputs[0]
    fwd = FLOPS_PER_ELEMENT[f.canon] * x.numel
    if f.canon == "cross_entropy":                            # keeps log-softmax output + target
        saved = _synthetic(f, "log_probs", x.nbytes) + [s for t in f.inputs[1:] for s in _act(t)]
    else:
        saved = [s for t in f.inputs for s in _act(t)]
    return "loss", fwd, BWD_FACTOR.get(f.canon, 1) * fwd, saved


def _view(f: OpFacts):
    return "view", 0.0, 0.0, []


def _copy(f: OpFacts):
    return "view", 0.0, 0.0, []


def _create(f: OpFacts):
    return "other", 0.0, 0.0, []


def _cast(f: OpFacts):
    return "elementwise", 0.0, 0.0, []


def _leaf(f: OpFacts):
    """A module no tracer could enter: costed as a dense layer from its parameters.

    Forward 2 FLOPs per parameter per input row (a Linear's count generalised), or one per
    output element for a parameter-free module; backward 2x forward; keeps its inputs and
    output (conservative: the module's internals are unknown).  ``param_numel`` is the
    parameters that work on each row: a routed mixture of experts counts k of its n experts
    (``autopar.core.trace_fx.routed_expert_numel``).
    """
    params = int(f.attrs.get("param_numel", 0))
    first = next((t for t in f.inputs if t.role != "param"), f.out)
    rows = first.numel // max(first.shape[-1] if first.shape else 1, 1)
    fwd = 2.0 * rows * params if params else float(f.out.numel)
    saved = [s for t in f.inputs for s in _act(t)] + [s for t in f.outputs for s in _act(t)]
    return "leaf", fwd, 2.0 * fwd, saved


def _other(f: OpFacts):
    """Unknown op: one FLOP per output element; keeps its activation inputs (conservative)."""
    fwd = float(sum(t.numel for t in f.outputs))
    return "other", fwd, fwd, [s for t in f.inputs for s in _act(t)]


_RULES: dict[str, Callable] = {
    "linear": _linear, "addmm": _addmm, "addmm_conv1d": _addmm, "matmul": _matmul,
    "baddbmm": _matmul, "grouped_mm": _grouped_mm, "einsum": _einsum, "sdpa": _sdpa, "mha": _mha, "conv": _conv, "embedding": _embedding, "rnn": _rnn,
    "layer_norm": _norm, "rms_norm": _norm, "batch_norm": _norm, "group_norm": _norm,
    "softmax": _softmax, "log_softmax": _softmax, "dropout": _dropout,
    "sum": _reduction, "mean": _reduction, "amax": _reduction, "argmax": _reduction,
    "max_pool": _reduction, "avg_pool": _reduction,
    "cross_entropy": _loss, "nll_loss": _loss, "mse_loss": _loss,
    "view": _view, "copy": _copy, "create": _create, "cast": _cast, "leaf": _leaf,
    "other": _other,
}
