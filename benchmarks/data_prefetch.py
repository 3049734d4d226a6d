"""Step time on a token file (``--data``, read per rank with a prefetch thread) against
synthetic batches (``make_batch``), side by side.

    python benchmarks/data_prefetch.py [--rounds 12] [--steps-per-round 6] [--tokens 4000000] [--shuffle 1]

Starts one ``torchrun`` with 2 ranks (gloo on CPU, NCCL on CUDA).  In that process group two
``autopar.runtime.train.Trainer``s of the same dp=2 plan of examples/gpt.py are set up side by
side: one reads a token file of ``--tokens`` random ids (uint16, written to a temporary
folder; with ``--shuffle SEED``, in shuffled order, so each step gathers rows from anywhere in
the file), the other draws ``make_batch``'s synthetic batches.  After warm-up they alternate
step by step (A B A B ...) in rounds of ``--steps-per-round`` steps each, the order flipping
every round, so that a slow spell of this shared machine hits both alike.  The step time is
the trainer's own step clock (what measured.json reports: on the data side it includes the
wait for the prefetched rows and their copy to the device; on the synthetic side the copy of
the rank's slice -- its draw runs before the clock, as a data loader's would).  Per round:
median step time of each and their ratio.  The figure is the median, over all steps, of the
ratio of a data step to the synthetic step run next to it (the pair shares the machine's load
of that moment; target <= 1.02), with the median of the per-round ratios beside it.
``--ranks 1`` runs one rank (no gradient all-reduce: less noise on a shared machine).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from autopar.runtime.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
GPT = ROOT / "examples" / "gpt.py"
TARGET_RATIO = 1.02       # issue 43, "Data": step time with --data within 2% of synthetic batches


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps-per-round", type=int, default=6)
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--tokens", type=int, default=4_000_000)
    p.add_argument("--shuffle", type=int, default=1)
    p.add_argument("--ranks", type=int, choices=(1, 2), default=2)
    p.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def model_args(a: argparse.Namespace) -> dict:
    return {"layers": a.layers, "hidden": a.hidden, "heads": a.heads, "seq": a.seq, "vocab": a.vocab,
            "dropout": 0.0}


def worker(spec_path: Path) -> None:
    import torch.distributed as dist

    from autopar.runtime.mesh import shutdown
    from autopar.runtime.options import RunOptions
    from autopar.runtime.train import Trainer

    spec = json.loads(spec_path.read_text())
    plan, rounds, per_round, warmup = Path(spec["plan"]), spec["rounds"], spec["steps_per_round"], spec["warmup"]
    total = warmup + rounds * per_round + 1        # one more step each at the end (measures the model state)
    common = dict(plan_path=plan, steps=total, log_every=total)
    trainers = {"data": Trainer(RunOptions(**common, measured_path=plan.with_name("data.json"),
                                           data_path=Path(spec["data"]), shuffle_seed=spec["shuffle"])),
                "synthetic": Trainer(RunOptions(**common, measured_path=plan.with_name("synthetic.json")))}
    steps = {name: 0 for name in trainers}

    def one(name: str) -> float:
        t = trainers[name]
        t.step(steps[name])
        steps[name] += 1
        return t.clock.times_s[-1]

    for _ in range(warmup):
        for name in trainers:
            one(name)
    results = []
    for r in range(rounds):
        order = ("data", "synthetic") if r % 2 == 0 else ("synthetic", "data")
        times = {name: [] for name in trainers}
        for _ in range(per_round):
            for name in order:
                times[name].append(one(name))
        results.append({"order": "DS" if r % 2 == 0 else "SD", **times})
    for name in trainers:
        one(name)
        trainers[name].finish()
    if dist.get_rank() == 0:
        Path(spec["out"]).write_text(json.dumps(results))
    shutdown()


def summarize(results: list[dict]) -> dict:
    rounds = []
    for r in results:
        d, s = statistics.median(r["data"]), statistics.median(r["synthetic"])
        rounds.append({"order": r["order"], "data_s": d, "synthetic_s": s, "ratio": d / s})
    ratios = [r["ratio"] for r in rounds]
    pairs = [d / s for r in results for d, s in zip(r["data"], r["synthetic"])]
    return {"rounds": rounds, "pair_ratio": statistics.median(pairs), "pairs": len(pairs),
            "median_ratio": statistics.median(ratios), "min_ratio": min(ratios),
            "max_ratio": max(ratios), "data_median_s": statistics.median(t for r in results for t in r["data"]),
            "synthetic_median_s": statistics.median(t for r in results for t in r["synthetic"])}


def main(argv=None) -> int:
    a = parse(argv)
    if a.worker is not None:
        worker(a.worker)
        sys.stdout.flush()
        os._exit(0)
    import numpy as np

    from autopar.core.capture import capture_model_file
    from autopar.core.plan import ModelRef, save_plan, uniform_plan

    command = shlex.join([Path(sys.executable).name, "benchmarks/data_prefetch.py", *sys.argv[1:]])
    graph = capture_model_file(str(GPT), model_args(a), a.micro_batch)
    with tempfile.TemporaryDirectory() as d:
        plan_path = Path(d) / "plan.json"
        save_plan(uniform_plan(model=ModelRef(str(GPT), model_args(a), "gpt", graph.fingerprint),
                               num_layers=len(graph.layers), dp=a.ranks, micro_batch=a.micro_batch), plan_path)
        data = Path(d) / "train.bin"
        np.random.default_rng(0).integers(0, a.vocab, a.tokens).astype("<u2").tofile(data)
        spec, out = Path(d) / "spec.json", Path(d) / "out.json"
        spec.write_text(json.dumps({"plan": str(plan_path), "rounds": a.rounds, "steps_per_round": a.steps_per_round,
                                    "warmup": a.warmup_steps, "out": str(out), "data": str(data),
                                    "shuffle": a.shuffle}))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(a.ranks), "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{free_port()}", str(Path(__file__).resolve()), "--worker", str(spec)]
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        rc = subprocess.call(cmd, env=env, stdout=subprocess.DEVNULL)
        if rc:
            print(f"torchrun failed with exit code {rc}", file=sys.stderr)
            return rc
        res = summarize(json.loads(out.read_text()))
    print(f"command: OMP_NUM_THREADS={env['OMP_NUM_THREADS']} {command}")
    print(f"model: gpt {model_args(a)}, DDP over {a.ranks} rank(s) ({'CUDA/NCCL' if _cuda() else 'CPU/gloo'}), "
          f"global batch {a.ranks * a.micro_batch}; token file of {a.tokens} uint16 ids, --shuffle {a.shuffle}; {a.warmup_steps} warm-up "
          f"steps, then {a.rounds} rounds x {a.steps_per_round} steps of each trainer, alternating step by step "
          f"(DS pairs, then SD pairs)")
    print(f"{'round':>5} {'order':>5} {'data_s':>10} {'synth_s':>10} {'ratio':>7}")
    for i, r in enumerate(res["rounds"]):
        print(f"{i:>5} {r['order']:>5} {r['data_s']:>10.4f} {r['synthetic_s']:>10.4f} {r['ratio']:>7.3f}")
    print(f"step time (median of all timed steps): --data {res['data_median_s']:.4f} s, "
          f"synthetic {res['synthetic_median_s']:.4f} s")
    verdict = "meets" if res["pair_ratio"] <= TARGET_RATIO else "misses"
    print(f"ratio --data / synthetic: median of {res['pairs']} adjacent step pairs {res['pair_ratio']:.3f}; "
          f"target <= {TARGET_RATIO}: {verdict}")
    print(f"(median of the per-round ratios {res['median_ratio']:.3f}, min {res['min_ratio']:.3f}, "
          f"max {res['max_ratio']:.3f})")
    return 0


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())
