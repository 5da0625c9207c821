"""Entry point: `python -m torch.distributed.run ... -m mflow_workloads.train CONFIG.json`."""

from __future__ import annotations

import os
import sys

from . import runtime
from .config import load_train
from .errors import ConfigError


def main(path: str) -> None:
    cfg = load_train(path)
    cuda = runtime.use_cuda(cfg.engine)
    engine = cfg.engine if cfg.engine != "auto" else ("megatron" if cuda else "reference")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != cfg.world_size:
        raise ConfigError(
            f"launched {world} processes but tp*pp*dp = {cfg.tp}*{cfg.pp}*{cfg.dp} = {cfg.world_size}",
            "launch tp*pp*dp processes in total (PET_NNODES * PET_NPROC_PER_NODE)",
        )
    if engine == "megatron":
        from .megatron import trainer

        trainer.run(cfg)
        return
    device = runtime.init_distributed(cuda)
    from .reference import trainer

    trainer.run(cfg, device)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m mflow_workloads.train CONFIG.json", file=sys.stderr)
        sys.exit(2)
    sys.exit(runtime.run_main(main, sys.argv[1]))
