"""The Megatron engine's training step and setup; training.train runs the loop around it.

Training runs through Megatron's DDP, optimizer (AdamW with bf16 params and fp32 main weights,
clipping) and get_forward_backward_func (TP, PP, DP), on the model of model.py and the
micro-batches of batches.py; with tied embeddings Megatron's finalize_model_grads sums the
gradients of the two copies over the embedding group.

dist_checkpointing.save spawns helper processes, so the entry module must keep its
`if __name__ == "__main__"` guard (mflow_workloads.train has one).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .. import runtime, shards as S, training as T
from ..config import TrainConfig
from ..errors import ConfigError
from . import batches as MB, checkpoint as MC, fusions as MF, model as MM

# Speed knobs, each measured in docs/benchmarks.md (## Training): MFLOW_MEGATRON_KNOBS,
# comma-separated, "none" for none, "default" for these.
DEFAULT_KNOBS = "ce_compiled,swiglu_fusion,swiglu_backward,fused_adam,foreach_optim,compile_rope,cudnn_attn"
KNOWN_KNOBS = frozenset(DEFAULT_KNOBS.split(",")) | {
    "ce_fusion",
    "compile_norm",
    "cudnn_attn_expand",
    "seq_parallel",
    "wgrad_fusion",
    "bf16_grads",
    "foreach_optim",
    "swiglu_backward",
}


def parse_knobs(text: str) -> set[str]:
    """The knobs a MFLOW_MEGATRON_KNOBS value names; an unknown name is refused rather than
    ignored, so that a misspelt knob is not measured as if it were on."""
    knobs = set()
    for name in (k.strip() for k in text.split(",")):
        if name in ("", "none"):
            continue
        if name == "default":
            knobs |= set(DEFAULT_KNOBS.split(","))
        elif name in KNOWN_KNOBS:
            knobs.add(name)
        else:
            raise ConfigError(
                f"MFLOW_MEGATRON_KNOBS names an unknown knob {name[:64]!r}",
                f"use some of {', '.join(sorted(KNOWN_KNOBS))}, or default, or none",
            )
    return knobs


def set_process_knobs(knobs: set) -> None:
    """Sets the knobs that patch torch or Megatron for the whole process on or off; call before
    the model is built."""
    MF.enable_fused_adamw("fused_adam" in knobs)
    MF.enable_wgrad_fusion("wgrad_fusion" in knobs)
    MF.enable_foreach_optimizer("foreach_optim" in knobs)
    MF.enable_swiglu_backward("swiglu_backward" in knobs)


def _build(cfg: TrainConfig, spec: S.ModelSpec, manifest: dict, knobs: set, tp_rank: int, pp_rank: int):
    """This rank's model with its shard loaded, wrapped in Megatron's DDP, and its optimizer."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    set_process_knobs(knobs)
    config = MM.transformer_config(spec, cfg.tp, cfg.pp, cfg.precision, knobs)
    model = MM.build_model(spec, config, cfg.tp, cfg.seq_length, cfg.attention, knobs)
    MM.check_model_stage(model, manifest, pp_rank)
    MM.load_shard(model, cfg.shards, manifest, tp_rank, pp_rank)
    MM.sync_tied_embedding(model, spec, cfg.pp)
    ddp = DistributedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32="bf16_grads" not in knobs, overlap_grad_reduce=False, use_distributed_optimizer=False
        ),
        module=model,
    )
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=cfg.lr,
            min_lr=cfg.min_lr,
            weight_decay=cfg.weight_decay,
            adam_beta1=cfg.adam_beta1,
            adam_beta2=cfg.adam_beta2,
            adam_eps=1e-8,
            clip_grad=cfg.clip_grad,
            bf16=cfg.precision == "bf16",
            params_dtype=config.params_dtype,
            use_distributed_optimizer=False,
        ),
        [ddp],
    )
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = opt.scale_loss
    return model, ddp, opt


class MegatronEngine:
    """One rank of the Megatron engine, for training.train."""

    name = "megatron"

    def __init__(self, cfg: TrainConfig, manifest: dict, spec: S.ModelSpec, meta: dict, knobs: set):
        from megatron.core import parallel_state as ps

        self.cfg, self.manifest, self.knobs = cfg, manifest, knobs
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self.last_stage = ps.is_pipeline_last_stage()
        self.model, self.ddp, self.opt = _build(cfg, spec, manifest, knobs, self.tp_rank, self.pp_rank)
        if dist.get_rank() == 0:
            os.makedirs(cfg.scratch, exist_ok=True)
        dist.barrier()
        self.train_ds, self.valid_ds = MB.build_datasets(cfg, meta, cfg.dp)
        self.schedule = self.data_iter = None

    def load(self, root: str, iteration: int) -> None:
        MC.load(root, iteration, self.ddp, self.opt, self.cfg.tp, self.cfg.pp)

    def start(self) -> None:
        from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

        self.schedule = get_forward_backward_func()
        torch.cuda.reset_peak_memory_stats()

    def _batches(self, ds, iteration: int):
        cfg = self.cfg
        return MB.Prefetch(
            MB.batches(
                ds,
                cfg.dp,
                self.dp_rank,
                cfg.global_batch_size,
                cfg.micro_batch_size,
                iteration,
                self.pp_rank,
                cfg.pp,
                device="cpu",
            )
        )

    def _run_schedule(self, data_iterator, forward_only: bool) -> list:
        cfg = self.cfg
        return self.schedule(
            forward_step_func=MB.forward_step,
            data_iterator=data_iterator,
            model=[self.ddp],
            num_microbatches=cfg.num_microbatches,
            seq_length=cfg.seq_length,
            micro_batch_size=cfg.micro_batch_size,
            decoder_seq_length=cfg.seq_length,
            forward_only=forward_only,
        )

    def _reduce_loss(self, losses: list) -> torch.Tensor:
        # The loss exists on the last stage only, identical over its tp ranks: the world sum of the
        # last stage's values over tp*dp is the mean over the dp replicas, on every rank. It stays
        # on the GPU (float64, as a sum of Python floats would be) until the caller reads it.
        if self.last_stage and losses:
            v = torch.stack([x["lm loss"].double() for x in losses]).sum() / len(losses)
        else:
            v = torch.zeros((), device="cuda", dtype=torch.float64)
        dist.all_reduce(v)
        return v / (self.cfg.tp * self.cfg.dp)

    def step(self, iteration: int, lr: float) -> tuple[float, float]:
        if self.data_iter is None:  # this attempt's first step: the data from where it resumed
            self.data_iter = self._batches(self.train_ds, iteration)
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.ddp.zero_grad_buffer()
        self.opt.zero_grad()
        losses = self._run_schedule(self.data_iter, forward_only=False)
        if iteration + 1 < self.cfg.iterations:  # the next step's data, while the GPU runs this one's
            self.data_iter.ahead(self.cfg.num_microbatches)
        _, grad_norm, _ = self.opt.step()
        loss = self._reduce_loss(losses)
        torch.cuda.synchronize()
        return float(loss), float(grad_norm or 0.0)

    def validation_loss(self) -> float:
        self.ddp.eval()
        it = self._batches(self.valid_ds, 0)
        vals = []
        with torch.no_grad():
            for _ in range(self.cfg.eval_iters):
                vals.append(float(self._reduce_loss(self._run_schedule(it, forward_only=True))))
        self.ddp.train()
        return sum(vals) / len(vals)

    def any_rank_stops(self, requested: bool) -> bool:
        flag = torch.tensor([1.0 if requested else 0.0], device="cuda")
        dist.all_reduce(flag)
        return flag.item() > 0

    def save(self, root: str, iteration: int) -> None:
        cfg = self.cfg
        meta = {
            "consumed_samples": iteration * cfg.global_batch_size,
            "seed": cfg.seed,
            "tp": cfg.tp,
            "pp": cfg.pp,
            "dp": cfg.dp,
        }
        MC.save(root, iteration, self.ddp, self.opt, meta)

    def peak_mem_gib(self) -> float:
        # Of the fullest rank (stages differ: the last holds the logits).
        mem = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device="cuda")
        if self.cfg.world_size > 1:
            dist.all_reduce(mem, op=dist.ReduceOp.MAX)
        return float(mem)

    def write_output(self) -> None:
        """The shards (mflow's format) and the same weights as torch_dist under output/megatron."""
        from megatron.core import dist_checkpointing

        cfg = self.cfg
        if self.dp_rank == 0:
            dtype = S.DTYPES[self.manifest["dtype"]]
            S.write_rank_file(cfg.output, self.tp_rank, self.pp_rank, self.model.state_dict(), dtype)
        final_dir = os.path.join(cfg.output, "megatron")
        if dist.get_rank() == 0:
            os.makedirs(final_dir, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(self.model.sharded_state_dict(prefix=""), final_dir)
        dist.barrier()


def run(cfg: TrainConfig) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    knobs = parse_knobs(os.environ.get("MFLOW_MEGATRON_KNOBS", DEFAULT_KNOBS))
    if not torch.cuda.is_available():
        raise ConfigError("engine 'megatron' needs CUDA, and no GPU is visible", "use engine 'reference' on CPU")
    runtime.init_distributed(True)
    ps.initialize_model_parallel(tensor_model_parallel_size=cfg.tp, pipeline_model_parallel_size=cfg.pp)
    model_parallel_cuda_manual_seed(cfg.seed)
    rank = dist.get_rank()
    manifest, spec, meta = T.read_inputs(cfg)
    MM.check_stage_split(manifest, cfg.tp, cfg.pp, f"shards {cfg.shards}")
    MM.check_megatron_layout(rank, cfg.tp, cfg.dp, cfg.pp)
    # Sequence parallelism splits the sequence over the TP ranks.
    if cfg.seq_length % cfg.tp:
        knobs.discard("seq_parallel")
    engine = MegatronEngine(cfg, manifest, spec, meta, knobs)
    return T.train(cfg, engine, manifest, rank == 0, knobs=sorted(knobs))
