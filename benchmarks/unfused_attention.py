"""The simulator's price of unfused attention against a published GPU benchmark.

Attention written out in PyTorch ops -- a batched GEMM for the scores, an optional additive
causal mask, a softmax over the last dim, a batched GEMM with V -- is what Hugging Face models
run with ``attn_implementation="eager"``, what ``examples/gpt.py`` runs with
``attention="math"``, and (with Megatron-LM's fused softmax and a dropout in between) what the
Megatron-LM runs of 2021 ran.  Its cost is dominated by memory-bound kernels over the
``heads x seq x seq`` scores, which the simulator prices from the profile's HBM bandwidth and
``efficiency.memory_bound`` (an assumption in both GPU profiles) and from its GEMM efficiency.

The reference is the "Pytorch" series of the FlashAttention-2 benchmark: T. Dao, "FlashAttention-2:
Faster Attention with Better Parallelism and Work Partitioning", arXiv 2307.08691 (2023), Fig. 4
(A100 80GB SXM4; the same figure as Dao-AILab/flash-attention ``assets/flash2_a100_fwd_bwd_benchmark.png``)
and the H100 80GB SXM5 figure of the same benchmark in that repository
(``assets/flash2_h100_fwd_bwd_benchmark.png``), read from the bar labels.  The benchmark's setup
(``benchmarks/benchmark_flash_attention.py`` there, ``attention_pytorch``): fp16, model width
2048, heads = 2048 / head dim, batch x sequence = 16k tokens, dropout 0 (no dropout kernel
runs), scores by ``baddbmm`` with the 1/sqrt(d) scale folded in, the causal mask added as a
``seq x seq`` tensor, ``torch.softmax``, then an ``einsum`` with V; speed = FLOPs / (forward +
backward time), the FLOPs counted as 4 x batch x seq^2 x heads x head dim, halved under the
causal mask, times 3.5 for forward + backward.

Each point is priced here as the simulator prices a layer's ops (``CostModel.op_time_ex``,
forward and backward, as ``simulator/layer_cost.py`` sums them): the same ops captured on the
meta device in fp16 and priced with the bundled ``a100-80gb-sxm`` and ``h100-sxm`` profiles.
Nothing here is fitted; the figures only say how far the bundled prices are from a measurement
of this kind of code.

Error = predicted speed / measured speed - 1: positive means the simulator promises more than
the GPU delivered (the convention of benchmarks/published_runs.py).

    python benchmarks/unfused_attention.py [--implied] [--no-write]

Writes benchmarks/results/unfused_attention.{txt,json}.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

WIDTH = 2048                                  # the benchmark's model width (``dim``)
#: (batch, sequence) pairs of the benchmark: 16k tokens each
SHAPES = ((32, 512), (16, 1024), (8, 2048), (4, 4096), (2, 8192))
#: the "Pytorch" bars, TFLOP/s forward + backward, per (profile, causal, head dim), in SHAPES order
#: (the 16k points ran out of memory and have no bar)
MEASURED_TFLOPS = {
    ("a100-80gb-sxm", False, 64): (36, 40, 43, 45, 46),
    ("a100-80gb-sxm", False, 128): (53, 67, 76, 79, 86),
    ("a100-80gb-sxm", True, 64): (15, 16, 17, 18, 18),
    ("a100-80gb-sxm", True, 128): (23, 28, 32, 32, 34),
    ("h100-sxm", False, 64): (62, 72, 81, 86, 87),
    ("h100-sxm", False, 128): (93, 120, 145, 160, 167),
    ("h100-sxm", True, 64): (26, 29, 31, 32, 32),
    ("h100-sxm", True, 128): (40, 50, 57, 61, 63),
}
SOURCES = {
    "a100-80gb-sxm": "Dao 2023 (arXiv 2307.08691) Fig. 4, 'Pytorch' bars; Dao-AILab/flash-attention "
                     "assets/flash2_a100_fwd_bwd_benchmark.png",
    "h100-sxm": "Dao-AILab/flash-attention assets/flash2_h100_fwd_bwd_benchmark.png, 'Pytorch' bars "
                "(the same benchmark on H100 80GB SXM5)",
}


class EagerAttention(nn.Module):
    """The benchmark's PyTorch attention over a packed [batch, seq, 3, heads, head_dim] input."""

    def __init__(self, causal: bool):
        super().__init__()
        self.causal = causal
        # the benchmark's qkv requires grad; a captured input does not, so the input passes
        # through a scale by a parameter first (that op is left out of the price: price_point)
        self.grad_source = nn.Parameter(torch.ones(()))

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        b, s, _, h, d = qkv.shape
        q, k, v = (qkv * self.grad_source).unbind(dim=2)
        q_Nsd = q.permute(0, 2, 1, 3).reshape(b * h, s, d)
        k_Nds = k.permute(0, 2, 3, 1).reshape(b * h, d, s)
        scores = torch.empty(b * h, s, s, dtype=qkv.dtype, device=qkv.device)
        scores = torch.baddbmm(scores, q_Nsd, k_Nds, beta=0, alpha=1.0 / math.sqrt(d)).view(b, h, s, s)
        if self.causal:
            mask = torch.full((s, s), -10000.0, device=qkv.device).triu(1)
            scores = scores + mask.to(scores.dtype)
        probs = torch.softmax(scores, dim=-1)
        return torch.einsum("bhts,bshd->bthd", probs, v)


@functools.lru_cache(maxsize=None)
def _graph(causal: bool, head_dim: int, batch: int, seq: int):
    """One point's attention captured on meta (the same for every profile and efficiency)."""
    from autopar.core.capture import capture

    heads = WIDTH // head_dim
    with torch.device("meta"):
        qkv = torch.empty(batch, seq, 3, heads, head_dim, dtype=torch.float16)
        model = EagerAttention(causal).to(torch.float16)
    return capture(model, (qkv,), model_name="eager_attention", batch_size=batch)


def price_point(cm, causal: bool, head_dim: int, batch: int, seq: int) -> dict:
    """Predicted forward and backward seconds of one point, and its per-op parts."""
    fwd = bwd = 0.0
    parts = []
    for op in _graph(causal, head_dim, batch, seq).ops:
        if op.params:                       # the grad source, not part of the benchmark
            continue
        f, _ = cm.op_time_ex(op, "fp16")
        b, _ = cm.op_time_ex(op, "fp16", backward=True)
        fwd, bwd = fwd + f, bwd + b
        if f + b > 0:
            parts.append({"op": f"{op.kind} {op.target}", "fwd_ms": 1e3 * f, "bwd_ms": 1e3 * b})
    return {"fwd_s": fwd, "bwd_s": bwd, "parts": parts}


def benchmark_flops(batch: int, seq: int, heads: int, head_dim: int, causal: bool) -> float:
    """The benchmark's FLOP count of forward + backward (its ``flops(..., mode="fwd_bwd")``)."""
    return 3.5 * 4 * batch * seq ** 2 * heads * head_dim / (2 if causal else 1)


def run(memory_bound: dict[str, float] | None = None, profiles: tuple[str, ...] = tuple(SOURCES)) -> dict:
    """Every point of ``profiles`` priced with the bundled profiles, or with ``memory_bound[profile]``
    in place of a profile's ``efficiency.memory_bound``."""
    from dataclasses import replace

    from autopar.simulator.device.cost_model import CostModel

    points = []
    for (profile, causal, head_dim), measured in MEASURED_TFLOPS.items():
        if profile not in profiles:
            continue
        cm = CostModel.from_profile(profile)
        if memory_bound and profile in memory_bound:
            cm = replace(cm, efficiency={**cm.efficiency, "memory_bound": memory_bound[profile]})
        for (batch, seq), tflops in zip(SHAPES, measured):
            p = price_point(cm, causal, head_dim, batch, seq)
            flops = benchmark_flops(batch, seq, WIDTH // head_dim, head_dim, causal)
            predicted = flops / (p["fwd_s"] + p["bwd_s"]) / 1e12
            points.append({"profile": profile, "causal": causal, "head_dim": head_dim, "batch": batch, "seq": seq,
                           "measured_tflops": tflops, "predicted_tflops": predicted,
                           "error": predicted / tflops - 1.0, "fwd_ms": 1e3 * p["fwd_s"], "bwd_ms": 1e3 * p["bwd_s"],
                           "parts": p["parts"]})
    return {"points": points}


def implied_memory_bound(profile: str, lo: float = 0.2, hi: float = 1.0, steps: int = 30) -> float:
    """The ``efficiency.memory_bound`` at which the profile's points have a mean signed error of
    zero (bisection; the price falls monotonically as the efficiency rises)."""
    def mean_error(e: float) -> float:
        return statistics.fmean(p["error"] for p in run({profile: e}, (profile,))["points"])

    for _ in range(steps):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if mean_error(mid) < 0 else (lo, mid)
    return 0.5 * (lo + hi)


def summary(points: list[dict]) -> dict:
    errs = [p["error"] for p in points]
    worst = max(points, key=lambda p: abs(p["error"]))
    return {"points": len(errs), "median_abs": statistics.median(abs(e) for e in errs),
            "mean_signed": statistics.fmean(errs),
            "worst": f"d{worst['head_dim']} seq {worst['seq']} ({100 * worst['error']:+.1f}%)"}


def report(res: dict) -> list[str]:
    pts = res["points"]
    lines = [f"{'profile':<14} {'mask':<6} {'d':>4} {'batch':>5} {'seq':>5} {'measured':>9} {'predicted':>9} {'error':>7}"
             f"  (TFLOP/s fwd+bwd, the benchmark's count)"]
    for p in pts:
        lines.append(f"{p['profile']:<14} {'causal' if p['causal'] else 'full':<6} {p['head_dim']:>4} {p['batch']:>5} "
                     f"{p['seq']:>5} {p['measured_tflops']:>9.0f} {p['predicted_tflops']:>9.1f} {100 * p['error']:>+6.1f}%")
    lines += ["", f"  {'profile / mask':<22} {'points':>6} {'median |err|':>12} {'mean signed':>11}  worst"]
    groups = {}
    for p in pts:
        groups.setdefault((p["profile"], "causal" if p["causal"] else "full"), []).append(p)
        groups.setdefault((p["profile"], "all"), []).append(p)
    res["summary"] = {}
    for (profile, mask), g in sorted(groups.items()):
        s = summary(g)
        res["summary"][f"{profile}/{mask}"] = s
        lines.append(f"  {profile + ' / ' + mask:<22} {s['points']:>6} {100 * s['median_abs']:>11.1f}% "
                     f"{100 * s['mean_signed']:>+10.1f}%  {s['worst']}")
    ex = next(p for p in pts if p["profile"] == "a100-80gb-sxm" and not p["causal"] and p["head_dim"] == 64
              and p["seq"] == 2048)
    lines += ["", "priced parts, a100-80gb-sxm, full mask, d 64, seq 2048 (ms forward / backward):"]
    lines += [f"  {q['op']:<40} {q['fwd_ms']:7.3f} {q['bwd_ms']:7.3f}" for q in ex["parts"]]
    lines += ["", "sources: " + "; ".join(f"{k}: {v}" for k, v in SOURCES.items())]
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-write", action="store_true", help="print only; leave benchmarks/results alone")
    ap.add_argument("--implied", action="store_true",
                    help="also solve, per profile, for the memory-bound efficiency that zeroes the mean error")
    args = ap.parse_args()
    res = run()
    lines = report(res)
    if args.implied:
        res["implied_memory_bound"] = {p: implied_memory_bound(p) for p in SOURCES}
        lines += ["", "efficiency.memory_bound at which the mean signed error is zero (--implied):"]
        lines += [f"  {p}: {e:.3f}" for p, e in res["implied_memory_bound"].items()]
    print("\n".join(lines))
    if not args.no_write:
        RESULTS.mkdir(parents=True, exist_ok=True)
        cmd = "python benchmarks/unfused_attention.py" + (" --implied" if args.implied else "")
        (RESULTS / "unfused_attention.txt").write_text(f"$ {cmd}\n" + "\n".join(lines) + "\n")
        res.update({"command": cmd,
                    "error": "predicted speed / measured speed - 1", "sources": SOURCES})
        (RESULTS / "unfused_attention.json").write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
