"""Make token files for ``autopar run --data`` from a text file, offline.

    python -m autopar.examples.make_tokens input.txt --out train.bin --val-out val.bin
    python -m autopar.examples.make_tokens input.txt --out train.bin --bpe 4096 --tokenizer-out tok.json

Without ``--bpe`` the ids are the text's UTF-8 bytes (a byte-level vocabulary of 256: build
the model with vocab >= 256).  With ``--bpe V`` a byte-level BPE tokenizer of ``V`` ids is
trained on the text with Hugging Face ``tokenizers`` (GPT-2's scheme, Radford et al. 2019,
Sec. 2.2) and saved with ``--tokenizer-out``; ``--tokenizer tok.json`` encodes with one
trained before.  The ids are written as a flat little-endian ``uint16`` array (``uint32``
when the vocabulary exceeds 65536: pass ``--data-dtype uint32`` then), nanoGPT's format.
``--val-fraction`` (default 0.1) of the tokens, from the end, go to ``--val-out``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

BYTE_VOCAB = 256


def encode(text: str, tokenizer=None) -> np.ndarray:
    if tokenizer is None:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
    return np.asarray(tokenizer.encode(text).ids, dtype=np.int64)


def train_bpe(files: list[str], vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(files, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def write_ids(ids: np.ndarray, path: Path, vocab: int) -> str:
    dtype = "uint16" if vocab <= 1 << 16 else "uint32"
    ids.astype("<u2" if dtype == "uint16" else "<u4").tofile(path)
    return dtype


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="make_tokens", description=__doc__.splitlines()[0])
    p.add_argument("text", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--val-out", type=Path, default=None)
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--bpe", type=int, default=None, metavar="V", help="train a byte-level BPE of V ids")
    p.add_argument("--tokenizer", type=Path, default=None, help="a tokenizers JSON file to encode with")
    p.add_argument("--tokenizer-out", type=Path, default=None, help="where to save the trained BPE")
    a = p.parse_args(argv)
    tokenizer = None
    if a.tokenizer is not None:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(a.tokenizer))
    elif a.bpe is not None:
        tokenizer = train_bpe([str(a.text)], a.bpe)
        if a.tokenizer_out is not None:
            tokenizer.save(str(a.tokenizer_out))
    vocab = tokenizer.get_vocab_size() if tokenizer is not None else BYTE_VOCAB
    ids = encode(a.text.read_text(encoding="utf-8"), tokenizer)
    cut = len(ids) - int(len(ids) * a.val_fraction) if a.val_out is not None else len(ids)
    dtype = write_ids(ids[:cut], a.out, vocab)
    if a.val_out is not None:
        write_ids(ids[cut:], a.val_out, vocab)
    print(f"{a.out}: {cut} tokens ({dtype}, vocabulary {vocab})"
          + (f"; {a.val_out}: {len(ids) - cut} tokens" if a.val_out is not None else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
