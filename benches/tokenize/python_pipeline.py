#!/usr/bin/env python3
"""Baseline (b) of the tokenization benchmark: the straightforward Python pipeline. Reads the
JSONL corpus, encodes batches with the `tokenizers` library's encode_batch (its own Rust
threads), appends the EOD id and writes a Megatron indexed dataset (.bin/.idx) with numpy.

usage: python_pipeline.py CORPUS.jsonl TOKENIZER.json OUT_PREFIX [--batch 1000] [--fast]
"""
import argparse
import json
import struct
import time

import numpy as np
from tokenizers import Tokenizer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('corpus')
    ap.add_argument('tokenizer')
    ap.add_argument('prefix')
    ap.add_argument('--batch', type=int, default=1000)
    ap.add_argument('--fast', action='store_true', help='encode_batch_fast (no offsets)')
    a = ap.parse_args()
    t0 = time.perf_counter()
    tok = Tokenizer.from_file(a.tokenizer)
    eod = tok.token_to_id('<|endoftext|>')
    encode = tok.encode_batch_fast if a.fast else tok.encode_batch
    dtype = np.uint16 if tok.get_vocab_size() < 65500 else np.int32
    lengths = []
    with open(a.corpus, 'rb') as f, open(a.prefix + '.bin', 'wb') as out:
        batch = []

        def flush():
            for e in encode(batch, add_special_tokens=True):
                ids = np.array(e.ids + [eod], dtype=dtype)
                out.write(ids.tobytes())
                lengths.append(ids.size)
            batch.clear()

        for line in f:
            text = json.loads(line)['text']
            batch.append(text)
            if len(batch) == a.batch:
                flush()
        if batch:
            flush()
    lens = np.array(lengths, dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(lens.astype(np.int64) * np.dtype(dtype).itemsize)[:-1]])
    with open(a.prefix + '.idx', 'wb') as idx:
        idx.write(b'MMIDIDX\x00\x00' + struct.pack('<Q', 1) + struct.pack('<B', 8 if dtype == np.uint16 else 4))
        idx.write(struct.pack('<Q', len(lens)) + struct.pack('<Q', len(lens) + 1))
        idx.write(lens.tobytes() + pointers.astype(np.int64).tobytes() + np.arange(len(lens) + 1, dtype=np.int64).tobytes())
    secs = time.perf_counter() - t0
    print(json.dumps({'documents': len(lens), 'tokens': int(lens.sum()), 'seconds': round(secs, 2)}))


if __name__ == '__main__':
    main()
