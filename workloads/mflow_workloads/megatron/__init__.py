"""The Megatron engine: training on CUDA with Megatron-Core (local spec, no Transformer Engine or apex).

model.py builds GPTModel and loads each rank's shard, batches.py reads the data, checkpoint.py
saves and loads checkpoints, fusions.py holds the speed pieces that TE and apex would otherwise
provide, and trainer.py is the step that training.train (shared with the reference engine) runs.
"""
