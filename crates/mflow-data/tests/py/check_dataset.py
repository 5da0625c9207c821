#!/usr/bin/env python3
"""Checks an mflow dataset directory with Megatron-Core's own reader.

Reads train/valid/test with megatron.core.datasets.indexed_dataset.IndexedDataset, re-reads the
source documents independently (by the rules documented for each input format), encodes them
with the Python `tokenizers` library and checks that every split holds, in corpus order, exactly
the expected token sequences followed by the EOD id, and that together the splits hold every
document once.

usage: check_dataset.py CONFIG.json   (written by the Rust test; keys below)
  dataset, tokenizer ("byte-level" or a tokenizer.json), add_special_tokens, max_doc_tokens,
  dtype, sources: [{path, format: jsonl|file|line|blank-line, text_key}]
Prints a JSON summary; exits non-zero with a message on any mismatch.
"""
import gzip
import json
import os
import sys

import numpy as np
from megatron.core.datasets.indexed_dataset import IndexedDataset


def fail(msg):
    print(f'MISMATCH: {msg}', file=sys.stderr)
    sys.exit(1)


def read_bytes(path):
    with open(path, 'rb') as f:
        head = f.read(4)
    if head[:2] == b'\x1f\x8b':
        with gzip.open(path, 'rb') as f:
            return f.read()
    if head == b'\x28\xb5\x2f\xfd':
        import subprocess
        return subprocess.run(['zstd', '-dc', path], check=True, capture_output=True).stdout
    with open(path, 'rb') as f:
        return f.read()


def lines_of(data):
    out = data.split(b'\n')
    if out and out[-1] == b'':
        out.pop()
    return [l[:-1] if l.endswith(b'\r') else l for l in out]


def documents(src):
    data = read_bytes(src['path'])
    fmt = src['format']
    docs = []
    if fmt == 'jsonl':
        for raw in lines_of(data):
            if not raw.strip():
                continue
            try:
                text = json.loads(raw.decode('utf-8'))[src.get('text_key', 'text')]
            except UnicodeDecodeError:
                continue
            if text:
                docs.append(text)
    elif fmt == 'file':
        if data:
            try:
                docs.append(data.decode('utf-8'))
            except UnicodeDecodeError:
                pass
    elif fmt == 'line':
        for raw in lines_of(data):
            if raw.strip():
                try:
                    docs.append(raw.decode('utf-8'))
                except UnicodeDecodeError:
                    pass
    elif fmt == 'blank-line':
        para = []
        for raw in lines_of(data) + [b'']:
            if raw.strip():
                para.append(raw)
            elif para:
                try:
                    docs.append(b'\n'.join(para).decode('utf-8'))
                except UnicodeDecodeError:
                    pass
                para = []
    else:
        fail(f'unknown format {fmt}')
    return docs


def main():
    cfg = json.load(open(sys.argv[1]))
    meta = json.load(open(os.path.join(cfg['dataset'], 'dataset.json')))
    if meta['format'] != 'mflow-dataset' or meta['version'] != 1:
        fail(f'dataset.json format/version: {meta}')
    eod = meta['eod_id']
    if cfg['tokenizer'] == 'byte-level':
        encode = lambda t: list(t.encode('utf-8'))
        if eod != 256 or meta['vocab_size'] != 257:
            fail(f'byte-level eod/vocab: {eod} {meta["vocab_size"]}')
    else:
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(cfg['tokenizer'])
        tok.no_truncation()
        tok.no_padding()
        copied = Tokenizer.from_file(os.path.join(cfg['dataset'], 'tokenizer.json'))
        if copied.to_str() != tok.to_str():
            fail('tokenizer.json copy differs from the tokenizer used')
        add = cfg['add_special_tokens']
        encode = lambda t: tok.encode(t, add_special_tokens=add).ids

    expected = []
    for src in cfg['sources']:
        for text in documents(src):
            ids = encode(text)
            if cfg.get('max_doc_tokens'):
                ids = ids[:cfg['max_doc_tokens']]
            expected.append(ids + [eod])

    want_dtype = np.dtype(cfg['dtype'])
    splits = {}
    for name in ('train', 'valid', 'test'):
        prefix = os.path.join(cfg['dataset'], name)
        if name not in meta['splits']:
            # an empty split has no files (Megatron cannot map an empty .bin)
            if os.path.exists(prefix + '.bin') or os.path.exists(prefix + '.idx'):
                fail(f'{name}: files exist but dataset.json does not list the split')
            continue
        ds = IndexedDataset(prefix, mmap=True)
        if ds.index.dtype != want_dtype or meta['dtype'] != cfg['dtype']:
            fail(f'{name}: dtype {ds.index.dtype} / dataset.json {meta["dtype"]}, want {want_dtype}')
        n = len(ds)
        if list(ds.document_indices) != list(range(n + 1)):
            fail(f'{name}: document_indices {list(ds.document_indices)[:10]}... are not 0..={n}')
        if meta['splits'][name]['documents'] != n:
            fail(f'{name}: dataset.json says {meta["splits"][name]["documents"]} documents, reader sees {n}')
        docs = [ds[i].tolist() for i in range(n)]
        if sum(map(len, docs)) != meta['splits'][name]['tokens']:
            fail(f'{name}: token count differs from dataset.json')
        for i, d in enumerate(docs):
            if not d or d[-1] != eod:
                fail(f'{name}[{i}] does not end with EOD {eod}')
        splits[name] = docs

    # every expected document, in order, is the next document of exactly one split
    pos = {k: 0 for k in splits}
    for j, want in enumerate(expected):
        for name, docs in splits.items():
            if pos[name] < len(docs) and docs[pos[name]] == want:
                pos[name] += 1
                break
        else:
            heads = {k: (v[pos[k]][:12] if pos[k] < len(v) else None) for k, v in splits.items()}
            fail(f'document {j} (expected {want[:12]}...) is not next in any split: {heads}')
    for name, docs in splits.items():
        if pos[name] != len(docs):
            fail(f'{name} holds {len(docs) - pos[name]} unexpected extra documents')
    print(json.dumps({'documents': len(expected), 'tokens': sum(map(len, expected)),
                      'splits': {k: len(v) for k, v in splits.items()}, 'eod': eod}))


if __name__ == '__main__':
    main()
