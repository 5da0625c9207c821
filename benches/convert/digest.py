"""Prints one digest over every tensor (name, dtype, shape, bytes) of the model_tp*.safetensors
files in a directory, so two conversions can be compared regardless of header layout."""

import hashlib
import json
import mmap
import os
import struct
import sys

d = sys.argv[1]
h = hashlib.sha256()
for f in sorted(x for x in os.listdir(d) if x.startswith("model_tp") and x.endswith(".safetensors")):
    with open(os.path.join(d, f), "rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        n = struct.unpack("<Q", mm[:8])[0]
        header = json.loads(mm[8 : 8 + n])
        header.pop("__metadata__", None)
        for name in sorted(header):
            t = header[name]
            s, e = t["data_offsets"]
            h.update(f"{f}:{name}:{t['dtype']}:{t['shape']}".encode())
            h.update(mm[8 + n + s : 8 + n + e])
print(h.hexdigest())
