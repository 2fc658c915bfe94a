"""Hostile Hugging Face folders given to ``ckpt import --from hf --to megatron-core``, in forked children
(:mod:`runner`: audited opens, peak RSS, time limit), by class:

* sizes the config claims and the files do not back: 10^9 layers, 2^40 heads, a 2^62 vocabulary,
  a head dim of 0; values of the wrong type (a string hidden size, a negative epsilon, a bool layer
  count); an ``architectures`` list of 100,000 names; a config 100,000 arrays deep;
* safetensors headers: a 10^12-byte header length, data offsets past the file, overlapping tensors,
  a dtype that is no dtype;
* indexes and links: a ``weight_map`` naming ``../outside.safetensors``, a tensor in two files, the
  weights file a symlink to a file outside the folder;
* a config that disagrees with the tensors (``intermediate_size``) and float16 tensors;
* MoE (Mixtral, Qwen3-MoE): an expert count the tensors do not have (8, 2^40), a top-k above the
  experts, an expert FFN size the tensors disagree with, a sliding window, dense layers between MoE
  layers, a string expert count; Qwen2-MoE with a shared expert size the tensors disagree with (or 0)
  and ``qkv_bias`` false against bias tensors; ``--ep`` that does not divide the experts, ``--etp 2``
  (gated experts; ``--ep 1 --etp 2`` at TP 1: expert TP = TP only), ``--ep 1`` with a shared expert (the dense
  layout's order beside it unchecked), ``--ep`` on a dense model; ``--vpp`` whose model chunks do not divide the
  layers (dense and MoE), with an ``--ep`` that does not divide the experts, or at ``--pp 1``;
* optimizer files (``ckpt export --to hf --optimizer``) whose ``gtp_megatron_run_state`` is no JSON, a
  negative iteration, a step of 1e300, a list, 100,000 arrays deep, or a state at another shape; whose carried
  lr schedule is a list, names a decay style megatron-core has not, a negative step count or a NaN rate, or whose
  data position is 1e30;
* per RoPE class, the keys its import reads: Starcoder2 with a sliding window, without biases
  (``use_bias`` false against bias tensors) or a wrong ``intermediate_size``; Arcee with an activation
  megatron-core has no non-gated form of (``silu``) or key/value heads the tensors do not have; Qwen2
  with sliding-window ``layer_types`` or ``layer_types`` that is no list; Persimmon with its default partial
  rotary (0.5), no q/k layernorm, heads the q/k norms disagree with, or a string epsilon;
* the read-ahead hint of a weights file swapped after the folder was read (a symlink to a file outside, cut
  short, gone): no advice outside the folder, no error from the hint, the read refuses it (in-process).

Each: exit 2, one line ``ckpt: error: ...`` naming the file or key, no traceback, peak RSS under
512 MB, within the time limit, no open outside the folder, the folder unchanged and nothing at DST.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from make_corpus import Case  # noqa: E402
from test_hostile import CKPT_TIMEOUT_S, _check, _run_batch  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
CONFIG = {"layers_huge": {"num_hidden_layers": 10**9}, "heads_huge": {"num_attention_heads": 2**40,
                                                                      "num_key_value_heads": 2**40},
          "vocab_huge": {"vocab_size": 2**62}, "head_dim_zero": {"head_dim": 0},
          "hidden_string": {"hidden_size": "64"}, "eps_negative": {"rms_norm_eps": -1.0},
          "layers_bool": {"num_hidden_layers": True}, "arch_many": {"architectures": ["LlamaForCausalLM"] * 100000},
          "ffn_disagrees": {"intermediate_size": 96}, "rope_list": {"rope_parameters": [1, 2]},
          "starcoder2_window": {"sliding_window": 16}, "starcoder2_nobias": {"use_bias": False},
          "starcoder2_ffn": {"intermediate_size": 96}, "arcee_silu": {"hidden_act": "silu"},
          "arcee_heads": {"num_key_value_heads": 4},
          "qwen2_window": {"layer_types": ["sliding_attention", "full_attention"]},
          "qwen2_types_string": {"layer_types": "full_attention"},
          "mixtral_experts": {"num_local_experts": 8}, "mixtral_topk": {"num_experts_per_tok": 5},
          "mixtral_ffn": {"intermediate_size": 48}, "mixtral_window": {"sliding_window": 16},
          "mixtral_experts_huge": {"num_local_experts": 2**40},
          "qwen3moe_dense": {"mlp_only_layers": [0]}, "qwen3moe_step": {"decoder_sparse_step": 2},
          "qwen3moe_experts_string": {"num_local_experts": "4"},
          "qwen2moe_shared": {"shared_expert_intermediate_size": 64}, "qwen2moe_qkv_bias": {"qkv_bias": False},
          "qwen2moe_shared_zero": {"shared_expert_intermediate_size": 0},
          "qwen2moe_ep1_shared": {"shared_expert_intermediate_size": 64},  # at EP 1: the shared expert in the dense
          "persimmon_partial": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
          "persimmon_heads": {"num_attention_heads": 2}, "persimmon_noqk": {"qk_layernorm": False},
          "persimmon_eps_string": {"layer_norm_eps": "1e-5"},
          # Llama 3's RoPE scaling: megatron-core fixes low/high factors 1/4 and 8192 original positions
          "llama3_low": {"rope_parameters": dict(LLAMA3, low_freq_factor=2.0)},
          "llama3_original_bool": {"rope_parameters": dict(LLAMA3, original_max_position_embeddings=True)},
          "llama3_factor_string": {"rope_parameters": dict(LLAMA3, factor="8")},
          "llama3_factor_zero": {"rope_parameters": dict(LLAMA3, factor=0)},
          "rope_yarn": {"rope_parameters": dict(LLAMA3, rope_type="yarn")},
          "rope_scaling_list": {"rope_scaling": [1]}}
# the class each case starts from (else Llama)
BASE = {n: n.split("_")[0] for n in CONFIG if n.split("_")[0] in ("starcoder2", "arcee", "qwen2", "mixtral",
                                                                   "qwen3moe", "qwen2moe", "persimmon")}
BASE.update(mixtral_ep3="mixtral", mixtral_etp2="mixtral", mixtral_etp_tp="mixtral", mixtral_vpp_layers="mixtral",
            mixtral_vpp_ep3="mixtral", mixtral_vpp_pp1="mixtral")
# optimizer files (`export --to hf --optimizer`) whose run state field is hostile, or a state at another shape
SCHED = {"max_lr": 0.001, "min_lr": 0.0, "lr_warmup_steps": 0, "num_steps": 16, "lr_decay_style": "cosine",
         "lr_decay_steps": 800, "start_wd": 0.01, "end_wd": 0.01, "wd_incr_style": "constant", "wd_incr_steps": 800}
OPT_STATE = {"opt_state_not_json": "{'iteration': 2", "opt_state_negative": '{"iteration": -1, "step": 2.0}',
             "opt_state_huge_step": '{"iteration": 2, "step": 1e300}', "opt_state_list": "[1, 2]",
             "opt_state_deep": "[" * 100000 + "]" * 100000, "opt_shape": '{"iteration": 2, "step": 2.0}',
             "opt_sched_list": '{"iteration": 2, "step": 2.0, "scheduler": [1]}',
             "opt_sched_style": '{"iteration": 2, "step": 2.0, "scheduler": ' + json.dumps(dict(
                 SCHED, lr_decay_style="exp")) + '}',
             "opt_sched_negative": '{"iteration": 2, "step": 2.0, "scheduler": ' + json.dumps(dict(
                 SCHED, num_steps=-1)) + '}',
             "opt_sched_nan": '{"iteration": 2, "step": 2.0, "scheduler": ' + json.dumps(dict(
                 SCHED, max_lr=float("nan"))) + '}',
             "opt_consumed_huge": '{"iteration": 2, "step": 2.0, "consumed_train_samples": 1e30}',
             # the rule inputs the scheduler's state leaves out, and the rates computed from them
             "opt_sched_args_list": '{"iteration": 2, "step": 2.0, "scheduler": ' + json.dumps(SCHED) +
             ', "lr_schedule_args": [1]}',
             "opt_sched_args_style": '{"iteration": 2, "step": 2.0, "scheduler": ' + json.dumps(SCHED) +
             ', "lr_schedule_args": {"lr_wsd_decay_style": "exp"}}',
             "opt_sched_args_steps": '{"iteration": 2, "step": 2.0, "scheduler": ' + json.dumps(SCHED) +
             ', "lr_schedule_args": {"wsd_decay_steps": 1e300}}',
             "opt_sched_wsd_unknown": '{"iteration": 2, "step": 2.0, "scheduler": ' + json.dumps(dict(
                 SCHED, lr_decay_style="WSD")) + '}',
             "opt_sched_warmup_huge": '{"iteration": 2, "step": 2.0, "scheduler": ' + json.dumps(dict(
                 SCHED, lr_warmup_steps=1e300)) + '}',
             "opt_adam_betas": '{"iteration": 2, "step": 2.0, "adam": {"betas": [0.9, 2.0], "eps": 1e-8}}',
             "opt_sched_wd_zero_steps": '{"iteration": 2, "step": 2.0, "scheduler": ' + json.dumps(dict(
                 SCHED, num_steps=0, wd_incr_style="linear", end_wd=0.1, wd_incr_steps=0)) + '}'}
# cases refused by a topology option, not the config
OPTIONS = {"mixtral_ep3": ["--ep", "3"], "mixtral_etp2": ["--ep", "2", "--etp", "2", "--dp", "2"],
           "qwen2moe_ep1_shared": ["--tp", "2", "--ep", "1", "--etp", "2"],
           "mixtral_etp_tp": ["--ep", "1", "--etp", "2", "--dp", "2"],
           "dense_ep2": ["--ep", "2", "--dp", "2"], "vpp_layers": ["--pp", "2", "--vpp", "2"],
           # virtual pipeline stages with experts: 2 layers in 4 model chunks, experts EP 3 does not divide, no
           # pipeline to interleave over
           "mixtral_vpp_layers": ["--pp", "2", "--vpp", "2", "--ep", "2", "--dp", "2"],
           "mixtral_vpp_ep3": ["--pp", "2", "--vpp", "2", "--ep", "3", "--dp", "3"],
           "mixtral_vpp_pp1": ["--vpp", "2", "--ep", "2", "--dp", "2"]}
WORDS = {"layers_huge": "says 1000000000 layers", "heads_huge": "config.json implies", "vocab_huge": "config.json "
         "implies", "head_dim_zero": "head_dim is 0", "hidden_string": "hidden_size is '64'",
         "eps_negative": "epsilon is -1.0", "layers_bool": "num_hidden_layers is True",
         "arch_many": "config.json", "ffn_disagrees": "config.json implies [96, 64]",
         "rope_list": "rope_parameters is [1, 2]", "deep": "config.json", "header_huge": "header of",
         "offsets_past": "spans bytes", "overlap": "overlap", "bad_dtype": "ill-formed header entry",
         "index_outside": "plain file name", "two_files": "also in", "symlink_out": "symlink",
         "f16": "float32 or bfloat16", "starcoder2_window": "sliding-window attention",
         "starcoder2_nobias": "the weights do not belong to this config",
         "starcoder2_ffn": "'model.layers.0.mlp.c_fc.weight' is [128, 64], config.json implies [96, 64]",
         "arcee_silu": "hidden_act 'silu' has no megatron-core form", "arcee_heads": "config.json implies [64, 64]",
         "qwen2_window": "sliding-window attention", "qwen2_types_string": "layer_types is 'full_attention'",
         "mixtral_experts": "i.e. 65 tensors, but the folder holds 41", "mixtral_topk": "num_experts_per_tok 5 is more",
         "mixtral_ffn": "'model.layers.0.block_sparse_moe.experts.0.w1.weight' is [32, 64], config.json implies [48",
         "mixtral_window": "sliding-window attention", "mixtral_experts_huge": "the folder holds 41",
         "qwen3moe_dense": "dense layers between MoE layers", "qwen3moe_step": "dense layers between MoE layers",
         "qwen3moe_experts_string": "num_local_experts is '4'", "mixtral_ep3": "--ep 3 does not divide the model's 4",
         "mixtral_etp2": "pass --etp 1",
         "qwen2moe_ep1_shared": "'model.layers.0.mlp.shared_expert.gate_proj.weight' is [48, 64], config.json "
                                "implies [64",
         "mixtral_etp_tp": "--etp 2: the experts are gated",
         "dense_ep2": "the model has no experts", "vpp_layers": "--pp 2 x --vpp 2 = 4 model chunks do not divide",
         "mixtral_vpp_layers": "--pp 2 x --vpp 2 = 4 model chunks do not divide the 2 layers",
         "mixtral_vpp_ep3": "--ep 3 does not divide the model's 4 experts", "mixtral_vpp_pp1": "--vpp 2 needs --pp > 1",
         "qwen2moe_shared": "'model.layers.0.mlp.shared_expert.gate_proj.weight' is [48, 64], config.json implies [64",
         "qwen2moe_qkv_bias": "the weights do not belong to this config",
         "qwen2moe_shared_zero": "shared_expert_intermediate_size is 0",
         "persimmon_partial": "partial_rotary_factor 0.5", "persimmon_noqk": "qk_layernorm false",
         "persimmon_heads": "'model.layers.0.self_attn.q_layernorm.weight' is [16], config.json implies [32]",
         "persimmon_eps_string": "epsilon is '1e-5'", "llama3_low": "rope_parameters.low_freq_factor is 2.0",
         "llama3_original_bool": "rope_parameters.original_max_position_embeddings is True",
         "llama3_factor_string": "rope_parameters.factor is '8'", "llama3_factor_zero": "rope_parameters.factor is 0",
         "rope_yarn": "rope_parameters.rope_type 'yarn'", "rope_scaling_list": "rope_scaling is [1]",
         "opt_state_not_json": "gtp_megatron_run_state", "opt_state_negative": "not {'iteration': N",
         "opt_state_huge_step": "not {'iteration': N", "opt_state_list": "not {'iteration': N",
         "opt_state_deep": "optimizer.safetensors opens", "opt_shape": "the model implies [64] float32",
         "opt_sched_list": "scheduler is 'list', not megatron-core's",
         "opt_sched_style": "scheduler lr_decay_style is 'exp', not one of constant",
         "opt_sched_negative": "scheduler num_steps is '-1', not a count",
         "opt_sched_nan": "optimizer*.safetensors (gtp_megatron_run_state)",  # NaN is no JSON: refused there
         "opt_consumed_huge": "consumed_train_samples is '1e+30', not a count",
         "opt_sched_args_list": "lr_schedule_args is '[1]', not a map of",
         "opt_sched_args_style": "lr_schedule_args lr_wsd_decay_style is 'exp'",
         "opt_sched_args_steps": "lr_schedule_args wsd_decay_steps is '1e+300'",
         "opt_sched_wsd_unknown": "a WSD schedule at step 16, and the source's args record no",
         "opt_sched_warmup_huge": "scheduler lr_warmup_steps is '1e+300', not a count",
         "opt_sched_wd_zero_steps": "linear weight decay over wd_incr_steps 0",
         "opt_adam_betas": "gtp_megatron_run_state adam is"}


def _st(path: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)


def _base(root: Path, kind: str = "llama") -> Path:
    torch.manual_seed(0)
    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=128, bos_token_id=None, eos_token_id=None)
    cls = {"llama": "Llama", "starcoder2": "Starcoder2", "arcee": "Arcee", "qwen2": "Qwen2", "mixtral": "Mixtral",
           "qwen3moe": "Qwen3Moe", "qwen2moe": "Qwen2Moe", "persimmon": "Persimmon"}[kind]
    moe = {"mixtral": dict(num_local_experts=4, intermediate_size=32),
           "qwen3moe": dict(num_experts=4, moe_intermediate_size=32, num_experts_per_tok=2),
           "qwen2moe": dict(num_experts=4, moe_intermediate_size=32, num_experts_per_tok=2,
                            shared_expert_intermediate_size=48),
           "persimmon": dict(partial_rotary_factor=1.0, hidden_act="gelu")}.get(kind, {})
    if kind == "persimmon":  # MHA only: no num_key_value_heads
        sizes.pop("num_key_value_heads")
    model = getattr(transformers, f"{cls}ForCausalLM")(getattr(transformers, f"{cls}Config")(**{**sizes, **moe}))
    model.save_pretrained(root)
    return root


def _build(root: Path, dst_root: Path, base: Path) -> list[Case]:
    cases = []
    bases = {k: _base(base.parent / k, k) for k in set(BASE.values())}
    for name in WORDS:
        folder = root / name
        run = folder / "run"
        shutil.copytree(bases.get(BASE.get(name, ""), base), run)
        st = run / "model.safetensors"
        if name in CONFIG:
            cfg = json.loads((run / "config.json").read_text())
            cfg.update(CONFIG[name])
            (run / "config.json").write_text(json.dumps(cfg))
        elif name == "deep":
            (run / "config.json").write_text("[" * 100000 + "]" * 100000)
        elif name == "header_huge":
            st.write_bytes((10**12).to_bytes(8, "little") + b"{}")
        elif name in ("offsets_past", "overlap", "bad_dtype"):
            entry = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
            header = {"a": {**entry, "data_offsets": [0, 1 << 40], "shape": [1 << 38]} if name == "offsets_past"
                      else entry, "b": entry if name == "overlap" else {**entry, "data_offsets": [16, 32]}}
            if name == "bad_dtype":
                header["a"] = {**entry, "dtype": {"x": 1}}
            _st(st, header, b"\0" * 32)
        elif name == "index_outside":
            (run / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {}, "weight_map": {"lm_head.weight": "../outside.safetensors"}}))
            (folder / "outside.safetensors").write_bytes(st.read_bytes())
        elif name == "two_files":
            shutil.copy(st, run / "model-00002-of-00002.safetensors")
            st.rename(run / "model-00001-of-00002.safetensors")
            (run / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {}, "weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors",
                                                "model.norm.weight": "model-00002-of-00002.safetensors"}}))
        elif name == "symlink_out":
            st.rename(folder / "outside.safetensors")
            st.symlink_to(folder / "outside.safetensors")
        elif name in OPT_STATE:
            from safetensors.torch import load_file, save_file

            opt = {f"optimizer.state.{s}.{k}": v.float().clone() for k, v in load_file(st).items()
                   for s in ("param", "exp_avg", "exp_avg_sq")}
            if name == "opt_shape":
                opt["optimizer.state.exp_avg.model.norm.weight"] = torch.zeros(65)
            save_file(opt, run / "optimizer.safetensors", metadata={"gtp_megatron_run_state": OPT_STATE[name]})
        elif name == "f16":
            from safetensors.torch import load_file, save_file

            save_file({k: v.half() for k, v in load_file(st).items()}, st)
        dst = dst_root / name
        dst.mkdir(parents=True)
        argv = ["import", str(run), str(dst / "out"), "--from", "hf", "--to", "megatron-core", "--tp", "1",
                *OPTIONS.get(name, [])]
        cases.append(Case(name, "hf-import", "run", [argv], False, dir=str(folder),
                          notes={"dst": str(dst), "words": WORDS[name]}))
    return cases


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    base = _base(tmp_path_factory.mktemp("hf-base") / "llama")
    root = tmp_path_factory.mktemp("hostile-hf-import")
    cases = _build(root, tmp_path_factory.mktemp("hostile-hf-import-dst"), base)  # DSTs outside the corpus
    return _run_batch("ckpt", root, cases, lambda c: c.commands, CKPT_TIMEOUT_S), {c.name: c for c in cases}


@pytest.mark.parametrize("name", sorted(WORDS))
def test_a_hostile_hf_folder_is_refused(results: tuple[dict, dict], name: str) -> None:
    got, cases = results
    r, case = got[f"{name}-0"], cases[name]
    _check(r, "ckpt: error: ", CKPT_TIMEOUT_S, False)
    assert r["exit"] == 2, (r["argv"], r["stderr"])
    assert case.notes["words"] in r["stderr"], (r["argv"], r["stderr"])
    dst = Path(case.notes["dst"])
    assert list(dst.iterdir()) == [], f"{r['argv']}: left {sorted(p.name for p in dst.iterdir())} at DST"


@pytest.mark.parametrize("swap", ["symlink_out", "truncated", "removed"])
def test_the_read_ahead_hint_of_a_swapped_weights_file_reads_nothing_outside(tmp_path: Path, swap: str,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The import's read-ahead (``Tensor.will_need``) opens the weights file again by name: a file swapped after
    the folder was read (a symlink to a file outside, cut short, gone) gets no advice outside the folder and no
    error from the hint; the read that follows is what refuses it."""
    import os

    from ckpt_tool.hf.folder import read_folder
    from gtp_format.errors import FormatError

    src = _base(tmp_path / "hf")
    _, tensors = read_folder(src)
    t = tensors["model.embed_tokens.weight"]
    advised: list[int] = []
    real = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: advised.append(fd) or real(fd, off, n, advice))
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"\0" * 4096)
    if swap == "symlink_out":
        t.file.unlink()
        t.file.symlink_to(outside)
    elif swap == "truncated":
        os.truncate(t.file, 8)
    else:
        t.file.unlink()
    t.will_need(0, t.shape[0])
    if swap != "truncated":
        assert advised == []
    with pytest.raises(FormatError):
        t.read_rows(0, t.shape[0])
