"""Crafted megatron-core MoE checkpoints whose stored chunks disagree on expert TP.

megatron-core writes an expert key (``decoder.layers.mlp.experts.experts.linear_fc1.weight``,
``[layers, experts, out, in]``) as one chunk per (layer, expert) and expert-TP part, every part the
same size, ``linear_fc1`` cut along its output rows and ``linear_fc2`` along its input columns.
Each case here is a copy of a committed fixture with one expert key re-cut so that layers,
experts or the two projections disagree on that split (or cut it along the wrong axis, or in
unequal parts). The copy is rewritten through the format package's own writers
(:func:`gtp_format.writer.torch_blob.tensor_blob` for the new chunks, whose elements are the
fixture's own, read with :class:`gtp_format.reader.boxes.BoxReader`;
:func:`gtp_format.writer.dcp_metadata.metadata_bytes` for ``.metadata``), never pickled by hand:
every byte of it is a well-formed DCP checkpoint, only its layout is one megatron-core never saves. The EP 1
param-group cases rewrite the optimizer objects through torch's pickler
(:func:`ckpt_tool.hf.megatron_fresh.torch_object`) and the same ``.metadata`` writer.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from gtp_format.model import TENSOR
from gtp_format.reader.boxes import BoxReader
from gtp_format.reader.checkpoint import open_checkpoint
from gtp_format.writer.dcp_metadata import metadata_bytes
from gtp_format.writer.torch_blob import tensor_blob

MEGATRON = Path(__file__).resolve().parents[2] / "fixtures" / "megatron"
FC1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
FC2 = "decoder.layers.mlp.experts.experts.linear_fc2.weight"
Box = tuple[tuple[int, ...], tuple[int, ...]]


def rechunk(it: Path, key: str, cut: Callable[[Box], list[Box]]) -> None:
    """Replace each chunk of ``key`` in the checkpoint folder ``it`` by the boxes ``cut`` returns for it
    (together they must tile the same elements; boxes may also join several chunks: see :func:`merge`).
    Every data file holding a chunk of ``key`` is rewritten: the other records' bytes as they were, then a
    ``torch.save`` blob per new box; ``.metadata`` is rewritten for the new placement."""
    ckpt = open_checkpoint(it)
    reader = BoxReader(ckpt)
    entry = ckpt.entries[key]
    new: dict[str, list[tuple[Box, bytes]]] = {}
    seen: set[Box] = set()
    for c in entry.chunks:
        for box in cut((c.offsets, c.sizes)):
            if box in seen:
                continue
            seen.add(box)
            data = reader.read_box(key, *box)
            new.setdefault(c.storage.file, []).append((box, tensor_blob(entry.dtype, box[1], data)))
    reader.close()
    placed = []
    for file in sorted(ckpt.data_files):
        raw = (it / file).read_bytes()
        items = sorted(((c.storage.offset, c.storage.length, e, c) for e in ckpt.entries.values() for c in e.chunks
                        if c.storage is not None and c.storage.file == file), key=lambda x: x[0])
        out = bytearray()
        for off, length, e, c in items:
            if e.key == key:
                continue
            placed.append((file, e.key, c.offsets if e.kind == TENSOR else None,
                           c.sizes if e.kind == TENSOR else None, len(out), length))
            out += raw[off:off + length]
        for (offsets, sizes), blob in new.get(file, []):
            placed.append((file, key, offsets, sizes, len(out), len(blob)))
            out += blob
        if file in new:
            tmp = it / (file + ".new")
            tmp.write_bytes(out)
            os.replace(tmp, it / file)
    shapes = {k: (e.shape, e.dtype) for k, e in ckpt.entries.items() if e.kind == TENSOR}
    objects = [k for k, e in ckpt.entries.items() if e.kind != TENSOR]
    (it / ".metadata").write_bytes(metadata_bytes(shapes, placed, objects))


def split(axis: int, parts: int | tuple[int, ...]) -> Callable[[Box], list[Box]]:
    """Cut a box along ``axis`` in ``parts`` equal parts, or in the given sizes."""
    def cut(box: Box) -> list[Box]:
        (o, s) = box
        sizes = parts if isinstance(parts, tuple) else (s[axis] // parts,) * parts
        out, at = [], o[axis]
        for n in sizes:
            out.append(((*o[:axis], at, *o[axis + 1:]), (*s[:axis], n, *s[axis + 1:])))
            at += n
        return out
    return cut


def only(pick: Callable[[Box], bool], cut: Callable[[Box], list[Box]]) -> Callable[[Box], list[Box]]:
    """``cut`` the boxes ``pick`` selects; keep the others."""
    return lambda box: cut(box) if pick(box) else [box]


def merge(axis: int) -> Callable[[Box], list[Box]]:
    """Join the expert-TP parts of each (layer, expert) along ``axis`` back into one box (the whole extent)."""
    def cut(box: Box) -> list[Box]:
        (o, s) = box
        return [((*o[:axis], 0, *o[axis + 1:]), (*s[:axis], s[axis] * 2, *s[axis + 1:]))]
    return cut


def layer(n: int) -> Callable[[Box], bool]:
    return lambda box: box[0][0] == n


def expert(n: int) -> Callable[[Box], bool]:
    return lambda box: box[0][1] == n


# name -> (fixture, [(key, cut)], what the case is)
MOE_CASES: dict[str, tuple[str, list[tuple[str, Callable[[Box], list[Box]]]], str]] = {
    "etp_one_layer_split": ("moe_ep2_dp4_dp_reshardable", [(FC1, only(layer(1), split(2, 2)))],
                            "layer 1's experts at expert TP 2, layer 0's at 1"),
    "etp_one_expert_split": ("moe_ep2_dp4_dp_reshardable", [(FC1, only(expert(1), split(2, 2)))],
                             "expert 1 of every layer at expert TP 2, the others at 1"),
    "etp_one_expert_merged": ("pair_moe_tp2_etp2_dp_reshardable", [(FC1, only(expert(0), merge(2)))],
                              "expert 0 whole, the others in two expert-TP parts"),
    "etp_fc1_split_fc2_whole": ("pair_moe_ep2_dp_reshardable", [(FC1, split(2, 2))],
                                "linear_fc1 at expert TP 2, linear_fc2 at 1"),
    "etp_split_wrong_axis": ("pair_moe_ep2_dp_reshardable", [(FC1, split(3, 2)), (FC2, split(2, 2))],
                             "linear_fc1 cut along its input columns, linear_fc2 along its output rows"),
    "etp_split_unequal": ("pair_moe_ep2_dp_reshardable", [(FC1, only(expert(0), split(2, (8, 24))))],
                          "one (layer, expert) in parts of 8 and 24 rows"),
    # EP 1 with expert TP = TP (the experts in the dense buffers: export --to hf --optimizer reads them there)
    "dense_expert_fc2_four_parts": ("pair_mixtral_tp2_ep1_dp_reshardable", [(FC2, only(expert(1), split(3, 2)))],
                                    "expert 1's linear_fc2 in 4 column parts at TP 2, the others in 2"),
}


# EP 1 with expert TP = TP, the experts and Qwen2-MoE's shared expert in the dense buffer
# (pair_qwen2moe_tp2_ep1): buffers that disagree with that layout. name -> (fixture, words of the refusal)
EP1 = "pair_qwen2moe_tp2_ep1_dp_reshardable"
BUCKET = "optimizer.distributed.dp_group_idx_{}.gbuf_idx_0.dtype_(torch.bfloat16, torch.float32).bucket_idx_0.{}"
SHARED_FC1, SHARED_GATE = (2880, 1536), (4416, 32)  # the shared expert's linear_fc1 and gate_weight in that buffer
EP1_CASES: dict[str, tuple[str, str]] = {
    # the bucket keys and per_bucket_numel[_unpadded] of both TP ranks 128 elements longer than the params need
    "ep1_buffer_longer": (EP1, "bucket_idx_0.param holds 14656 elements"),
    # the shared expert's linear_fc1 and gate_weight stored as one chunk of the bucket (megatron-core: one each)
    "ep1_shared_chunk_straddles": (EP1, "straddles a derived parameter edge"),
}
# EP 1 param groups that the expert optimizer of the chained pair is made from (reshard to EP 2: the SwiGLU experts
# have no bias, so the no-decay group is left out), written anew by torch's pickler (megatron_fresh.torch_object):
# name -> (the groups' edit, words of the refusal)
EP1_GROUP_CASES: dict[str, str] = {
    "ep1_groups_wd_string": "record no float wd_mult",  # wd_mult '0.0', a string
    "ep1_groups_no_decay_first": "share memo entries between groups",  # the no-decay group first: its keys' memo
}


def rewrite(it: Path, shapes: dict[str, tuple], tails: dict[str, list[tuple[str, bytes, tuple[int, ...] | None,
                                                                             tuple[int, ...] | None]]],
            new: dict[str, bytes]) -> None:
    """``.metadata`` of ``it`` anew: the byte objects ``new`` and the chunks ``tails`` appended to their files
    (``tails``: per file, (key, blob, offsets, sizes)), every other chunk where it is; ``shapes``: each tensor key's
    (global shape, dtype)."""
    ckpt = open_checkpoint(it)
    placed = []
    for k, e in ckpt.entries.items():
        for c in e.chunks:
            offsets, sizes = (c.offsets, c.sizes) if e.kind == TENSOR else (None, None)
            if k in new:
                tails.setdefault(c.storage.file, []).append((k, new[k], offsets, sizes))
            else:
                placed.append((c.storage.file, k, offsets, sizes, c.storage.offset, c.storage.length))
    for file, items in tails.items():
        at = (it / file).stat().st_size
        with open(it / file, "ab") as f:
            for k, blob, offsets, sizes in items:
                f.write(blob)
                placed.append((file, k, offsets, sizes, at, len(blob)))
                at += len(blob)
    objects = [k for k, e in ckpt.entries.items() if e.kind != TENSOR]
    (it / ".metadata").write_bytes(metadata_bytes(shapes, placed, objects))


def grow_buckets(it: Path, delta: int) -> None:
    """Every ``gbuf_idx_0`` bucket key ``delta`` elements longer, the tail stored as a chunk of zeros in its rank's
    file, and ``per_bucket_numel[_unpadded]`` saying so (written anew by
    :func:`ckpt_tool.copying.megatron_blobs.numel_blob`): a complete, consistent DCP checkpoint whose buffers are
    larger than the layout of its parameters."""
    import numpy as np

    from ckpt_tool.copying.megatron_blobs import numel_blob
    from gtp_format.reader.chunks import chunk_bytes

    ckpt = open_checkpoint(it)
    grown = {k for k, e in ckpt.entries.items() if e.kind == TENSOR and ".gbuf_idx_0." in k}
    shapes = {k: ((e.shape[0] + delta, *e.shape[1:]) if k in grown else tuple(e.shape), e.dtype)
              for k, e in ckpt.entries.items() if e.kind == TENSOR}
    tails: dict[str, list[tuple[str, bytes, tuple[int, ...] | None, tuple[int, ...] | None]]] = {}
    for k in sorted(grown):
        e = ckpt.entries[k]
        last = max(e.chunks, key=lambda c: c.offsets[0])
        blob = tensor_blob(e.dtype, (delta,), np.zeros(delta, np.float32))
        tails.setdefault(last.storage.file, []).append((k, blob, (e.shape[0],), (delta,)))
    new: dict[str, bytes] = {}
    for k, e in ckpt.entries.items():
        if e.kind != TENSOR and ".per_bucket_numel" in k:
            n = shapes[BUCKET.format(k.split("dp_group_idx_")[1].split(".")[0], "param")][0][0]
            new[k] = numel_blob(str(it), k, bytes(chunk_bytes(ckpt, e, e.chunks[0])),
                                [("(torch.bfloat16, torch.float32)", [n])])
    rewrite(it, shapes, tails, new)


def build_ep1_groups(name: str, it: Path) -> None:
    """Rewrite the copy ``it`` (an ``iter_*`` folder of :data:`EP1`) as case ``name`` of :data:`EP1_GROUP_CASES`:
    every ``optimizer.distributed.dp_group_idx_N.optimizer`` object's param groups (megatron-core's two, the decay
    group then the no-decay one) edited and pickled anew."""
    from ckpt_tool.hf.megatron_fresh import torch_object
    from gtp_format.reader.inert_object import load_record

    ckpt = open_checkpoint(it)
    new: dict[str, bytes] = {}
    for k, e in ckpt.entries.items():
        if e.kind != TENSOR and k.startswith("optimizer.distributed.") and k.endswith(".optimizer/shard_0_1"):
            groups = [dict(g) for g in load_record(ckpt, e)[0]["param_groups"]]
            if name == "ep1_groups_wd_string":
                groups[1]["wd_mult"] = "0.0"
            else:
                groups.reverse()
            new[k] = torch_object([{"param_groups": groups}])
    shapes = {k: (tuple(e.shape), e.dtype) for k, e in ckpt.entries.items() if e.kind == TENSOR}
    rewrite(it, shapes, {}, new)


def build_ep1(name: str, it: Path) -> None:
    """Rewrite the copy ``it`` (an ``iter_*`` folder of :data:`EP1`) as case ``name`` of :data:`EP1_CASES`."""
    if name == "ep1_buffer_longer":
        grow_buckets(it, 128)
        return
    joined = ((SHARED_FC1[0],), (SHARED_FC1[1] + SHARED_GATE[1],))
    for state in ("param", "exp_avg", "exp_avg_sq"):
        rechunk(it, BUCKET.format(0, state), lambda box: [joined] if box[0][0] in (SHARED_FC1[0], SHARED_GATE[0])
                else [box])


def build_moe(name: str, it: Path) -> None:
    """Rewrite the copy ``it`` (an ``iter_*`` folder of the case's fixture) as case ``name``."""
    for key, cut in MOE_CASES[name][1]:
        rechunk(it, key, cut)
