"""PowerSGD against uncompressed training on a real text: the loss after a few hundred steps.

    python benchmarks/grad_compression_loss.py                 # 300 steps, none vs powersgd:1 and :4
    python benchmarks/grad_compression_loss.py --steps 500 --ranks 2 8 --no-write

The text is the project's own documentation (docs/*.md, sorted by name and joined: English prose
with code, a few hundred KB, shipped with the repository), encoded as UTF-8 bytes (a vocabulary of
256: examples/make_tokens.py), 90% for training and the last 10% for validation.  A small GPT
(examples/gpt.py: 2 blocks, hidden 128, 4 heads, 64 tokens a sample, dropout 0) trains on 2 gloo
ranks (dp 2, 8 samples per rank, AdamW at the runtime's defaults) through ``autopar run`` --
plan files written with ``uniform_plan`` whose ``grad_compression`` is each of ``none`` and
``powersgd:R`` (torch's powerSGD_hook: error feedback, warm start, compression from step 2;
runtime/apply_dp.py) -- same seed, same batches.  Each run evaluates the validation tokens at
the end (``--val-data``, 8 global batches read from their start); the table gives it and the
mean training loss of the last 20 steps, and the margin of each compressed run over the
uncompressed one.

Writes benchmarks/results/grad_compression_loss.txt (not with ``--no-write``).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
MODEL_ARGS = {"layers": 2, "hidden": 128, "heads": 4, "seq": 64, "vocab": 256, "dropout": 0.0}
DP, MICRO_BATCH = 2, 8
TAIL = 20                 # training steps averaged for the "last steps" loss
EVAL_BATCHES = 8


def text_tokens(out: Path) -> tuple[Path, Path, str]:
    """The docs' text as byte tokens: (train file, validation file, a description of the text)."""
    import numpy as np

    from autopar.examples.make_tokens import encode, write_ids

    files = sorted((REPO / "docs").glob("*.md"))
    text = "\n\n".join(f.read_text(encoding="utf-8") for f in files)
    ids = encode(text)
    cut = int(len(ids) * 0.9)
    train, val = out / "train.bin", out / "val.bin"
    write_ids(ids[:cut], train, 256)
    write_ids(ids[cut:], val, 256)
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    return train, val, (f"docs/*.md ({len(files)} files, {len(ids)} bytes, sha256 {digest}): "
                        f"{cut} training tokens, {len(ids) - cut} validation tokens")


def write_plan(path: Path, compression: str) -> Path:
    from autopar.core.capture import capture_model_file
    from autopar.core.plan import ModelRef, save_plan, uniform_plan

    gpt = REPO / "examples" / "gpt.py"
    g = capture_model_file(str(gpt), dict(MODEL_ARGS), 1)
    plan = uniform_plan(model=ModelRef(str(gpt), dict(MODEL_ARGS), "gpt", g.fingerprint), num_layers=len(g.layers),
                        dp=DP, micro_batch=MICRO_BATCH, grad_compression=compression)
    save_plan(plan, path)
    return path


def run(plan: Path, train: Path, val: Path, steps: int, timeout_s: float) -> dict:
    from autopar.runtime.ports import free_port

    measured = plan.with_name(plan.stem + ".measured.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(DP), "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "autopar.runtime", str(plan), "--steps", str(steps),
           "--data", str(train), "--val-data", str(val), "--eval-every", str(steps), "--eval-batches",
           str(EVAL_BATCHES), "--measured", str(measured), "--timing-warmup", "1"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout_s)
    if proc.returncode != 0:
        sys.exit(f"{plan.name}: autopar run failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    m = json.loads(measured.read_text())
    m["wall_s"] = time.perf_counter() - t0
    return m


def val_loss(m: dict) -> float:
    """The last evaluation's validation loss (measured.json ``val_losses``: [step, loss] pairs)."""
    evals = m.get("val_losses") or []
    return float(evals[-1][1]) if evals else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 4], help="PowerSGD ranks to compare (default 1 4)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    ap.add_argument("--no-write", action="store_true", help="print only; leave benchmarks/results alone")
    args = ap.parse_args(argv)
    lines = [f"$ python benchmarks/grad_compression_loss.py --steps {args.steps} --ranks {' '.join(map(str, args.ranks))}"]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        train, val, about = text_tokens(tmp)
        lines += [f"text: {about}",
                  f"model: examples/gpt.py {MODEL_ARGS}; dp {DP} (gloo), {MICRO_BATCH} samples per rank, "
                  f"{args.steps} steps, AdamW lr 1e-3 (runtime defaults); validation: {EVAL_BATCHES} global batches",
                  "", f"{'grad_compression':<18}{'val loss':>10}{f'last {TAIL} train':>16}{'margin (val)':>20}{'wall s':>9}"]
        print("\n".join(lines), flush=True)
        base = None
        for compression in ["none"] + [f"powersgd:{r}" for r in args.ranks]:
            m = run(write_plan(tmp / f"{compression.replace(':', '_')}.json", compression), train, val, args.steps,
                    args.timeout)
            v, tail = val_loss(m), sum(m["losses"][-TAIL:]) / len(m["losses"][-TAIL:])
            base = v if base is None else base
            margin = "" if compression == "none" else f"{v - base:+.4f} ({(v - base) / base:+.1%})"
            line = f"{compression:<18}{v:>10.4f}{tail:>16.4f}{margin:>20}{m['wall_s']:>9.1f}"
            lines.append(line)
            print(line, flush=True)
    if not args.no_write:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "grad_compression_loss.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
