"""megatron-core's own loader and forward on a checkpoint ``ckpt import --to megatron-core`` wrote (megatron venv).

``python megatron_forward.py CKPT_ITER_DIR OUT_DIR TP PP DP TOKENS.npy`` spawns TP x PP x DP gloo CPU ranks.
Each builds megatron-core's ``GPTModel`` (local spec) from the checkpoint's own ``common_state`` args as
Megatron-LM's ``core_transformer_config_from_args`` would (``--swiglu``: gated SiLU; ``--openai-gelu``;
``--squared-relu``; ``--normalization``; ``--qk-layernorm``; GQA; RoPE base; ``--use-rope-scaling`` with
``--rope-scaling-factor`` (as Megatron-LM's ``gpt_builders`` passes them to ``GPTModel``); tied or untied output; MoE:
``--num-experts``, ``--moe-ffn-hidden-size``, ``--moe-router-topk``, ``--moe-router-pre-softmax``,
SequentialMLP experts at the args' EP and expert TP, the allgather dispatcher, sequence parallelism at TP > 1
as megatron-core requires for MoE), wrapped as training does (``Float16Module`` for bf16, megatron DDP with
the distributed optimizer, ``get_megatron_optimizer`` with the args' lr / min_lr), wipes the model and
optimizer to zeros and loads CKPT as ``load_checkpoint`` does for ``torch_dist`` (sharded state dicts with the
sharding type the checkpoint's ``content_metadata`` names, ``dist_checkpointing.load``,
``model.load_state_dict(strict=True)``, ``optimizer.load_state_dict``; the two CPU workarounds of
``megatron_load.py``). Rank ``r`` writes ``OUT_DIR/rank{r}.npz``: every model parameter (bf16 as raw int16),
the fp32 master / ``exp_avg`` / ``exp_avg_sq`` shards and ``step``; at PP 1 rank 0 also writes ``logits.npy``,
the forward on TOKENS (``parallel_output=False``: the full vocabulary). """

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "megatron"
HELPERS = Path(__file__).resolve().parent


def _build(args: Any, tp: int, pp: int, vpp: int | None = None) -> tuple[Any, Any]:
    import torch
    import torch.nn.functional as F
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel
    from megatron.core.activations import squared_relu
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.utils import openai_gelu

    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    bf16 = bool(args.bf16)
    experts = getattr(args, "num_experts", None)
    moe = dict(num_moe_experts=experts, expert_model_parallel_size=args.expert_model_parallel_size,
               expert_tensor_parallel_size=args.expert_tensor_parallel_size,
               moe_ffn_hidden_size=args.moe_ffn_hidden_size,
               moe_router_topk=args.moe_router_topk, moe_router_pre_softmax=args.moe_router_pre_softmax,
               moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
               moe_shared_expert_gate=args.moe_shared_expert_gate,
               moe_token_dispatcher_type="allgather", moe_grouped_gemm=False, moe_aux_loss_coeff=0.0,
               sequence_parallel=tp > 1) if experts else {}
    dtype = torch.bfloat16 if bf16 else torch.float32
    act = F.silu if args.swiglu else squared_relu if args.squared_relu else openai_gelu if args.openai_gelu \
        else F.gelu
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        use_cpu_initialization=True, bf16=bf16, params_dtype=dtype, pipeline_dtype=dtype, hidden_dropout=0.0,
        attention_dropout=0.0, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        bias_activation_fusion=False, add_bias_linear=args.add_bias_linear, add_qkv_bias=args.add_qkv_bias,
        gated_linear_unit=args.swiglu, activation_func=act, normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon, qk_layernorm=args.qk_layernorm,
        virtual_pipeline_model_parallel_size=vpp, **moe)
    spec = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False, qk_layernorm=args.qk_layernorm,
                                    normalization=args.normalization)
    chunks = []
    for vp_stage in range(vpp or 1):  # training.get_model: one GPTModel per model chunk with virtual pipeline stages
        stage = vp_stage if vpp else None
        model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                         max_sequence_length=args.max_position_embeddings,
                         pre_process=mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                         post_process=mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                         share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                         position_embedding_type=args.position_embedding_type,
                         rotary_base=getattr(args, "rotary_base", 10000),
                         rotary_percent=getattr(args, "rotary_percent", 1.0),
                         rope_scaling=bool(getattr(args, "use_rope_scaling", False)),
                         rope_scaling_factor=getattr(args, "rope_scaling_factor", 8.0), parallel_output=False,
                         **({"vp_stage": stage} if vpp else {}))
        if bf16:
            model = Float16Module(config, model)
        ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                            use_distributed_optimizer=True, check_for_nan_in_grad=False)
        chunks.append(DistributedDataParallel(config=config, ddp_config=ddp, module=model,
                                              disable_bucketing=vp_stage > 0))
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, bf16=bf16,
        params_dtype=dtype, use_distributed_optimizer=True, clip_grad=1.0), chunks)
    model = chunks if vpp else chunks[0]
    return model, optimizer


def worker(rank: int, world: int, port: int, ckpt: str, out: str, tp: int, pp: int, tokens: str) -> None:
    sys.path.insert(0, str(FIXTURES))
    sys.path.insert(0, str(HELPERS))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import numpy as np
    import torch
    from make_megatron_fixtures import install_cpu_shims
    from megatron_load import load_zeroed
    from megatron_shims import allow_torch_norm_with_sequence_parallel

    torch.set_num_threads(1)
    install_cpu_shims()
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as mpu

    common = dist_checkpointing.load_common_state_dict(ckpt)  # megatron's own reader of common_state
    args = common["args"]
    sharding = common["content_metadata"]["distrib_optim_sharding_type"]
    if getattr(args, "num_experts", None) and tp > 1:
        allow_torch_norm_with_sequence_parallel()
    vpp = getattr(args, "virtual_pipeline_model_parallel_size", None)  # the checkpoint's own, as Megatron-LM's args
    mpu.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                  virtual_pipeline_model_parallel_size=vpp,
                                  expert_model_parallel_size=getattr(args, "expert_model_parallel_size", 1) or 1,
                                  expert_tensor_parallel_size=getattr(args, "expert_tensor_parallel_size", None))
    model, optimizer = _build(args, tp, pp, vpp)
    module, arrays = load_zeroed(model, optimizer, ckpt, sharding)
    np.savez(os.path.join(out, f"rank{rank}.npz"), **arrays)
    ids = torch.from_numpy(np.load(tokens)).long()
    b, s = ids.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)  # True: masked out
    if pp == 1:
        gpt = module.module if hasattr(module, "module") and not hasattr(module, "decoder") else module
        gpt.eval()
        with torch.no_grad():
            logits = gpt(ids, pos, mask)
        if rank == 0:
            np.save(os.path.join(out, "logits.npy"), logits.float().numpy())
    else:
        logits = _pipeline_forward(module if isinstance(module, list) else [module], ids, pos, mask)
        if logits is not None and mpu.get_tensor_model_parallel_rank() == 0 and mpu.get_data_parallel_rank() == 0:
            np.save(os.path.join(out, "logits.npy"), logits.float().numpy())
    dist.barrier()
    dist.destroy_process_group()


def _pipeline_forward(chunks: list[Any], ids: Any, pos: Any, mask: Any) -> Any:
    """The forward over the pipeline stages, model chunk after model chunk in megatron-core's order (chunk ``v``
    of stage ``p`` is the ``(v * PP + p)``-th), each handing its output to the next as the schedules do
    (``set_input_tensor``), sent to the same TP x DP coordinates of the next stage; the logits on the last stage's
    last chunk, else ``None``."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    pp, stage = mpu.get_pipeline_model_parallel_world_size(), mpu.get_pipeline_model_parallel_rank()
    nxt, prev = mpu.get_pipeline_model_parallel_next_rank(), mpu.get_pipeline_model_parallel_prev_rank()
    out = None
    for g in range(pp * len(chunks)):
        v, p = divmod(g, pp)
        if p != stage:
            continue
        gpt = chunks[v]
        gpt.eval()
        if g > 0:
            shape = torch.zeros(3, dtype=torch.long)
            dist.recv(shape, prev)
            hidden = torch.empty(*shape.tolist(), dtype=next(gpt.parameters()).dtype)
            dist.recv(hidden, prev)
            gpt.set_input_tensor(hidden)
        with torch.no_grad():
            out = gpt(ids, pos, mask)
        if g + 1 < pp * len(chunks):
            dist.send(torch.tensor(out.shape, dtype=torch.long), nxt)
            dist.send(out.contiguous(), nxt)
            out = None
    return out


def main(ckpt: str, out: str, tp: int, pp: int, dp: int, tokens: str) -> None:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = tp * pp * dp
    mp.spawn(worker, args=(world, port, ckpt, out, tp, pp, tokens), nprocs=world, join=True)


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], a[1], int(a[2]), int(a[3]), int(a[4]), a[5])
