"""Token files (runtime/token_data.py, runtime/batches.py, runtime/data_check.py) in one process:
each rank's rows against the tests' own reading of the documented rule (tests/token_reference.py),
the refusals of bad data by ``autopar run`` before torchrun starts and by the ranks' check,
the checkpoint's data record, ``val_losses`` in measured.json, and the model-file ``batches()``
example.  Multi-rank training on token files: tests/integration/test_runtime_data.py."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import token_reference as ref_tokens  # noqa: E402
from cli_inprocess import run_cli  # noqa: E402
from runtime_support import GLOBAL_BATCH, MODEL_ARGS, ROOT, make_plan  # noqa: E402

SEQ = MODEL_ARGS["seq"]
VOCAB = MODEL_ARGS["vocab"]


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    """A dp 2 plan of the test GPT (global batch 4, seq 16, vocab 64)."""
    return make_plan(tmp_path_factory.mktemp("tokplan") / "plan.json", dp=2, micro_batch=2)


def _tokens(path: Path, n_tokens: int, seed: int = 0, high: int = VOCAB, dtype: str = "uint16") -> Path:
    return ref_tokens.write_tokens(path, np.random.default_rng(seed).integers(0, high, n_tokens), dtype)


# ------------------------------------------------------------------ the sample rule, per rank

@pytest.mark.parametrize("shuffle", [None, 11])
@pytest.mark.parametrize("prefetch", [True, False])
def test_each_rank_reads_its_rows_of_the_documented_global_batch(tmp_path, shuffle, prefetch):
    from autopar.runtime.batches import TokenBatches
    from autopar.runtime.token_data import TokenFile

    path = _tokens(tmp_path / "t.bin", 7 * SEQ + 1 + 3)          # 7 samples: 6 steps of 4 rows, 4 passes
    rows = GLOBAL_BATCH // 2
    ranks = [TokenBatches(TokenFile(path), SEQ, GLOBAL_BATCH, d, rows, torch.device("cpu"), shuffle=shuffle,
                          prefetch=prefetch) for d in range(2)]
    try:
        for step in range(6):
            (x, ), y = ref_tokens.global_batch(path, SEQ, GLOBAL_BATCH, step, shuffle)
            got = [r.get(step) for r in ranks]
            assert torch.equal(torch.cat([g[0][0] for g in got]), x), step
            assert torch.equal(torch.cat([g[1] for g in got]), y), step
            assert got[0][0][0].dtype == torch.int64 and got[0][0][0].shape == (rows, SEQ)
    finally:
        for r in ranks:
            r.close()


def test_a_resumed_reader_starts_at_its_step_and_pipeline_ranks_read_only_their_part(tmp_path):
    from autopar.runtime.batches import TokenBatches
    from autopar.runtime.token_data import TokenFile

    path = _tokens(tmp_path / "t.bin", 9 * SEQ + 1)
    first = TokenBatches(TokenFile(path), SEQ, GLOBAL_BATCH, 0, 4, torch.device("cpu"), shuffle=3, targets=False)
    last = TokenBatches(TokenFile(path), SEQ, GLOBAL_BATCH, 0, 4, torch.device("cpu"), shuffle=3, inputs=False)
    try:
        (x,), y = ref_tokens.global_batch(path, SEQ, GLOBAL_BATCH, 5, 3)
        inputs, target = first.get(5)
        assert torch.equal(inputs[0], x) and target is None
        inputs, target = last.get(5)
        assert inputs == () and torch.equal(target, y)
    finally:
        first.close()
        last.close()


def test_every_pass_is_a_permutation_of_all_samples():
    from autopar.runtime.token_data import sample_ids

    n, b = 10, 4
    ids = np.concatenate([sample_ids(t, range(b), b, n, 5) for t in range(10)])   # 40 positions: 4 passes
    passes = [sorted(ids[p * n:(p + 1) * n].tolist()) for p in range(4)]
    assert all(p == list(range(n)) for p in passes)
    assert ids[:n].tolist() != ids[n:2 * n].tolist()                # a new order each pass


# ------------------------------------------------------------------ bad data: autopar run refuses before torchrun

def _refused(out, *needles):
    assert out.returncode == 2, out.stdout + out.stderr
    flat = "".join(out.stderr.split())
    for n in needles:
        assert "".join(n.split()) in flat, (n, out.stderr)
    assert "torch.distributed.run" not in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("case", ["missing", "odd_bytes", "too_short", "id_over_vocab", "val_id_over_vocab"])
def test_bad_data_is_refused_before_torchrun_with_nothing_written(tmp_path, plan, case):
    good = _tokens(tmp_path / "good.bin", 4 * SEQ + 1)
    data, extra, needles = good, [], []
    if case == "missing":
        data, needles = tmp_path / "absent.bin", ["--data", "absent.bin", "no such file"]
    elif case == "odd_bytes":
        data = tmp_path / "odd.bin"
        data.write_bytes(good.read_bytes() + b"\x01")
        needles = ["--data", "odd.bin", "not a whole number of uint16 token ids"]
    elif case == "too_short":
        data = _tokens(tmp_path / "short.bin", 4 * SEQ)                # 3 samples: one short of a batch
        needles = ["3 sample(s)", "fewer than one global batch of 4", "--global-batch"]
    elif case == "id_over_vocab":
        ids = np.random.default_rng(1).integers(0, VOCAB, 6 * SEQ + 1)
        ids[37] = VOCAB + 5
        data = ref_tokens.write_tokens(tmp_path / "big_ids.bin", ids)
        needles = ["token 37 is id 69", f"vocabulary has {VOCAB} ids"]
    else:
        bad = ref_tokens.write_tokens(tmp_path / "val.bin", np.full(4 * SEQ + 1, 300))
        extra, needles = ["--val-data", bad, "--eval-every", "2"], ["--val-data", "id 300"]
    ckpt, measured = tmp_path / "ckpt", tmp_path / "m.json"
    out = run_cli("run", plan, "--steps", 2, "--data", data, *extra, "--checkpoint-dir", ckpt, "--measured", measured)
    _refused(out, *needles)
    assert not ckpt.exists() and not measured.exists()


def test_data_flags_that_disagree_are_refused(tmp_path, plan):
    good = _tokens(tmp_path / "good.bin", 4 * SEQ + 1)
    _refused(run_cli("run", plan, "--val-data", good), "--eval-every")
    _refused(run_cli("run", plan, "--data", good, "--shuffle", 3, "--eval-every", 2), "--val-data")
    _refused(run_cli("run", plan, "--shuffle", 3), "--data")


def test_a_uint32_file_read_as_uint16_suggests_the_dtype(tmp_path, plan):
    data = tmp_path / "u32.bin"
    data.write_bytes(np.arange(4 * SEQ + 1, dtype="<u4").tobytes()[:-2])   # 2 bytes short of a whole uint32
    ok = _tokens(tmp_path / "u32ok.bin", 4 * SEQ + 3, dtype="uint32")
    _refused(run_cli("run", plan, "--data", data, "--data-dtype", "uint32"), "uint32 token ids", "--data-dtype uint16")
    from autopar.runtime.token_data import TokenFile

    f = TokenFile(ok, "uint32")
    f.check_file()
    f.check_for_plan(SEQ, GLOBAL_BATCH, VOCAB)
    assert f.num_samples(SEQ) == 4


def test_the_ranks_check_refuses_an_id_over_the_vocabulary(tmp_path):
    """The ranks' own check (train.check_data_on_ranks): rank 0 scans and every rank raises its verdict."""
    import tempfile

    import torch.distributed as dist

    from autopar.runtime.options import RunOptions
    from autopar.runtime.plan_check import check_plan
    from autopar.runtime.token_data import DataFileError
    from autopar.runtime.train import check_data_on_ranks

    one = make_plan(tmp_path / "one.json", micro_batch=4)
    checked = check_plan(one, 1)
    ids = np.zeros(5 * SEQ + 1, dtype=np.int64)
    ids[-1] = VOCAB
    data = ref_tokens.write_tokens(tmp_path / "t.bin", ids)
    ctx = type("Ctx", (), {"rank": 0})()
    dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(dir=tmp_path), 1), rank=0, world_size=1)
    try:
        with pytest.raises(DataFileError, match=f"token {5 * SEQ} is id {VOCAB}") as e:
            check_data_on_ranks(RunOptions(plan_path=one, data_path=data), checked, ctx)
        assert e.value.exit_code == 2
        ids[-1] = VOCAB - 1
        ref_tokens.write_tokens(data, ids)
        check_data_on_ranks(RunOptions(plan_path=one, data_path=data), checked, ctx)
    finally:
        dist.destroy_process_group()


def test_vocabulary_is_the_token_embedding_or_the_model_files_vocab_size(tmp_path):
    from autopar.runtime.data_check import model_vocab
    from autopar.runtime.plan_check import check_plan

    checked = check_plan(make_plan(tmp_path / "p.json", micro_batch=4), 1)
    assert model_vocab(checked) == VOCAB             # tok_emb (vocab 64), not the position embedding (seq 16)
    module = checked.model_file.module
    try:
        module.vocab_size = 40                       # a model file's own declaration wins
        assert model_vocab(checked) == 40
        module.vocab_size = lambda vocab=None, **_: vocab - 24     # or a function of the model args
        assert model_vocab(checked) == 40
    finally:
        del module.vocab_size


# ------------------------------------------------------------------ resume, measured.json

def test_a_resume_on_other_data_is_refused(tmp_path):
    from autopar.runtime.checkpointing import CheckpointError
    from autopar.runtime.options import RunOptions
    from autopar.runtime.train import check_data_record

    f = {"path": "/d/train.bin", "bytes": 1000, "dtype": "uint16"}
    saved = {"source": "tokens", "file": f, "shuffle_seed": 3, "step": 4}
    opts = RunOptions(plan_path=tmp_path / "p.json")
    check_data_record(saved, {**saved, "step": 9}, tmp_path, opts)          # the same data: resumed
    check_data_record(None, {"source": "make_batch"}, tmp_path, opts)       # an older checkpoint: not checked
    for now in ({**saved, "file": {**f, "bytes": 998}}, {**saved, "shuffle_seed": None},
                {"source": "make_batch", "step": 4}):
        with pytest.raises(CheckpointError, match="would not read the batches an uninterrupted run reads") as e:
            check_data_record(saved, now, tmp_path, opts)
        assert e.value.exit_code == 2 and "--checkpoint-dir" in str(e.value)


def test_measured_val_losses_round_trip_and_older_files_load():
    from autopar.core.measured import Measured, MeasuredFileError

    m = Measured(step_time_s=0.1, val_losses=((2, 4.5), (4, 4.25)))
    back = Measured.from_json(json.loads(m.to_json_text()))
    assert back.val_losses == ((2, 4.5), (4, 4.25)) and json.loads(m.to_json_text())["val_losses"] == [[2, 4.5],
                                                                                                      [4, 4.25]]
    assert Measured.from_json({"step_time_s": 0.1}).val_losses is None
    with pytest.raises(MeasuredFileError, match="val_losses"):
        Measured.from_json({"step_time_s": 0.1, "val_losses": [[2]]})


# ------------------------------------------------------------------ other data: the model file's batches()

def _jsonl(path: Path) -> Path:
    texts = [f"sample {i}: the quick brown fox jumps over the lazy dog {i * 7}" for i in range(12)]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_model_file_batches_example_yields_each_ranks_rows_from_its_start_step(tmp_path, tokenizer):
    from autopar.core.modelfile import load_model_file
    from autopar.examples import make_tokens

    data = _jsonl(tmp_path / "texts.jsonl")
    args = {"data": str(data), "seq": 8}
    if tokenizer == "bpe":
        pytest.importorskip("tokenizers")
        text = tmp_path / "all.txt"
        text.write_text("\n".join(json.loads(l)["text"] for l in data.read_text().splitlines()))
        assert make_tokens.main([str(text), "--out", str(tmp_path / "t.bin"), "--bpe", "300",
                                 "--tokenizer-out", str(tmp_path / "tok.json")]) == 0
        args["tokenizer"] = str(tmp_path / "tok.json")
    mf = load_model_file(ROOT / "examples" / "text_lm.py")
    vocab = mf.vocab_size(**args)
    assert vocab == (256 if tokenizer == "bytes" else 300)
    whole = mf.batches(4, 0, 1, 5, 0, **args)
    steps = [next(whole) for _ in range(6)]                       # one rank holding the global batch
    for d in range(2):                                            # two ranks, started at step 3
        rank = mf.batches(2, d, 2, 5, 3, **args)
        for t in range(3, 6):
            inputs, target = next(rank)
            assert torch.equal(inputs[0], steps[t][0][0][2 * d:2 * d + 2])
            assert torch.equal(target, steps[t][1][2 * d:2 * d + 2])
    assert int(steps[0][0][0].max()) < vocab and torch.equal(steps[0][0][0][:, 1:], steps[0][1][:, :-1])


def test_make_tokens_writes_a_byte_level_token_file(tmp_path):
    from autopar.examples import make_tokens

    text = tmp_path / "in.txt"
    text.write_text("héllo world\n" * 50)
    assert make_tokens.main([str(text), "--out", str(tmp_path / "train.bin"), "--val-out", str(tmp_path / "v.bin")]) == 0
    raw = text.read_bytes()
    got = np.concatenate([np.fromfile(tmp_path / "train.bin", "<u2"), np.fromfile(tmp_path / "v.bin", "<u2")])
    assert got.tolist() == list(raw)
