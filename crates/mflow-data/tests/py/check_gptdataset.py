#!/usr/bin/env python3
"""Builds Megatron-Core GPTDataset training samples from an mflow dataset's train split, on CPU:
BlendedMegatronDatasetBuilder + GPTDatasetConfig(blend=[prefix]) with Megatron's own Hugging Face
tokenizer wrapper, then checks that samples have the right shapes and come from the .bin.

usage: check_gptdataset.py DATASET_DIR TOKENIZER_DIR CACHE_DIR
"""
import json
import os
import sys

import numpy as np
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.tokenizers import MegatronTokenizer

SEQ = 32


def main():
    dataset, tokdir, cache = sys.argv[1:4]
    meta = json.load(open(os.path.join(dataset, 'dataset.json')))
    tokenizer = MegatronTokenizer.from_pretrained(tokenizer_path=tokdir, metadata_path={'library': 'huggingface'})
    if tokenizer.eod != meta['eod_id']:
        sys.exit(f"Megatron's tokenizer says EOD {tokenizer.eod}, dataset.json {meta['eod_id']}")
    config = GPTDatasetConfig(
        random_seed=1234, sequence_length=SEQ, blend=([os.path.join(dataset, 'train')], None), split='100,0,0',
        reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True, tokenizer=tokenizer,
        path_to_cache=cache, mid_level_dataset_surplus=0.005)
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, [40, None, None], lambda: True, config).build()
    if train is None or len(train) < 40:
        sys.exit(f'GPTDataset built {0 if train is None else len(train)} samples, wanted 40')
    stream = np.memmap(os.path.join(dataset, 'train.bin'), dtype=np.dtype(meta['dtype']), mode='r')
    text = stream.tobytes()
    for i in range(len(train)):
        s = train[i]
        tokens, labels = s['tokens'].numpy(), s['labels'].numpy()
        if tokens.shape != (SEQ,) or labels.shape != (SEQ,) or s['loss_mask'].shape != (SEQ,):
            sys.exit(f'sample {i}: shapes {tokens.shape} {labels.shape}')
        if not np.array_equal(tokens[1:], labels[:-1]):
            sys.exit(f'sample {i}: labels are not tokens shifted by one')
        # samples concatenate shuffled documents; every piece between EODs is contiguous in train.bin
        window = np.concatenate([tokens, labels[-1:]]).astype(stream.dtype)
        cuts = np.flatnonzero(window == meta['eod_id']) + 1
        for piece in np.split(window, cuts):
            if piece.size and piece.tobytes() not in text:
                sys.exit(f'sample {i}: a piece of {piece.size} tokens is not in train.bin')
        eod_at = tokens == meta['eod_id']
        if eod_at.any() and s['loss_mask'].numpy()[eod_at].any():
            sys.exit(f'sample {i}: eod_mask_loss did not mask the EOD')
    print(json.dumps({'samples': len(train), 'seq': SEQ, 'eod': tokenizer.eod}))


if __name__ == '__main__':
    main()
