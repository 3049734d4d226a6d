"""Capture time and peak memory for GPT-3 175B on the meta device.

    python benchmarks/capture_175b.py [--batch-size 8]

Prints the wall time of capture_model_file (build on meta + trace + shapes + costs + layers),
the process's peak RSS (resource.getrusage, which includes the torch import), and their
ratios to the targets: 20 s and 2 GB (a ratio < 1 meets the target).
"""
from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

TARGET_S = 20.0
TARGET_RSS_BYTES = 2e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    t0 = time.perf_counter()
    import torch  # noqa: F401  (import time reported separately)

    from autopar.core.capture import capture_model_file

    import_s = time.perf_counter() - t0
    gpt = Path(__file__).resolve().parents[1] / "examples" / "gpt.py"
    t1 = time.perf_counter()
    graph = capture_model_file(gpt, {"size": "gpt3-175b"}, args.batch_size)
    capture_s = time.perf_counter() - t1
    # ru_maxrss is in KiB on Linux, bytes on macOS
    scale = 1 if sys.platform == "darwin" else 1024
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    print(f"model: gpt3-175b, batch {args.batch_size}: {graph.params_total / 1e9:.2f}B parameters, "
          f"{len(graph.ops)} ops, {len(graph.layers)} layers, method {graph.capture_method}")
    print(f"import torch + autopar: {import_s:.2f} s")
    print(f"capture: {capture_s:.2f} s (target {TARGET_S:.0f} s, ratio {capture_s / TARGET_S:.3f})")
    for note in graph.notes:
        print(f"  {note}")
    print(f"peak RSS: {peak_rss / 1e9:.3f} GB (target {TARGET_RSS_BYTES / 1e9:.0f} GB, "
          f"ratio {peak_rss / TARGET_RSS_BYTES:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
