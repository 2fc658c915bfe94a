"""megatron-core's own loader on a ``fully_reshardable`` checkpoint, at a topology of our choice (megatron venv).

``python megatron_load.py CKPT_ITER_DIR OUT_DIR TP PP DP NUM_LAYERS [SHARDING [EP EXPERTS [VARIANT [ETP]]]]``
spawns TP x PP x DP gloo CPU ranks. Each builds the fixtures' model (MoE given EP and EXPERTS, expert TP
ETP (default TP); VARIANT ``family:<fixture>:<first>``: the generator's model family of that fixture
(``fixtures/megatron/megatron_family.py``: SwiGLU, RMSNorm, GQA, RoPE, q/k layernorm, experts, ...) with
``<first>`` layers on the first pipeline stage (``-``: an even split); ``fp32norm``: no linear biases
and every layernorm kept in fp32,
``pair_fp32norm_*``'s two buffers; ``sp``: no linear biases and sequence parallelism, as
``pair_moe_tp2_etp2_*``, the generator's norm shim included) and
optimizer (``fixtures/megatron/make_megatron_fixtures.py``: its CPU shims, ``MODEL`` and optimizer
settings; local spec, bf16, megatron DDP with the distributed optimizer), wipes the model weights
and optimizer state to zeros, and loads CKPT the way
``megatron/training/checkpointing.py:load_checkpoint`` does for ``torch_dist``
(``sharded_state_dict(is_loading=True)`` with the ``fully_reshardable`` metadata, or SHARDING's,
``dist_checkpointing.load``, ``model.load_state_dict``, ``optimizer.load_state_dict``). Two
workarounds for megatron-core 0.19.2 on CPU with torch's AdamW:

* ``_init_optimizer_states_with_dummy_values()`` first: a fresh optimizer has no state, and
  ``load_state_dict`` asserts one ``step`` across it (``distrib_optimizer.py:838``);
* ``_set_main_param_and_optimizer_states`` is given AdamW's already-restored ``step`` when the
  gathered tensors lack it (else ``KeyError: 'step'``, on megatron's own save too), and runs under
  ``torch.no_grad()``: an fp32 param's main param is a view of the model param, a leaf that requires
  grad, and its ``copy_`` raises otherwise (``VARIANT fp32norm``; megatron's own save too).

Rank ``r`` writes ``OUT_DIR/rank{r}.npz``: every model parameter (by module name, bf16 as raw
int16) and the fp32 master, ``exp_avg`` and ``exp_avg_sq`` of every local optimizer shard, in
the optimizer's order, plus ``step`` of each (compared separately by the test).
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "megatron"


def _build(tp: int, pp: int, num_layers: int, ep: int = 1, experts: int = 0, variant: str = "plain",
           etp: int | None = None) -> tuple[Any, Any]:
    import torch
    from make_megatron_fixtures import MODEL, SEED
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    family = variant.startswith("family:")
    if family:  # a model family of the generator (megatron_family): the fixture's spec at this topology
        from make_megatron_fixtures import FIXTURES
        from megatron_family import config_kwargs, gpt_kwargs, layer_spec

        _, name, first = variant.split(":")
        fam = dict(FIXTURES[name], tp=tp, pp=pp, ep=ep, etp=etp, first_layers=None if first == "-" else int(first))
        experts = fam.get("experts") or 0
    moe = dict(num_moe_experts=experts, expert_model_parallel_size=ep, moe_ffn_hidden_size=32, moe_router_topk=2,
               moe_token_dispatcher_type="allgather", moe_grouped_gemm=False, moe_aux_loss_coeff=0.0,
               expert_tensor_parallel_size=etp) if experts else {}
    config = TransformerConfig(
        num_layers=num_layers, hidden_size=MODEL["hidden_size"], ffn_hidden_size=MODEL["ffn_hidden_size"],
        num_attention_heads=MODEL["num_attention_heads"], tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, use_cpu_initialization=True, bf16=True, params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False, apply_rope_fusion=False,
        persist_layer_norm=False, sequence_parallel=(variant == "sp" or (family and experts > 0)) and tp > 1,
        **(config_kwargs(fam) if family else dict(add_bias_linear=variant == "plain", **moe)))
    spec = layer_spec(fam) if family else get_gpt_layer_local_spec(num_experts=experts or None, moe_grouped_gemm=False)
    gpt = gpt_kwargs(fam) if family else dict(share_embeddings_and_output_weights=True,
                                              position_embedding_type="learned_absolute")
    model = GPTModel(config=config, transformer_layer_spec=spec,
                     vocab_size=MODEL["vocab_size"], max_sequence_length=MODEL["seq_length"],
                     pre_process=mpu.is_pipeline_first_stage(), post_process=mpu.is_pipeline_last_stage(), **gpt)
    model = Float16Module(config, model)
    if variant == "fp32norm":  # as the generator's fp32_norms: the layernorms back to fp32 after the bf16 cast
        for name, p in model.named_parameters():
            if "layernorm" in name or "layer_norm" in name:
                p.data = p.data.float()
    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                        use_distributed_optimizer=True, check_for_nan_in_grad=False)
    model = DistributedDataParallel(config=config, ddp_config=ddp, module=model)
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=1e-3, min_lr=1e-5, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.95, bf16=True,
        params_dtype=torch.bfloat16, use_distributed_optimizer=True, clip_grad=1.0), [model])
    return model, optimizer


def pass_step_through() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    orig = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states(self: Any, model_param: Any, tensors: dict[str, Any]) -> None:
        if "step" not in tensors:
            tensors = {**tensors, "step": None}  # not a tensor: left as load_state_dict restored it
        import torch

        with torch.no_grad():  # an fp32 param's main param is a view of the leaf model param (fp32norm)
            orig(self, model_param, tensors)

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states


def load_zeroed(model: Any, optimizer: Any, ckpt: str, sharding: str) -> tuple[Any, dict[str, Any]]:
    """Wipe the fresh model and optimizer to zeros and load CKPT into them as ``load_checkpoint`` does for
    ``torch_dist`` (SHARDING's metadata, the two CPU workarounds of the module docstring); returns the
    unwrapped model (a list of them for a list of model chunks) and every value a test compares: each parameter
    (bf16 as raw int16; ``model.chunk<i>.`` per model chunk), each optimizer shard in the optimizer's order, and
    ``step``."""
    import numpy as np
    import torch
    from make_megatron_fixtures import _optimizer_tensors, sharded_sd_metadata_for
    from megatron.core import dist_checkpointing
    from megatron.core.utils import unwrap_model

    opts = getattr(optimizer, "chained_optimizers", [optimizer])
    for opt in opts:
        opt._init_optimizer_states_with_dummy_values()
    pass_step_through()
    # virtual pipeline stages: a list of model chunks, each under model0, model1, ... as load_checkpoint names them
    modules = [unwrap_model(m) for m in model] if isinstance(model, list) else [unwrap_model(model)]
    names = ["model"] if len(modules) == 1 else [f"model{i}" for i in range(len(modules))]
    with torch.no_grad():  # nothing of the fresh model survives: every value compared comes from CKPT
        for p in (p for module in modules for p in module.parameters()):
            p.zero_()
        for t in _optimizer_tensors(optimizer):
            t.zero_()
    metadata = sharded_sd_metadata_for(sharding)
    sharded = {n: module.sharded_state_dict(metadata=metadata) for n, module in zip(names, modules)}
    sharded["optimizer"] = optimizer.sharded_state_dict(sharded, is_loading=True, metadata=metadata)
    state = dist_checkpointing.load(sharded, ckpt)
    for n, module in zip(names, modules):
        module.load_state_dict(state[n], strict=True)
    optimizer.load_state_dict(state["optimizer"])

    arrays: dict[str, Any] = {}
    for i, module in enumerate(modules):
        for name, p in module.named_parameters():
            w = p.detach()
            key = f"model.{name}" if len(modules) == 1 else f"model.chunk{i}.{name}"
            arrays[key] = w.view(torch.int16).numpy() if p.dtype == torch.bfloat16 else w.numpy()
    for i, t in enumerate(_optimizer_tensors(optimizer)):
        arrays[f"opt.{i}"] = t.detach().numpy()
    arrays["step"] = np.array([float(o.optimizer.state[p]["step"]) for o in opts
                               for g in o.optimizer.param_groups for p in g["params"]])
    return (modules if isinstance(model, list) else modules[0]), arrays


def worker(rank: int, world: int, port: int, ckpt: str, out: str, tp: int, pp: int, num_layers: int,
           sharding: str = "fully_reshardable", ep: int = 1, experts: int = 0, variant: str = "plain",
           etp: int | None = None) -> None:
    sys.path.insert(0, str(FIXTURES))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import numpy as np
    import torch
    from make_megatron_fixtures import (
        allow_torch_norm_with_sequence_parallel,
        install_cpu_shims,
    )

    torch.set_num_threads(1)
    install_cpu_shims()
    if variant == "sp" or (variant.startswith("family:") and tp > 1):  # MoE at TP > 1 needs sequence parallelism
        allow_torch_norm_with_sequence_parallel()
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state as mpu

    mpu.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                  expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    model, optimizer = _build(tp, pp, num_layers, ep, experts, variant, etp)
    module, arrays = load_zeroed(model, optimizer, ckpt, sharding)
    for name, b in module.named_buffers():  # the router's expert bias: a model key without optimizer state
        if name.endswith("expert_bias"):
            arrays[f"buffer.{name}"] = b.detach().numpy()
    np.savez(os.path.join(out, f"rank{rank}.npz"), **arrays)
    dist.barrier()
    dist.destroy_process_group()


def main(ckpt: str, out: str, tp: int, pp: int, dp: int, num_layers: int, sharding: str = "fully_reshardable",
         ep: int = 1, experts: int = 0, variant: str = "plain", etp: int | None = None) -> None:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = tp * pp * dp
    mp.spawn(worker, args=(world, port, ckpt, out, tp, pp, num_layers, sharding, ep, experts, variant, etp),
             nprocs=world, join=True)


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], a[1], int(a[2]), int(a[3]), int(a[4]), int(a[5]), *a[6:7], *map(int, a[7:9]), *a[9:10],
         *map(int, a[10:11]))
