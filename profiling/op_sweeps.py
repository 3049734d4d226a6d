"""Which ops the profiler times, at which shapes, and what each call costs in FLOPs and bytes.

An ``OpCase`` is one point of a sweep: an op kind (one of ``autopar.core.graph.OP_KINDS``,
plus ``optimizer`` for the AdamW step and ``copy`` for the bandwidth probe), a variant (which
implementation: ``layer_norm`` / ``rms_norm``, ``sdpa`` / ``math``, ``gelu`` / ``add`` /
``masked_fill``), a
shape and the FLOPs and bytes of one call.  ``build`` allocates the operands on a device and
returns the closure that is timed, so a sweep costs only the memory of its current case.

FLOP conventions (the same as the graph capture's, so the cost model can look rows up by FLOPs):
* linear / matmul: 2*m*n*k (a multiply-add is 2 FLOPs; Narayanan et al. 2021, Sec. 5.1).
* attention: 4*b*h*s^2*d for Q K^T and P V, the causal mask not halving it (the same count as
  Megatron's 96*B*s*l*h^2*(1 + s/6h + ...) formula, Narayanan et al. 2021, eq. 3).
* conv2d: 2 * output elements * (in_channels * kernel area).
* memory-bound ops (norm, softmax, element-wise, embedding, copy, optimizer) are priced by the
  bytes they read and write; their FLOPs use the capture's per-element counts
  (``autopar.core.op_costs.FLOPS_PER_ELEMENT``: gelu 8, add 1, layer norm 7, RMS norm 4,
  softmax 5) so a row and a captured op of the same size carry the same FLOPs.
* attention is timed twice: the fused kernel (kind ``attention``, what a captured
  ``scaled_dot_product_attention`` is priced from) and the unfused math path (kind
  ``attention_math``, for reference: a model that writes attention by hand is captured as
  matmul + softmax ops, priced from those rows).
Bytes are the roofline traffic: every operand read once and the output written once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from autopar.core.dtypes import PRECISION_BYTES

TORCH_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: kinds whose time follows their FLOPs (the rest follow their bytes)
COMPUTE_KINDS = ("linear", "matmul", "attention", "attention_math", "conv")

Closure = Callable[[], object]


@dataclass(frozen=True)
class OpCase:
    kind: str
    variant: str
    dtype: str
    shape: tuple[int, ...]
    flops: float
    bytes: float
    build: Callable[[torch.device], Closure]

    @property
    def label(self) -> str:
        return f"{self.kind}/{self.variant} {self.dtype} {'x'.join(map(str, self.shape))}"

    @property
    def work(self) -> float:
        """The quantity its time grows with: FLOPs for compute kinds, bytes for the others."""
        return self.flops if self.kind in COMPUTE_KINDS else self.bytes


# ------------------------------------------------------------------------- the sweeps
# Shapes cover a small GPT on one CPU thread (hidden 64..1024, a few thousand tokens) up to
# a tenth of a second per call; on CUDA they go up to the sizes of a 175B model's layer.
CPU_FULL = {
    "linear": [(m, k, n) for m in (32, 128, 512, 2048)
               for k, n in ((64, 64), (64, 256), (256, 64), (256, 256), (256, 1024), (1024, 256), (1024, 1024))],
    "matmul": [(bh, s, 64, s) for bh in (8, 32) for s in (64, 128, 256, 512)]
              + [(bh, s, s, 64) for bh in (8, 32) for s in (64, 128, 256, 512)],
    "attention": [(1, 4, 64, 32), (2, 4, 128, 64), (2, 8, 256, 64), (4, 8, 512, 64), (2, 12, 1024, 64)],
    "conv": [(8, 3, 32, 32, 32), (8, 32, 32, 32, 64), (8, 64, 16, 16, 128), (16, 128, 8, 8, 256)],
    "norm": [(t, h) for t in (256, 2048, 16384) for h in (64, 256, 1024)],
    "softmax": [(r, c) for r in (64, 1024, 16384) for c in (64, 256, 1024)],
    "elementwise": [(1 << p,) for p in (12, 14, 16, 18, 20, 22, 24)],
    "embedding": [(t, v, h) for v, h in ((1024, 64), (50304, 768)) for t in (256, 2048, 8192)],
    "copy": [(1 << p,) for p in (12, 14, 16, 18, 20, 22, 24, 26)],
    "optimizer": [(1 << p,) for p in (14, 16, 18, 20, 22, 24)],
}
CPU_QUICK = {
    "linear": [(m, k, n) for m in (16, 64) for k, n in ((32, 32), (64, 128), (128, 128))],
    "matmul": [(4, s, 16, s) for s in (16, 64)],
    "attention": [(1, 2, 16, 16), (1, 2, 64, 16)],
    "conv": [(2, 3, 8, 8, 4), (2, 8, 16, 16, 8)],
    "norm": [(t, 64) for t in (64, 512)],
    "softmax": [(r, 64) for r in (64, 512)],
    "elementwise": [(1 << p,) for p in (10, 14, 16)],
    "embedding": [(t, 256, 32) for t in (64, 512)],
    "copy": [(1 << p,) for p in (12, 16, 20)],
    "optimizer": [(1 << p,) for p in (10, 14)],
}
CUDA_FULL = {
    "linear": [(m, k, n) for m in (512, 2048, 8192, 16384)
               for k, n in ((1024, 1024), (1024, 4096), (4096, 1024), (4096, 4096), (8192, 8192), (12288, 12288))],
    "matmul": [(bh, s, 128, s) for bh in (32, 128) for s in (512, 1024, 2048, 4096)]
              + [(bh, s, s, 128) for bh in (32, 128) for s in (512, 1024, 2048, 4096)],
    "attention": [(4, 16, 512, 64), (4, 16, 1024, 64), (2, 32, 2048, 128), (1, 96, 2048, 128), (1, 32, 8192, 128)],
    "conv": [(64, 3, 224, 224, 64), (64, 64, 56, 56, 64), (64, 128, 28, 28, 128), (64, 256, 14, 14, 256)],
    "norm": [(t, h) for t in (2048, 16384, 65536) for h in (1024, 4096, 12288)],
    "softmax": [(r, c) for r in (4096, 65536, 262144) for c in (512, 2048, 4096)],
    "elementwise": [(1 << p,) for p in (16, 18, 20, 22, 24, 26, 28)],
    "embedding": [(t, 50304, h) for h in (1024, 4096, 12288) for t in (2048, 16384)],
    "copy": [(1 << p,) for p in (16, 18, 20, 22, 24, 26, 28, 30)],
    "optimizer": [(1 << p,) for p in (18, 20, 22, 24, 26, 28)],
}
CUDA_QUICK = {k: v[:2] for k, v in CUDA_FULL.items()}

#: one AdamW parameter tensor holds at most this many elements (a model's parameters come in
#: many tensors; the per-tensor overhead is part of the optimizer's cost)
OPTIMIZER_TENSOR_NUMEL = 1 << 20


def op_cases(device_type: str, dtypes: list[str], quick: bool) -> list[OpCase]:
    """All cases of the sweep for a device type, in the order they are timed."""
    table = (CUDA_QUICK if quick else CUDA_FULL) if device_type == "cuda" else (CPU_QUICK if quick else CPU_FULL)
    cases: list[OpCase] = []
    for dt in dtypes:
        for kind in ("linear", "matmul", "attention", "conv", "norm", "softmax", "elementwise", "embedding", "copy"):
            for shape in table[kind]:
                cases.extend(_CASE_MAKERS[kind](shape, dt))
    for shape in table["optimizer"]:
        cases.append(_optimizer_case(shape))   # fp32 master weights whatever the compute dtype
    return cases


# ------------------------------------------------------------------------ case makers
def _linear(shape, dt):
    m, k, n = shape
    es = PRECISION_BYTES[dt]

    def build(device):
        x_MK = torch.randn(m, k, device=device, dtype=TORCH_DTYPES[dt])
        w_NK = torch.randn(n, k, device=device, dtype=TORCH_DTYPES[dt])
        return lambda: F.linear(x_MK, w_NK)
    return [OpCase("linear", "linear", dt, shape, 2.0 * m * n * k, float((m * k + n * k + m * n) * es), build)]


def _matmul(shape, dt):
    b, m, k, n = shape
    es = PRECISION_BYTES[dt]

    def build(device):
        a_BMK = torch.randn(b, m, k, device=device, dtype=TORCH_DTYPES[dt])
        b_BKN = torch.randn(b, k, n, device=device, dtype=TORCH_DTYPES[dt])
        return lambda: torch.bmm(a_BMK, b_BKN)
    return [OpCase("matmul", "bmm", dt, shape, 2.0 * b * m * n * k, float(b * (m * k + k * n + m * n) * es), build)]


def _attention(shape, dt):
    b, h, s, d = shape
    es = PRECISION_BYTES[dt]
    flops = 4.0 * b * h * s * s * d
    out = []
    for variant in ("sdpa", "math"):
        # the math path materialises the s x s scores (written and read back twice: scores, probs)
        traffic = 4 * b * h * s * d * es + (4 * b * h * s * s * es if variant == "math" else 0)

        def build(device, variant=variant):
            from torch.nn.attention import SDPBackend, sdpa_kernel

            q_BHSD, k_BHSD, v_BHSD = (torch.randn(b, h, s, d, device=device, dtype=TORCH_DTYPES[dt]) for _ in range(3))
            if variant == "math":
                def call():
                    with sdpa_kernel(SDPBackend.MATH):
                        return F.scaled_dot_product_attention(q_BHSD, k_BHSD, v_BHSD, is_causal=True)
                return call
            return lambda: F.scaled_dot_product_attention(q_BHSD, k_BHSD, v_BHSD, is_causal=True)
        kind = "attention" if variant == "sdpa" else "attention_math"
        out.append(OpCase(kind, variant, dt, shape, flops, float(traffic), build))
    return out


def _conv(shape, dt):
    b, c, hgt, wid, o = shape
    es = PRECISION_BYTES[dt]
    flops = 2.0 * b * o * hgt * wid * c * 9      # 3x3 kernel, stride 1, padding 1: output is b x o x H x W

    def build(device):
        x = torch.randn(b, c, hgt, wid, device=device, dtype=TORCH_DTYPES[dt])
        w = torch.randn(o, c, 3, 3, device=device, dtype=TORCH_DTYPES[dt])
        return lambda: F.conv2d(x, w, padding=1)
    traffic = (b * c * hgt * wid + o * c * 9 + b * o * hgt * wid) * es
    return [OpCase("conv", "conv2d_3x3", dt, shape, flops, float(traffic), build)]


def _norm(shape, dt):
    t, h = shape
    es = PRECISION_BYTES[dt]
    out = []
    for variant, per_element in (("layer_norm", 7), ("rms_norm", 4)):   # op_costs.FLOPS_PER_ELEMENT
        def build(device, variant=variant):
            x = torch.randn(t, h, device=device, dtype=TORCH_DTYPES[dt])
            w = torch.ones(h, device=device, dtype=TORCH_DTYPES[dt])
            if variant == "layer_norm":
                bias = torch.zeros(h, device=device, dtype=TORCH_DTYPES[dt])
                return lambda: F.layer_norm(x, (h,), w, bias)
            return lambda: F.rms_norm(x, (h,), w)
        out.append(OpCase("norm", variant, dt, shape, float(per_element * t * h), float((2 * t * h + 2 * h) * es), build))
    return out


def _softmax(shape, dt):
    r, c = shape
    es = PRECISION_BYTES[dt]

    def build(device):
        x = torch.randn(r, c, device=device, dtype=TORCH_DTYPES[dt])
        return lambda: F.softmax(x, dim=-1)
    return [OpCase("softmax", "softmax", dt, shape, 5.0 * r * c, float(2 * r * c * es), build)]   # op_costs: 5 per element


#: elements of the boolean mask of the masked_fill case (a 64 x 64 causal mask)
MASK_ELEMENTS = 64 * 64


def _elementwise(shape, dt):
    (n,) = shape
    es = PRECISION_BYTES[dt]

    def build_gelu(device):
        x = torch.randn(n, device=device, dtype=TORCH_DTYPES[dt])
        return lambda: F.gelu(x)

    def build_add(device):
        x = torch.randn(n, device=device, dtype=TORCH_DTYPES[dt])
        y = torch.randn(n, device=device, dtype=TORCH_DTYPES[dt])
        return lambda: torch.add(x, y)
    # the in-place fill of a causal mask, the mask broadcast over the leading dimension as a
    # (seq, seq) mask is over batch and heads; out-of-place masked_fill is a clone (priced as a
    # copy, core/copies.py) and this kernel
    m = min(n, MASK_ELEMENTS)

    def build_masked_fill(device):
        x = torch.randn(n // m, m, device=device, dtype=TORCH_DTYPES[dt])
        side = int(MASK_ELEMENTS ** 0.5)
        mask = torch.ones(side, side, device=device).triu(1).bool().flatten()[:m]
        return lambda: x.masked_fill_(mask, -1e4)
    return [OpCase("elementwise", "gelu", dt, shape, 8.0 * n, float(2 * n * es), build_gelu),   # op_costs: gelu 8, add 1
            OpCase("elementwise", "add", dt, shape, float(n), float(3 * n * es), build_add),
            OpCase("elementwise", "masked_fill", dt, shape, float(n), float(2 * n * es + m), build_masked_fill)]


def _embedding(shape, dt):
    t, v, h = shape
    es = PRECISION_BYTES[dt]

    def build(device):
        gen = torch.Generator().manual_seed(0)
        idx = torch.randint(0, v, (t,), generator=gen).to(device)
        table = torch.randn(v, h, device=device, dtype=TORCH_DTYPES[dt])
        return lambda: F.embedding(idx, table)
    return [OpCase("embedding", "embedding", dt, shape, 0.0, float(2 * t * h * es + 8 * t), build)]


def _copy(shape, dt):
    (n,) = shape
    es = PRECISION_BYTES[dt]

    def build(device):
        src = torch.randn(n, device=device, dtype=TORCH_DTYPES[dt])
        dst = torch.empty_like(src)
        return lambda: dst.copy_(src)
    return [OpCase("copy", "copy", dt, shape, 0.0, float(2 * n * es), build)]


def _optimizer_case(shape) -> OpCase:
    (n,) = shape
    # AdamW reads param, grad, exp_avg, exp_avg_sq and writes param, exp_avg, exp_avg_sq:
    # 7 fp32 tensors of n elements (Loshchilov & Hutter 2019, Algorithm 2); about 12 FLOPs each.

    def build(device):
        sizes = [OPTIMIZER_TENSOR_NUMEL] * (n // OPTIMIZER_TENSOR_NUMEL)
        if n % OPTIMIZER_TENSOR_NUMEL:
            sizes.append(n % OPTIMIZER_TENSOR_NUMEL)
        params = [torch.nn.Parameter(torch.randn(s, device=device)) for s in sizes]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(params, lr=1e-4)
        return opt.step
    return OpCase("optimizer", "adamw", "fp32", shape, 12.0 * n, float(7 * PRECISION_BYTES["fp32"] * n), build)


_CASE_MAKERS = {"linear": _linear, "matmul": _matmul, "attention": _attention, "conv": _conv, "norm": _norm,
                "softmax": _softmax, "elementwise": _elementwise, "embedding": _embedding, "copy": _copy}
