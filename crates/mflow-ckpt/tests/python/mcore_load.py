"""Loads mflow shards into a real Megatron-Core GPTModel (local spec, CPU, gloo) with
load_state_dict(strict=True) on every rank, runs a forward pass, and compares the gathered logits
with transformers on the Hugging Face model the shards came from.

    python -m torch.distributed.run --nproc_per_node=TP mcore_load.py HF_DIR SHARDS_DIR

Prints one JSON line on rank 0.
"""

import json
import os
import sys

import torch
import torch.nn.functional as F


def main():
    hf_dir, shards = sys.argv[1], sys.argv[2]
    torch.distributed.init_process_group("gloo")  # CPU tensors; the model forward moves to CUDA when present
    rank = torch.distributed.get_rank()
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.utils import openai_gelu
    from safetensors.torch import load_file

    man = json.load(open(os.path.join(shards, "mflow-checkpoint.json")))
    m, tp = man["model"], man["tp"]
    assert man["pp"] == 1, "this check runs one pipeline stage"
    parallel_state.initialize_model_parallel(tp, 1)
    t = parallel_state.get_tensor_model_parallel_rank()
    cfg = TransformerConfig(
        num_layers=m["num_layers"], hidden_size=m["hidden_size"], num_attention_heads=m["num_attention_heads"],
        num_query_groups=m["num_query_groups"], kv_channels=m["kv_channels"], ffn_hidden_size=m["ffn_hidden_size"],
        gated_linear_unit=m["gated_linear_unit"], activation_func=F.silu if m["activation"] == "silu" else openai_gelu,
        normalization=m["normalization"], layernorm_epsilon=m["layernorm_epsilon"], add_bias_linear=m["add_bias_linear"],
        add_qkv_bias=m["add_qkv_bias"], hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, tensor_model_parallel_size=tp, sequence_parallel=False,
        params_dtype=torch.float32, use_cpu_initialization=True, perform_initialization=False)
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(normalization=m["normalization"]),
                     vocab_size=m["padded_vocab_size"], max_sequence_length=m["max_position_embeddings"],
                     position_embedding_type=m["position_embedding_type"], rotary_base=m["rotary_base"],
                     rotary_percent=m["rotary_percent"], rope_scaling=m["rope_scaling"],
                     rope_scaling_factor=m["rope_scaling_factor"],
                     share_embeddings_and_output_weights=m["share_embeddings_and_output_weights"],
                     parallel_output=False).eval()
    sd = load_file(os.path.join(shards, f"model_tp{t:02}_pp000.safetensors"))
    result = model.load_state_dict(sd, strict=True)  # raises on any missing, unexpected or misshapen key
    if not torch.cuda.is_available():
        # Megatron-Core's forward (rotary embedding) needs CUDA; the strict load is the check here.
        if rank == 0:
            print(json.dumps({"load": str(result), "forward": "skipped: needs CUDA"}))
        torch.distributed.destroy_process_group()
        return
    model = model.cuda()
    tokens = torch.randint(0, m["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(24).unsqueeze(0).expand(2, -1)
    with torch.no_grad():
        got = model(tokens.cuda(), pos.cuda(), None)[..., : m["vocab_size"]].float().cpu()
    if rank == 0:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
        with torch.no_grad():
            ref = hf(tokens).logits.float()
        print(json.dumps({"load": str(result), "max_abs_diff": (ref - got).abs().max().item(),
                          "cosine": F.cosine_similarity(ref.flatten(), got.flatten(), dim=0).item()}))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
