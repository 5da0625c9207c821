#!/usr/bin/env python3
"""Counts the documents of two Megatron indexed datasets (.bin/.idx) whose token ids differ.

usage: diff_docs.py REFERENCE_PREFIX OTHER_PREFIX   prints {"documents": N, "differing": K, "first": [...]}
"""
import json
import struct
import sys

import numpy as np


def read(prefix):
    with open(prefix + '.idx', 'rb') as f:
        head = f.read(9 + 8 + 1 + 8 + 8)
        assert head[:9] == b'MMIDIDX\x00\x00', prefix
        code = head[17]
        n = struct.unpack('<Q', head[18:26])[0]
        lens = np.frombuffer(f.read(4 * n), dtype=np.int32)
        ptrs = np.frombuffer(f.read(8 * n), dtype=np.int64)
    dtype = {8: np.uint16, 4: np.int32}[code]
    data = np.fromfile(prefix + '.bin', dtype=dtype)
    return lens, ptrs // np.dtype(dtype).itemsize, data


def main():
    (la, pa, da), (lb, pb, db) = read(sys.argv[1]), read(sys.argv[2])
    assert len(la) == len(lb), f'{len(la)} documents against {len(lb)}'
    differing = [i for i in range(len(la))
                 if la[i] != lb[i] or not np.array_equal(da[pa[i]:pa[i] + la[i]], db[pb[i]:pb[i] + lb[i]])]
    print(json.dumps({'documents': len(la), 'differing': len(differing), 'first': differing[:10]}))


if __name__ == '__main__':
    main()
