#!/usr/bin/env python3
"""Builds the tokenization benchmark corpus from text already on this machine, and trains the
benchmark's BPE tokenizer on a slice of it.

One document per source file, UTF-8 only, de-duplicated by content, files over 16 MB left out,
shuffled with a fixed seed, written as JSONL {"text": ...} until --mb megabytes of text. Three
kinds of corpus (--kind):
- mixed (the bench corpus): Rust crate sources, Rust toolchain docs and library sources, Python
  sources, Debian package docs;
- docs: HTML and Markdown documentation (the Rust toolchains' HTML books and API pages, the
  Markdown of crates and of Go), long documents among them;
- code: source code in several languages (Rust, Go, C and C headers, Python, assembly, shell).

usage: make_corpus.py OUTDIR [--kind mixed|docs|code] [--mb 520] [--vocab 32000] [--pretokenizer gpt2|llama3]
writes OUTDIR/corpus.jsonl, OUTDIR/tokenizer/{tokenizer.json,tokenizer_config.json}, OUTDIR/corpus.json
"""
import argparse
import glob
import gzip
import hashlib
import json
import os
import random
import time

EXTS = ('.rs', '.md', '.toml', '.txt', '.py', '.c', '.h', '.html', '.rst', '.json', '.yml', '.yaml', '.sh')
MAX_FILE = 16 << 20
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")


KINDS = {
    'mixed': EXTS,
    'docs': ('.html', '.htm', '.md', '.markdown'),
    'code': ('.rs', '.go', '.c', '.h', '.py', '.s', '.S', '.sh'),
}


def roots(kind='mixed'):
    home = os.path.expanduser('~')
    cargo = os.path.join(home, '.cargo/registry/src')
    docs = sorted(glob.glob(os.path.join(home, '.rustup/toolchains/*/share/doc')))
    rust_src = sorted(glob.glob(os.path.join(home, '.rustup/toolchains/*/lib/rustlib/src')))
    python = sorted(glob.glob('/usr/lib/python3*'))
    go = [os.path.join(os.environ.get('GOROOT', '/usr/local/go'), 'src')]
    if kind == 'docs':
        out = docs + [cargo, os.path.dirname(go[0]), '/usr/share/doc']
    elif kind == 'code':
        out = [cargo] + rust_src + go + ['/usr/include'] + python
    else:
        out = [cargo] + docs + rust_src + python + ['/usr/share/doc']
    return [r for r in out if os.path.isdir(r)]


def candidates(kind='mixed'):
    exts, files = KINDS[kind], []
    for root in roots(kind):
        for dirpath, _, names in os.walk(root):
            for n in names:
                plain = kind == 'mixed' and (n.endswith('.gz') or n in ('copyright', 'README', 'changelog'))
                if n.endswith(exts) or plain:
                    files.append(os.path.join(dirpath, n))
    files.sort()
    return files


def read_text(path):
    try:
        if os.path.getsize(path) > MAX_FILE or os.path.islink(path):
            return None
        opener = gzip.open if path.endswith('.gz') else open
        with opener(path, 'rb') as f:
            data = f.read(MAX_FILE + 1)
        if len(data) > MAX_FILE or len(data) < 64 or b'\x00' in data:
            return None
        return data.decode('utf-8')
    except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
        return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('outdir')
    ap.add_argument('--kind', choices=sorted(KINDS), default='mixed')
    ap.add_argument('--mb', type=int, default=520)
    ap.add_argument('--vocab', type=int, default=32000)
    ap.add_argument('--pretokenizer', choices=['gpt2', 'llama3'], default='gpt2',
                    help="GPT-2's ByteLevel regex, or Llama-3's Split pattern before ByteLevel")
    a = ap.parse_args()
    os.makedirs(a.outdir, exist_ok=True)
    t0 = time.time()
    files = candidates(a.kind)
    random.Random(0).shuffle(files)
    seen, total, docs, sample, sample_bytes = set(), 0, 0, [], 0
    with open(os.path.join(a.outdir, 'corpus.jsonl'), 'w', encoding='utf-8') as out:
        for path in files:
            text = read_text(path)
            if text is None:
                continue
            h = hashlib.blake2b(text.encode('utf-8'), digest_size=16).digest()
            if h in seen:
                continue
            seen.add(h)
            out.write(json.dumps({'text': text}, ensure_ascii=False) + '\n')
            n = len(text.encode('utf-8'))
            total += n
            docs += 1
            if sample_bytes < 20e6 and docs % 10 == 0:
                sample.append(text)
                sample_bytes += n
            if total >= a.mb * 1e6:
                break
    print(f'corpus: {docs} documents, {total} bytes of text in {time.time() - t0:.0f}s')

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    if a.pretokenizer == 'gpt2':
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3), behavior='isolated'),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=a.vocab, min_frequency=2, special_tokens=['<|endoftext|>'],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    t1 = time.time()
    tok.train_from_iterator(sample, trainer)
    tokdir = os.path.join(a.outdir, 'tokenizer')
    os.makedirs(tokdir, exist_ok=True)
    tok.save(os.path.join(tokdir, 'tokenizer.json'))
    with open(os.path.join(tokdir, 'tokenizer_config.json'), 'w') as f:
        json.dump({'tokenizer_class': 'PreTrainedTokenizerFast', 'eos_token': '<|endoftext|>'}, f)
    print(f'tokenizer: vocab {tok.get_vocab_size()} trained on {sample_bytes} bytes in {time.time() - t1:.0f}s')
    with open(os.path.join(a.outdir, 'corpus.json'), 'w') as f:
        json.dump({'documents': docs, 'text_bytes': total, 'sample_bytes': sample_bytes,
                   'vocab': tok.get_vocab_size(), 'kind': a.kind, 'roots': roots(a.kind)}, f, indent=1)


if __name__ == '__main__':
    main()
