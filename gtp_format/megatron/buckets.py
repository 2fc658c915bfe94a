"""megatron-core's bucket rules, as a ``dp_reshardable`` checkpoint of it shows them.

megatron-core's ``_ParamAndGradBuffer.__init__`` (``megatron/core/distributed/param_and_grad_buffer.py``),
checked against megatron-core 0.19.2 (the version that wrote ``fixtures/megatron``) and the
Megatron-LM main branch source:

1. a buffer holds the params of one (param dtype, grad dtype) in module order, and lays them out
   **in reverse order**; a stage with params of several dtypes has one buffer each, numbered in
   order of first appearance (:func:`stage_buffers`), and every rule below holds per buffer;
2. with the distributed optimizer each param **starts at a multiple of 64** elements;
3. a bucket closes after the param that brings it to ``bucket_size`` elements, and is padded at
   its end to ``lcm(dp, 128)``, which is not stored (the key's shape is the unpadded numel);
4. with PP > 1 and tied embeddings, the *shared embedding* (``word_embeddings`` on the first
   stage, ``output_layer`` on the last, megatron's ``shared_embedding`` attribute) gets a bucket of
   its own: the bucket before it is closed, and it closes its own.

``bucket_size`` is not recorded, so bucket boundaries are taken from the keys' own shapes (each
bucket key's global shape is its unpadded numel). Every placed slice is then checked against the
optimizer key's chunks (:func:`check_chunks`): megatron-core writes one chunk per parameter slice
(split only at DP-rank boundaries) and one per alignment gap. The per-parameter view
(:mod:`gtp_format.megatron.view`) places its parameters by these rules; the target layout of a
reshard (:mod:`gtp_format.megatron.layout`) applies the same rules at another topology.
"""

from __future__ import annotations

from bisect import bisect_right

from gtp_format.layout.shard import ShardSpec
from gtp_format.megatron.keys import refusal
from gtp_format.model import Checkpoint

PARAM_ALIGN = 64


def param_dtype(dtag: str) -> str:
    """``torch.bfloat16`` of the key tag ``(torch.bfloat16, torch.float32)`` (param dtype, grad dtype)."""
    return dtag.strip("()").split(",")[0].strip()


def stage_buffers(ckpt: Checkpoint, names: list[str], info: dict, dtags: dict[tuple[int, int], str], stage: int,
                   tp: int, chunk_of: dict[str, int]) -> list[tuple[int, str, list[str]]]:
    """(gbuf_idx, dtype tag, its params in module order) of one stage's buffers.

    megatron-core (``group_params_for_buffers``) makes one buffer per (param dtype, grad dtype) in
    the order each first appears in ``named_parameters()`` (module order), and ``grad_reduce_in_fp32``
    gives every buffer one grad dtype, so a param's buffer is the one of its model key's dtype: with
    the layernorms kept in fp32 after the bf16 cast, stage 0 (embeddings first) has ``gbuf_idx_0``
    (bf16, fp32) and ``gbuf_idx_1`` (fp32, fp32), a stage that starts with a layernorm the reverse
    (``fixtures/megatron/pair_fp32norm_dp2_dp_reshardable``). With virtual pipeline stages every
    model chunk has its own DDP and buffers, and the one ``DistributedOptimizer`` numbers them
    chunk after chunk (``chain(*per_model_buffers.values())``): chunk 0's buffers, then chunk 1's,
    the same dtype tag once per chunk (``pair_vpp_pp2_dp2_dp_reshardable``). What the keys hold must
    be exactly that, on every TP rank of the stage, or the rules do not describe this checkpoint.
    """
    groups: list[tuple[str, list[str]]] = []  # per gbuf: (param dtype, its params), chunk by chunk
    for c in sorted({chunk_of[name] for name in names}):
        members: dict[str, list[str]] = {}
        for name in names:
            if chunk_of[name] == c:
                members.setdefault(str(ckpt.entries[info[name][0]].dtype), []).append(name)
        groups += list(members.items())
    order = [dt for dt, _ in groups]
    for t in range(tp):
        have = {g: d for (n, g), d in dtags.items() if n == stage * tp + t}
        want = [param_dtype(have.get(g, "")) for g in range(len(have))]
        if want != order:
            raise refusal(ckpt, f"the buffers of dp_group_idx_{stage * tp + t} hold param dtypes {want}, but its "
                          f"model keys in module order give {order} (one buffer per dtype and model chunk, in order "
                          "of appearance)")
    return [(g, dtags[(stage * tp, g)], members) for g, (_, members) in enumerate(groups)]


def place_buffer(ckpt: Checkpoint, names: list[str], info: dict, numel: dict[tuple[int, int, int], int],
                  shared: set[str], stage: int, gbuf: int, tp_size: int,
                  placed: list[tuple[str, int, int, int, int, int]],
                  keys: dict[tuple[int, int, int], str] | None = None) -> None:
    """Lay out one buffer's params (module order) in its buckets, by the rules of the module docstring;
    ``keys``: each (dp_group_idx, gbuf, bucket)'s key, named where the params and the bucket disagree."""
    def key(b: int) -> str:
        return (keys or {}).get((n0, gbuf, b), f"bucket {b}")

    n0 = stage * tp_size
    buckets = sorted(b for (n, g, b) in numel if n == n0 and g == gbuf)
    for t in range(1, tp_size):
        if sorted(b for (n, g, b) in numel if n == n0 + t and g == gbuf) != buckets or any(
                numel[(n0 + t, gbuf, b)] != numel[(n0, gbuf, b)] for b in buckets):
            raise refusal(ckpt, f"TP ranks of pipeline stage {stage} disagree on the buckets of gbuf_idx_{gbuf}")
    if buckets != list(range(len(buckets))):
        raise refusal(ckpt, f"gbuf_idx_{gbuf} of pipeline stage {stage} has buckets {buckets[:8]}, not "
                      f"0..{len(buckets) - 1}")
    b, pos = 0, 0
    where = f"of gbuf_idx_{gbuf} of stage {stage}"
    for name in reversed(names):
        _key, _layer, mode, full = info[name]
        n = 1
        for d in ShardSpec(full, mode, tp_size, 0, None, 1, 0, 1).local_shape:
            n *= d
        if name in shared and pos:  # megatron-core: the shared embedding gets a bucket of its own
            raise refusal(ckpt, f"{name} shares bucket {b} {where} with other parameters")
        start = -(-pos // PARAM_ALIGN) * PARAM_ALIGN
        have = numel.get((n0, gbuf, b))
        if have is None or start + n > have:
            raise refusal(ckpt, f"{name} does not fit bucket {b} {where}: {key(b)} holds {have} elements")
        placed.append((name, stage, gbuf, b, start, start + n))
        pos = start + n
        if pos == have:
            b, pos = b + 1, 0
        elif name in shared:
            raise refusal(ckpt, f"{name} does not fill bucket {b} {where} alone")
    if pos:  # the last params end inside a bucket: it is larger than they need
        raise refusal(ckpt, f"the parameters {where} end at element {pos} of bucket {b}, but {key(b)} holds "
                      f"{numel[(n0, gbuf, b)]} elements")
    if b != len(buckets):
        raise refusal(ckpt, f"the parameters {where} fill {b} buckets, the checkpoint has {len(buckets)}")


def check_chunks(ckpt: Checkpoint, opts: dict, placed: list[tuple[str, int, int, int, int, int]], tp: int) -> None:
    """Every stored chunk of every bucket key lies inside one derived param slice or one gap.

    The edges of each (stage, gbuf, bucket) are sorted once and each chunk finds the first edge after
    its start by bisection: chunks x log(edges), where a scan of every edge per chunk was quadratic.
    """
    edges: dict[tuple[int, int, int], list[int]] = {}
    for _, stage, g, b, s, e in placed:
        edges.setdefault((stage, g, b), []).extend((s, e))
    cuts_of = {sb: sorted(set(v)) for sb, v in edges.items()}
    for key, o in opts.items():
        cuts = cuts_of.get((o.dp_group_idx // tp, o.gbuf_idx, o.bucket_idx), [])
        for c in ckpt.entries[key].chunks:
            a, z = c.offsets[0], c.offsets[0] + c.sizes[0]
            i = bisect_right(cuts, a)
            if i < len(cuts) and cuts[i] < z:
                raise refusal(ckpt, f"chunk [{a}, {z}) of {key} straddles a derived parameter edge")
