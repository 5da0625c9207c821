"""The reference engine: a compact tensor-parallel GPT in plain PyTorch, with Megatron-Core's
local-spec parameter layout, trained with TP x PP x DP over torch.distributed (CPU or CUDA).

model.py is the model, parallel.py the rank layout and tensor-parallel pieces (shm.py: the
shared-memory all-reduce of two local ranks), pipeline.py the 1F1B schedule, optim.py AdamW,
checkpoint.py its checkpoints, and trainer.py the step that training.train (shared with the
Megatron engine) runs.
"""
