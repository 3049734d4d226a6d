"""The whole job -- ``--init-from``, ``--data``, a warm-up + cosine schedule, clipping, and
``autopar export`` -- against a plain PyTorch loop.

Every case starts from weights on disk, trains on a token file (half of them with
``--shuffle``) under a warm-up + cosine learning-rate schedule with a gradient clip that bites
at every step, and is exported; the plain loop is given the same weights, the test's own
reading of the token file (tests/token_reference.py), the schedule's closed form written here
and ``torch.nn.utils.clip_grad_norm_``.

One 2-rank launch (tests/runtime_worker.py) trains, from weights written to disk, a tied
transformers model (zoo's Qwen2, ``tie_word_embeddings``) under dp 2, ZeRO-3, CPU offload,
tp 2 and pp 2, transformers' GPT-2 (fused q/k/v ``c_attn`` split per part) under tp 2,
Mixtral under expert parallelism (ep 2, ZeRO-3), Llama under context parallelism (cp 2), and a
plain ``nn.Module`` with a tied head (zoo's tied_lm) under ZeRO-3 and pp 2.  The weights come
as a ``save_pretrained`` folder (tied keys absent), a folder sharded with an index, a torch
state dict and a single safetensors file.  Each run's losses must equal ``train_plain`` started
from the same values read here with safetensors / torch directly (1e-5), and its checkpoint,
exported with ``autopar export``, must load with ``from_pretrained`` (transformers) or
``load_state_dict`` (the plain module) holding the plain loop's final weights (1e-5).

The bad inputs (weights of another model, wrong shapes, a truncated safetensors file, a
missing file; export's non-checkpoint folder, an existing or input OUT) each exit 2 with one
paragraph before anything runs or is written.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

import plain_loop
from cli_inprocess import run_cli
from runtime_support import NOISE_GRAD, failure_summary, run_cases
from test_zoo_parity import GLOBAL_BATCH, OFFLOAD, PP, TP, ZERO3, ZOO, _plan

STEPS = 4
ATOL = 1e-5
SEQ, VOCAB = 8, 64            # the zoo models' sequence length and vocabulary
LR, MIN_LR, WARMUP = plain_loop.LR, 1e-4, 2
CLIP = 0.05                   # below every step's gradient norm (checked on the plain loop)
SEED = 7                      # the saved weights' own seed, not the runtime's default init seed
DDP = dict(dp=2, micro_batch=2)


def _build(name: str):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        return plain_loop.load(ZOO / f"{name}.py").build_model()


def _write_weights(tmp: Path) -> dict[str, Path]:
    """The weights files the cases start from."""
    from safetensors.torch import save_file

    qwen, gpt2, tied = _build("hf_qwen2"), _build("hf_gpt2"), _build("tied_lm")
    _build("hf_llama").save_pretrained(tmp / "llama")
    # transformers 5 would write Mixtral's stacked experts per expert (its original layout)
    _build("hf_mixtral").save_pretrained(tmp / "mixtral", save_original_format=False)
    out = {"llama_folder": tmp / "llama", "mixtral_folder": tmp / "mixtral","qwen_folder": tmp / "qwen2", "qwen_sharded": tmp / "qwen2_sharded", "qwen_pt": tmp / "qwen2.pt",
           "gpt2_folder": tmp / "gpt2", "tied_file": tmp / "tied.safetensors", "tied_sharded": tmp / "tied_sharded"}
    qwen.save_pretrained(out["qwen_folder"])
    qwen.save_pretrained(out["qwen_sharded"], max_shard_size="30KB")
    assert (out["qwen_sharded"] / "model.safetensors.index.json").is_file()
    torch.save(qwen.state_dict(), out["qwen_pt"])                  # both tied names
    gpt2.save_pretrained(out["gpt2_folder"])
    state = {k: v.clone() for k, v in tied.state_dict().items() if k != "head.weight"}   # tie resolved on load
    save_file(state, out["tied_file"])
    out["tied_sharded"].mkdir()
    keys = sorted(state)
    halves = {"part-1.safetensors": keys[: len(keys) // 2], "part-2.safetensors": keys[len(keys) // 2:]}
    for name, part in halves.items():
        save_file({k: state[k] for k in part}, out["tied_sharded"] / name)
    (out["tied_sharded"] / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: n for n, part in halves.items() for k in part}}))
    return out


def _read_directly(path: Path) -> dict[str, torch.Tensor]:
    """The values of a weights file or folder, read without autopar."""
    from safetensors.torch import load_file

    if path.suffix == ".pt":
        return torch.load(path, weights_only=True)
    if path.is_file():
        return load_file(path)
    files = sorted(path.glob("*.safetensors"))
    return {k: v for f in files for k, v in load_file(f).items()}


def lr_at(step: int) -> float:
    """The issue's warm-up + cosine rule, written out (T = STEPS)."""
    import math

    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    return MIN_LR + (LR - MIN_LR) * 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / max(1, STEPS - WARMUP)))


def _shuffle(case: str) -> int | None:
    return 11 if CASES_BY_NAME[case][1] in ("hf_qwen2",) and case != "qwen_ddp" else None


# (case, zoo model, plan kind, plan kwargs, weights)
CASES = [("qwen_ddp", "hf_qwen2", "ddp", DDP, "qwen_folder"),
         ("qwen_zero3", "hf_qwen2", "zero3", ZERO3, "qwen_sharded"),
         ("qwen_offload", "hf_qwen2", "offload", OFFLOAD, "qwen_folder"),
         ("qwen_tp", "hf_qwen2", "tp", TP, "qwen_pt"),
         ("qwen_pp", "hf_qwen2", "pp", PP, "qwen_folder"),
         ("gpt2_tp", "hf_gpt2", "tp", TP, "gpt2_folder"),
         ("tied_zero3", "tied_lm", "zero3", ZERO3, "tied_file"),
         ("tied_pp", "tied_lm", "pp", PP, "tied_sharded"),
         # expert parallelism: the stacked experts Shard(0) over ep 2, ZeRO-3 over the rest
         ("mixtral_ep", "hf_mixtral", "ep", dict(dp=2, micro_batch=2, zero=3), "mixtral_folder"),
         # context parallelism: every rank holds whole parameters, a half of each sequence
         ("llama_cp", "hf_llama", "cp", dict(cp=2, micro_batch=2, num_microbatches=2), "llama_folder")]


CASES_BY_NAME = {c[0]: c for c in CASES}


def _case_plan(model: str, kind: str, kw: dict, path: Path) -> Path:
    if kind == "ep":
        from test_runtime_ep import ep_plan

        return ep_plan(model, kw, 2, path)
    return _plan(model, kind, kw, path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("transformers")
    tmp = tmp_path_factory.mktemp("weights_io")
    weights = _write_weights(tmp)
    import token_reference

    ids = torch.randint(0, VOCAB, (4001,), generator=torch.Generator().manual_seed(3))
    weights["tokens"] = token_reference.write_tokens(tmp / "train.bin", ids.numpy())
    cases = []
    for case, model, kind, kw, w in CASES:
        options = {"init_from": str(weights[w]), "data_path": str(weights["tokens"]), "lr_schedule": "cosine",
                   "lr_warmup": WARMUP, "min_lr": MIN_LR, "grad_clip": CLIP}
        if _shuffle(case) is not None:
            options["shuffle_seed"] = _shuffle(case)
        cases.append({"plan": str(_case_plan(model, kind, kw, tmp / f"{case}.json")), "steps": STEPS,
                      "measured": str(tmp / f"{case}.measured.json"), "checkpoint_dir": str(tmp / f"{case}_ck"),
                      "options": options})
    out = run_cases(2, cases, tmp, timeout_s=900)
    return tmp, weights, out


@functools.lru_cache(maxsize=None)
def _plain(model: str, weights_path: str, tokens: str, shuffle: int | None):
    import token_reference

    initial = _read_directly(Path(weights_path))
    ref = plain_loop.train_plain(ZOO / f"{model}.py", {}, GLOBAL_BATCH, STEPS, initial=initial,
                                 batches=token_reference.batches(Path(tokens), SEQ, GLOBAL_BATCH, shuffle),
                                 lr_at=lr_at, grad_clip=CLIP)
    assert min(ref.grad_norms) > CLIP, ("the clip must bite at every step", ref.grad_norms)
    return ref


def _assert_close(got: dict[str, torch.Tensor], ref, label: str) -> None:
    """Every parameter of the plain loop within ATOL (elements whose gradient is rounding noise:
    within the steps' AdamW bound, as runtime_support.assert_matches_reference)."""
    for name, want in ref.params.items():
        assert name in got, (label, name, sorted(got)[:5])
        diff = (got[name].float() - want).abs()
        noise = ref.grad_abs_max[name] < NOISE_GRAD
        err = diff[~noise].max().item() if (~noise).any() else 0.0
        assert err <= ATOL, f"{label}: {name} differs from the plain loop by {err:.3g}"
        if noise.any():
            assert diff[noise].max().item() <= STEPS * plain_loop.LR * 1.01, (label, name)


@pytest.mark.multiproc
@pytest.mark.parametrize("case,model,kind,kw,w", CASES, ids=[c[0] for c in CASES])
def test_init_from_and_export_match_plain_loop(runs, case, model, kind, kw, w):
    tmp, weights, out = runs
    measured = json.loads((tmp / f"{case}.measured.json").read_text())
    assert measured.get("init") == "init-from", measured.get("init")
    ref = _plain(model, str(weights[w]), str(weights["tokens"]), _shuffle(case))
    diff = max(abs(a - b) for a, b in zip(measured["losses"], ref.losses))
    assert len(measured["losses"]) == STEPS and diff <= ATOL, \
        f"{case}: losses {measured['losses']} vs plain loop {ref.losses}\n" + failure_summary(out.stdout)
    assert "no one-block slice" not in out.stdout     # rank 0 read only its blocks (runtime/parallelize.py's note)
    exported = tmp / f"{case}_export"
    # one case sharded as transformers shards a large model (an index and several files)
    shards = ("--max-shard-size", "30KB") if case == "qwen_zero3" else ()
    done = run_cli("export", tmp / f"{case}_ck", "-o", exported, *shards)
    assert done.returncode == 0, done.stderr
    assert (exported / "model.safetensors.index.json").is_file() == bool(shards), sorted(exported.iterdir())
    if model.startswith("hf_"):
        from transformers import AutoModelForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(exported)
        got = dict(loaded.named_parameters(remove_duplicate=False))
        assert (exported / "config.json").is_file()
    else:
        from safetensors.torch import load_file

        fresh = plain_loop.load(ZOO / f"{model}.py").build_model()
        state = load_file(exported / "model.safetensors")
        assert set(state) == set(fresh.state_dict()), sorted(set(state) ^ set(fresh.state_dict()))
        fresh.load_state_dict(state, strict=True)
        got = dict(fresh.named_parameters(remove_duplicate=False))
    _assert_close({k: v.detach() for k, v in got.items()}, ref, case)


@pytest.mark.multiproc
def test_export_refuses_bad_outputs_and_folders(runs, tmp_path):
    tmp, _, _ = runs
    ck = tmp / "tied_zero3_ck"
    cases = {"not a checkpoint": (tmp_path, tmp_path / "o1"),
             "OUT exists": (ck, tmp),
             "OUT inside the checkpoint": (ck, ck / "exported")}
    for label, (src, dst) in cases.items():
        before = sorted(p.name for p in dst.parent.iterdir()) if dst.parent.exists() else None
        r = run_cli("export", src, "-o", dst)
        assert r.returncode == 2, (label, r.stdout, r.stderr)
        assert r.stderr.startswith("autopar export: error:") and "Traceback" not in r.stderr, (label, r.stderr)
        after = sorted(p.name for p in dst.parent.iterdir()) if dst.parent.exists() else None
        assert before == after, (label, before, after)


@pytest.mark.multiproc
def test_export_of_an_old_or_damaged_checkpoint(runs, tmp_path):
    """A manifest without the model record (an older autopar's) needs --plan; a damaged shard is
    refused by its checksum before DCP reads anything."""
    import shutil

    tmp, _, _ = runs
    step = next((tmp / "tied_zero3_ck").glob("step_*"))
    old = tmp_path / "old" / step.name
    shutil.copytree(step, old)
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["model"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    r = run_cli("export", old, "-o", tmp_path / "a")
    assert r.returncode == 2 and "--plan" in r.stderr and not (tmp_path / "a").exists(), r.stderr
    r = run_cli("export", old, "-o", tmp_path / "b", "--plan", tmp / "tied_zero3.json")
    assert r.returncode == 0 and (tmp_path / "b" / "model.safetensors").is_file(), r.stderr
    shard = next(old.glob("*.distcp"))
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    r = run_cli("export", old, "-o", tmp_path / "c", "--plan", tmp / "tied_zero3.json")
    assert r.returncode == 2 and "checksum" in r.stderr and not (tmp_path / "c").exists(), r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "old"]


# ------------------------------------------------------------------ bad weights (one process)
@pytest.fixture(scope="module")
def tied_plan(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad_weights")
    return tmp, _plan("tied_lm", "ddp", DDP, tmp / "plan.json")


def _bad_weights(tmp: Path) -> dict[str, tuple[Path, str]]:
    """(weights, a fragment of the refusal) per bad case, for the zoo's tied_lm."""
    from safetensors.torch import save_file

    pytest.importorskip("transformers")
    _build("hf_llama").save_pretrained(tmp / "llama")
    wide = plain_loop.load(ZOO / "tied_lm.py").build_model(vocab=128)
    save_file({k: v for k, v in wide.state_dict().items() if k != "head.weight"}, tmp / "wide.safetensors")
    save_file({k: v for k, v in _build("tied_lm").state_dict().items() if k != "head.weight"}, tmp / "good.safetensors")
    raw = (tmp / "good.safetensors").read_bytes()
    (tmp / "truncated.safetensors").write_bytes(raw[: len(raw) - 100])
    return {"another model": (tmp / "llama", "not in it"), "wrong shapes": (tmp / "wide.safetensors", "shapes differ"),
            "truncated": (tmp / "truncated.safetensors", "truncated"), "missing": (tmp / "nope", "no such file")}


def test_bad_weights_exit_2_before_torchrun(tied_plan):
    tmp, plan = tied_plan
    for label, (weights, fragment) in _bad_weights(tmp).items():
        measured = tmp / f"{label}.json"
        r = run_cli("run", plan, "--steps", "1", "--init-from", weights, "--measured", measured,
                    "--checkpoint-dir", tmp / "ck")
        assert r.returncode == 2, (label, r.stdout, r.stderr)
        assert r.stderr.startswith("autopar run: error: --init-from"), (label, r.stderr)
        assert fragment in " ".join(r.stderr.split()) and "Traceback" not in r.stderr and "torch.distributed.run" not in r.stderr, \
            (label, r.stderr)
        assert not measured.exists() and not (tmp / "ck").exists(), label


def test_weights_of_another_model_are_refused_on_the_ranks_too(tied_plan):
    """The ranks' own check (materialize.choose_source) before anything is allocated."""
    from safetensors.torch import save_file

    from autopar.core.modelfile import load_model_file
    from autopar.runtime.materialize import build_meta_model, choose_source
    from autopar.runtime.weights_in import WeightsError

    tmp, _ = tied_plan
    save_file({"embed.weight": torch.zeros(64, 32), "other.weight": torch.zeros(3)}, tmp / "other.safetensors")
    mf = load_model_file(ZOO / "tied_lm.py")
    with pytest.raises(WeightsError, match="does not fit the model"):
        choose_source("auto", mf, {}, 0, build_meta_model(mf, {}), tmp / "other.safetensors")
