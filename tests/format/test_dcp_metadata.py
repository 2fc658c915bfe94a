"""``gtp_format.writer.dcp_metadata`` pickles the ``Metadata`` DCP's ``FileSystemWriter`` pickles.

Unpickled with torch, it equals the same ``Metadata`` built from torch's own classes, field for
field (including ``TensorProperties``' dtype, layout and memory format); ``ckpt``'s allow-listing
reader reads it as it reads DCP's own.
"""

from __future__ import annotations

import pickle

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from gtp_format.dtypes import by_name
from gtp_format.reader.safe_pickle import load_metadata_pickle
from gtp_format.writer.dcp_metadata import metadata_bytes

SHAPES = {"a": ((8, 4), by_name("float32")), "b": ((3,), by_name("int64")), "c": ((4, 2), by_name("bfloat16")),
          "d" * 300: ((10**10, 5, 6, 7), by_name("float8_e4m3fn")), "e": ((2,), by_name("float32"))}
PLACED = [("__0_0.distcp", "a", (0, 0), (4, 4), 0, 900), ("__1_0.distcp", "a", (4, 0), (4, 4), 0, 900),
          ("__0_0.distcp", "b", (0,), (3,), 900, 700), ("__1_0.distcp", "c", (0, 0), (4, 2), 900, 500),
          ("__1_0.distcp", "d" * 300, (0, 0, 0, 0), (10**10, 5, 6, 7), 2**40, 2**40 + 5),
          ("__0_0.distcp", "e", (1,), (1,), 70000, 66000), ("__0_0.distcp", "e", (0,), (1,), 1600, 900)]


def _torch_metadata() -> Metadata:
    sdm = {k: TensorStorageMetadata(properties=TensorProperties(dtype=dt.torch), size=torch.Size(shape),
                                    chunks=[ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s))
                                            for _, key, o, s, _, _ in PLACED if key == k])
           for k, (shape, dt) in SHAPES.items()}
    storage = {MetadataIndex(k, torch.Size(o)): _StorageInfo(f, at, n) for f, k, o, _, at, n in PLACED}
    return Metadata(state_dict_metadata=sdm, planner_data={k: (k,) for k in SHAPES}, storage_data=storage)


def test_unpickles_to_torch_metadata() -> None:
    ours = pickle.loads(metadata_bytes(SHAPES, PLACED))
    theirs = _torch_metadata()
    assert type(ours) is Metadata and ours == theirs
    for k in SHAPES:  # dataclass == compares these too; spelled out for what __setstate__ restores
        p, q = ours.state_dict_metadata[k].properties, theirs.state_dict_metadata[k].properties
        assert (p.dtype, p.layout, p.memory_format, p.requires_grad, p.pin_memory) == \
            (q.dtype, q.layout, q.memory_format, q.requires_grad, q.pin_memory)
    stored = pickle.loads(pickle.dumps(theirs))  # what DCP's reader gets from FileSystemWriter's file
    assert [vars(i) for i in ours.storage_data.values()] == [vars(i) for i in stored.storage_data.values()]
    assert list(ours.storage_data) == list(theirs.storage_data)


def test_allow_listing_reader_reads_it() -> None:
    md = load_metadata_pickle(metadata_bytes(SHAPES, PLACED), ".metadata")
    sdm = md.get("state_dict_metadata")
    assert list(sdm) == list(SHAPES)
    assert [tuple(c.get("sizes")) for c in sdm["a"].get("chunks")] == [(4, 4), (4, 4)]
    assert len(md.get("storage_data")) == len(PLACED)


def test_byte_objects_unpickle_as_dcp_writes_them() -> None:
    """Byte objects (megatron-core's common_state, _extra_state): a ``BytesStorageMetadata`` each,
    indexed by name alone (``MetadataIndex(fqn)``, offset None), as DCP's planner writes them."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    objects = ["common_state/shard_0_1", "x._extra_state/shard_1_2"]
    placed = [*PLACED, ("__2_0.distcp", objects[0], None, None, 0, 3000),
              ("__2_0.distcp", objects[1], None, None, 3000, 700)]
    ours = pickle.loads(metadata_bytes(SHAPES, placed, objects))
    theirs = _torch_metadata()
    theirs.state_dict_metadata.update({k: BytesStorageMetadata() for k in objects})
    theirs.planner_data.update({k: (k,) for k in objects})
    theirs.storage_data.update({MetadataIndex(objects[0]): _StorageInfo("__2_0.distcp", 0, 3000),
                                MetadataIndex(objects[1]): _StorageInfo("__2_0.distcp", 3000, 700)})
    assert ours == theirs and list(ours.state_dict_metadata) == list(theirs.state_dict_metadata)
    md = load_metadata_pickle(metadata_bytes(SHAPES, placed, objects), ".metadata")
    assert list(md.get("state_dict_metadata")) == [*SHAPES, *objects]
