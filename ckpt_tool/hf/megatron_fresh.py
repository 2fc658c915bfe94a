"""The byte objects of a megatron-core checkpoint that starts a run: ``common_state`` and ``_extra_state``.

Written anew, as ``torch.save`` writes a tensor-free object (:func:`gtp_format.writer.torch_blob.object_blob`:
``data.pkl`` then torch's small records), the pickle made by the standard library's protocol-2
pickler from plain values and one ``argparse.Namespace`` (what Megatron-LM's ``args`` is). Nothing
is ever unpickled here. The structure is the one megatron-core 0.19.2's
``generate_state_dict`` saves (checked on ``fixtures/megatron/dp2_fully_reshardable``'s blob):

``[{'args': Namespace(...), 'checkpoint_version': 3.0, 'iteration': 0,
'optimizer': {'optimizer': {'param_groups': [...]}, 'param_state_sharding_type': T},
'opt_param_scheduler': {...}, 'num_floating_point_operations_so_far': 0,
'content_metadata': {'distrib_optim_sharding_type': T, ...}}]``

with ``T`` the sharding type; for ``dp_reshardable`` the param groups sit in each
``optimizer.distributed.dp_group_idx_N.optimizer`` object instead, as megatron-core keeps them.

``args`` are those Megatron-LM records for the model (:func:`.megatron_model.megatron_args`) plus the
parallel sizes, ``ckpt_format torch_dist``, ``use_distributed_optimizer``,
``dist_ckpt_optim_fully_reshardable``, ``bf16``, ``seq_length`` and ``no_save_rng`` (no rng_state
is written: megatron's loader then asks for none).

The param groups are megatron-core's two default groups (weights with weight decay; biases and
norms without: ``wd_mult`` 1 and 0), with Megatron-LM's default Adam settings (betas 0.9 / 0.999,
eps 1e-8, weight decay 0.01) and ``step`` 0 (a carried run: its step, the ``lr`` / ``weight_decay`` its
schedule gives there, :mod:`.megatron_schedule`, and its Adam ``betas`` / ``eps``, which megatron-core's loader
hands to the optimizer as saved). megatron-core pairs saved and live groups by
``max_lr``, ``min_lr``, ``wd_mult``, ``lr_mult``, ... (``param_group_identifier_keys``), so a run
that loads the optimizer state passes the same ``--lr`` and ``--min-lr`` as the import; a fresh import's
scheduler state records them with no warm-up or decay (load with ``--override-opt_param-scheduler``
to take the run's own schedule, or ``--finetune`` / ``--no-load-optim`` to take the weights alone); a carried
one is the run's, verbatim (Megatron-LM's loader then steps it to its ``num_steps``, setting the same rates).
"""

from __future__ import annotations

import argparse
import hashlib
import pickle
import struct
from typing import Any

from gtp_format.dtypes import DType
from gtp_format.errors import FormatError
from gtp_format.writer.torch_blob import object_blob

SHARDINGS = ("dp_reshardable", "fully_reshardable")
# megatron-core's GPT linear layers with an ``_extra_state`` (local spec: ``[None]``)
LINEARS = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2")
EXPERT_LINEARS = ("linear_fc1", "linear_fc2")  # each expert's (``mlp.experts.experts.*``), MoE layers
EXPERT_PREFIX = "chained_1."  # MoE: a ChainedOptimizer of the dense (chained_0) and the expert optimizer
ADAM = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}  # Megatron-LM's defaults


def torch_object(obj: Any) -> bytes:
    """``torch.save(obj)``'s bytes for a tensor-free ``obj`` (protocol 2, torch's records after ``data.pkl``).
    Its serialization id (torch's is 40 random digits) is taken from the pickle's hash, so the same
    import writes the same bytes (a bucket's copy and a local one compare bit for bit)."""
    pkl = pickle.dumps(obj, protocol=2)
    a, b = struct.unpack("<QQ", hashlib.sha256(pkl).digest()[:16])
    return object_blob("archive/", [("data.pkl", pkl), (".format_version", b"1"), (".storage_alignment", b"64"),
                                    ("byteorder", b"little"), ("version", b"3\n"),
                                    (".data/serialization_id", f"{a:020d}{b:020d}".encode())])


def extra_state() -> bytes:
    return torch_object([None])


def param_groups(lr: float, min_lr: float, expert: bool = False, step: float = 0.0,
                 carried: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """megatron-core's default param groups: weights (weight decay) and biases / norms (none); the expert
    optimizer's experts have weights only (SwiGLU experts without biases): one group. ``carried``: what a carried
    run's groups hold, each where known: ``lr`` and ``weight_decay`` (before ``wd_mult``) as its schedule gives them
    at its step (:mod:`.megatron_schedule`), Adam's ``betas`` and ``eps``; else ``lr`` and Adam's defaults."""
    c = carried or {}
    rate, decay = c.get("lr", lr), c.get("weight_decay", ADAM["weight_decay"])
    betas, eps = tuple(c.get("betas", ADAM["betas"])), c.get("eps", ADAM["eps"])
    return [{"is_expert_parallel": expert, "default_config": True, "wd_mult": wd, "lr_mult": 1.0,
             "is_decoupled_lr": False, "max_lr": lr, "min_lr": min_lr, "lr": rate, "betas": betas,
             "eps": eps, "weight_decay": decay * wd, "amsgrad": False, "maximize": False,
             "foreach": None, "capturable": False, "differentiable": False, "fused": None,
             "decoupled_weight_decay": True, "step": step} for wd in ((1.0,) if expert else (1.0, 0.0))]


def optimizer_object(lr: float, min_lr: float, expert: bool = False, step: float = 0.0,
                     carried: dict[str, Any] | None = None) -> bytes:
    """``optimizer.distributed.dp_group_idx_N.optimizer`` of a ``dp_reshardable`` save: the param groups."""
    return torch_object([{"param_groups": param_groups(lr, min_lr, expert, step, carried)}])


def experts_in_dense(num_experts: int, tp: int, ep: int, etp: int) -> bool:
    """Whether megatron-core keeps the experts in the dense DDP buffers and the dense optimizer: EP 1 with expert
    TP = TP builds them with the dense process groups (``use_expert_pgs`` false, so ``allreduce`` stays true: no
    expert buffer, no ``chained_`` pair; checked on ``fixtures/megatron/pair_mixtral_tp2_ep1_dp_reshardable``).
    A shared expert is a dense parameter at any EP; in megatron-core's module order it follows the experts
    (router, experts, then the shared expert's gate and linears: ``pair_qwen2moe_tp2_ep1_dp_reshardable``)."""
    return bool(num_experts) and ep == 1 and etp == tp


def check_topology(hf: Any, tp: int, pp: int, vpp: int | None, dp: int, ep: int = 1, etp: int = 1,
                   sharding: str = "fully_reshardable") -> None:
    """Refuse, naming the flag, a TP / PP / VPP / EP / expert TP megatron-core could not build this model at, or
    a layout this import does not write. ``sharding`` is not one of them: both are written at any of these sizes
    (``dp_reshardable`` with one set of buffers per virtual-pipeline model chunk, dense and expert)."""
    a = hf.args
    experts = a.get("num_experts") or 0
    if not experts and (ep, etp) != (1, 1):
        raise FormatError(f"--ep {ep} / --etp {etp}: the model has no experts; drop them")
    if experts:
        dense = experts_in_dense(experts, tp, ep, etp)
        if experts % ep:
            raise FormatError(f"--ep {ep} does not divide the model's {experts} experts; pick an EP that divides them")
        if etp != 1 and not dense:
            raise FormatError(f"--etp {etp}: the experts are gated (SwiGLU), and this import lays gated experts out at "
                              "expert TP 1, or at expert TP = TP with --ep 1 (in the dense buffers), only; pass "
                              "--etp 1 (and --expert-tensor-parallel-size 1 to the run)")
        if dense and a["moe_ffn_hidden_size"] % tp:
            raise FormatError(f"--tp {tp} (= expert TP, --ep 1) does not divide the model's moe_ffn_hidden_size "
                              f"{a['moe_ffn_hidden_size']} (megatron-core splits each expert over it); pick a TP that "
                              "divides it")
        if (tp * dp) % (ep * etp):
            raise FormatError(f"--ep {ep} x --etp {etp} does not divide the {tp * dp} ranks of a pipeline stage "
                              f"(--tp {tp} x --dp {dp}); pick sizes whose product divides them")
    chunks = pp * (vpp or 1)
    if a["num_layers"] % chunks:
        raise FormatError(f"--pp {pp}{f' x --vpp {vpp}' if vpp else ''} = {chunks} model chunks do not divide the "
                          f"{a['num_layers']} layers (megatron-core's even split); pick sizes that divide them")
    if vpp is not None and vpp > 1 and pp == 1:
        raise FormatError(f"--vpp {vpp} needs --pp > 1 (megatron-core's virtual pipeline is within a pipeline)")
    sizes = [("num_attention_heads", a["num_attention_heads"]), ("num_query_groups", a["num_query_groups"]),
             ("ffn_hidden_size", a["ffn_hidden_size"]), ("padded_vocab_size", a["padded_vocab_size"])]
    if a.get("moe_shared_expert_intermediate_size"):
        sizes.append(("moe_shared_expert_intermediate_size", a["moe_shared_expert_intermediate_size"]))
    for what, n in sizes:
        if n % tp:
            raise FormatError(f"--tp {tp} does not divide the model's {what} {n} (megatron-core splits it over "
                              "TP); pick a TP that divides it")
    if tp * pp * dp > 1 << 20:
        raise FormatError(f"--tp {tp} x --pp {pp} x --dp {dp} is more than {1 << 20} ranks; pick a real topology")


def run_args(model: dict[str, Any], dtype: DType, tp: int, pp: int, vpp: int | None, dp: int,
             sharding: str, lr: float, min_lr: float, ep: int = 1, etp: int = 1,
             iteration: int = 0, consumed: int = 0, extra: dict[str, Any] | None = None,
             carried: dict[str, Any] | None = None) -> argparse.Namespace:
    """``extra``: a carried schedule's rule inputs (:mod:`.megatron_schedule`), under Megatron-LM's arg names
    (its WSD decay steps as ``lr_wsd_decay_samples``: the scheduler counts samples), so an export reads them back;
    ``carried``: the groups' carried values (:func:`param_groups`), whose Adam settings the args record too."""
    c = carried or {}
    betas, eps = tuple(c.get("betas", ADAM["betas"])), c.get("eps", ADAM["eps"])
    moe = {"expert_tensor_parallel_size": etp, "sequence_parallel": tp > 1} if model.get("num_experts") else {}
    names = {"lr_warmup_init": "lr_warmup_init", "wsd_decay_steps": "lr_wsd_decay_samples",
             "lr_wsd_decay_style": "lr_wsd_decay_style"}
    schedule = {names[k]: v for k, v in (extra or {}).items()}
    return argparse.Namespace(**model, **moe, **schedule, tensor_model_parallel_size=tp,
                              pipeline_model_parallel_size=pp,
                              virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1 else None,
                              **({"num_layers_per_virtual_pipeline_stage": model["num_layers"] // (pp * vpp)}
                                 if vpp and vpp > 1 else {}),
                              context_parallel_size=1, expert_model_parallel_size=ep, data_parallel_size=dp,
                              world_size=tp * pp * dp, use_distributed_optimizer=True, ckpt_format="torch_dist",
                              dist_ckpt_optim_fully_reshardable=sharding == "fully_reshardable",
                              bf16=dtype.name == "bfloat16", fp16=False, lr=lr, min_lr=min_lr,
                              weight_decay=ADAM["weight_decay"], adam_beta1=betas[0],
                              adam_beta2=betas[1], adam_eps=eps, no_save_rng=True,
                              no_save_optim=None, iteration=iteration, consumed_train_samples=consumed,
                              consumed_valid_samples=0)


def common_state(model: dict[str, Any], dtype: DType, tp: int, pp: int, vpp: int | None, dp: int, sharding: str,
                 lr: float, min_lr: float, iteration: int, ep: int = 1, etp: int = 1, step: float = 0.0,
                 carried: dict[str, Any] | None = None, consumed: int = 0,
                 carried_groups: dict[str, Any] | None = None, extra: dict[str, Any] | None = None) -> bytes:
    """``common_state/shard_0_1``'s blob (see the module docstring; MoE: the optimizer part per chained
    optimizer, ``{0: dense, 1: experts}``, as megatron-core's ChainedOptimizer saves it; one optimizer where the
    experts sit in the dense one, :func:`experts_in_dense`). ``carried``: the scheduler state of the run the
    folder was exported from (:mod:`.megatron_run_state`), written as it was; ``consumed`` its data position;
    ``carried_groups`` the values its param groups carry (:func:`param_groups`); ``extra`` its rule inputs,
    written into ``args``."""

    def one(expert: bool) -> dict[str, Any]:
        if sharding == "fully_reshardable":
            return {"optimizer": {"param_groups": param_groups(lr, min_lr, expert, step, carried_groups)},
                    "param_state_sharding_type": sharding}
        return {"param_state_sharding_type": sharding}

    chained = bool(model.get("num_experts")) and not experts_in_dense(model.get("num_experts") or 0, tp, ep, etp)
    optimizer: dict[Any, Any] = {0: one(False), 1: one(True)} if chained else one(False)
    content: dict[str, Any] = {"distrib_optim_sharding_type": sharding}
    if sharding == "fully_reshardable":
        content["distrib_optim_fully_reshardable_mem_efficient"] = False
    content.update(singleton_local_shards=False, chained_optim_avoid_prefix=True)
    scheduler = {"max_lr": lr, "lr_warmup_steps": 0, "num_steps": 0, "lr_decay_style": "constant",
                 "lr_decay_steps": 1, "min_lr": min_lr, "start_wd": ADAM["weight_decay"],
                 "end_wd": ADAM["weight_decay"], "wd_incr_style": "constant", "wd_incr_steps": 1}
    if carried is not None:
        scheduler = dict(carried)
    state = {"args": run_args(model, dtype, tp, pp, vpp, dp, sharding, lr, min_lr, ep, etp, iteration, consumed,
                              extra, carried_groups),
             "checkpoint_version": 3.0,
             "iteration": iteration, "optimizer": optimizer, "opt_param_scheduler": scheduler,
             "num_floating_point_operations_so_far": 0, "content_metadata": content}
    return torch_object([state])
