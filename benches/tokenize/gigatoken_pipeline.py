#!/usr/bin/env python3
"""Baseline (c) of the tokenization benchmark: gigatoken (PyPI), the engine behind Megatron-LM's
`preprocess_data_fast.py --use-gigatoken`. Reads the JSONL corpus with gigatoken's own file
source, encodes it on gigatoken's thread pool (RAYON_NUM_THREADS), appends the EOD id to every
document and writes a Megatron indexed dataset (.bin/.idx) with numpy.

usage: gigatoken_pipeline.py CORPUS.jsonl TOKENIZER.json OUT_PREFIX
"""
import argparse
import json
import struct
import time

import gigatoken
import numpy as np


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('corpus')
    ap.add_argument('tokenizer')
    ap.add_argument('prefix')
    a = ap.parse_args()
    t0 = time.perf_counter()
    tok = gigatoken.Tokenizer(a.tokenizer)
    eod = json.load(open(a.tokenizer))['added_tokens'][0]
    assert eod['content'] == '<|endoftext|>', eod
    docs = tok.encode_files(gigatoken.JsonlFileSource([a.corpus], field='text')).layout
    offsets = np.asarray(docs.offsets.data, dtype=np.int64)
    content = np.asarray(docs.content.data)
    n = len(offsets) - 1
    dtype = np.uint16 if tok.vocab_size < 65500 else np.int32
    # each document's ids, then its EOD
    out = np.empty(len(content) + n, dtype=dtype)
    eod_at = offsets[1:] + np.arange(n)
    keep = np.ones(len(out), dtype=bool)
    keep[eod_at] = False
    out[keep] = content
    out[eod_at] = eod['id']
    out.tofile(a.prefix + '.bin')
    lens = (np.diff(offsets) + 1).astype(np.int32)
    pointers = np.concatenate([[0], np.cumsum(lens.astype(np.int64) * np.dtype(dtype).itemsize)[:-1]])
    with open(a.prefix + '.idx', 'wb') as idx:
        idx.write(b'MMIDIDX\x00\x00' + struct.pack('<Q', 1) + struct.pack('<B', 8 if dtype == np.uint16 else 4))
        idx.write(struct.pack('<Q', n) + struct.pack('<Q', n + 1))
        idx.write(lens.tobytes() + pointers.astype(np.int64).tobytes() + np.arange(n + 1, dtype=np.int64).tobytes())
    print(json.dumps({'documents': n, 'tokens': int(lens.sum()), 'seconds': round(time.perf_counter() - t0, 2)}))


if __name__ == '__main__':
    main()
