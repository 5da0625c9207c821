"""Prints the fp32 loss and gradient norm of one fixed batch (run under torchrun, gloo)."""

import json
import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mflow_workloads import data as D, shards as S
from mflow_workloads.reference import model as RM, parallel as RP
from mflow_workloads.reference.trainer import clip_grad_norm


def main():
    shards, data = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    m = S.read_manifest(shards)
    p = RP.setup(m["tp"], dist.get_world_size() // m["tp"])
    model = RM.build(S.spec_of(m), p, S.load_rank(shards, m, p.tp_rank))
    tokens, labels = D.SampleSource(os.path.join(data, "train"), 64, 1234, True).batch(0, 4)
    loss = model.loss(tokens, labels).mean()
    loss.backward()
    norm = clip_grad_norm(model, 0.0, p)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"loss": loss.item(), "grad_norm": norm}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
