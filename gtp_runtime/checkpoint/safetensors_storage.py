"""A pickle-free DCP storage layout: safetensors data files plus a JSON index.

Why not DCP's own ``HuggingFaceStorageWriter``: it names each tensor by its key alone, so a rank
that holds two chunks of one key (every bucket state of the distributed optimizer does) keeps
only the last one; we verified that with torch 2.13. This writer plugs into the same DCP planning
(replica de-duplication) and stores:

* ``__{rank}_0.safetensors``: the chunks this rank writes, each named ``{key}@{offsets}``;
* ``index.json``: every key's dtype, global shape and chunks (offsets, sizes, file, tensor name),
  written last by the coordinator. It replaces DCP's pickled ``.metadata``.

Nothing in either file is executable; a reader needs only JSON and safetensors headers. Loads go
through the format package's reader (``gtp_format.reader.safetensors_reader``, via
:mod:`gtp_runtime.checkpoint.verified`), like every other layout.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import (
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult

from gtp_format.commit import fsync_file, write_durable  # noqa: E402
from gtp_format.names import GTP_INDEX_FILE as INDEX_FILE  # noqa: E402
from gtp_format.names import GTP_INDEX_VERSION as INDEX_VERSION  # noqa: E402
from gtp_format.names import chunk_tensor_name as tensor_name  # noqa: E402
from gtp_format.writer.checkpoint import data_file_name  # noqa: E402


def _done(value: Any) -> torch.futures.Future:
    """DCP waits on a ``torch.futures.Future``; our writes are synchronous, so it is ready."""
    f: torch.futures.Future = torch.futures.Future()
    f.set_result(value)
    return f


class SafetensorsWriter(StorageWriter):
    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__()
        self.path = Path(path)
        self.rank = 0

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = Path(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.rank = kwargs.get("rank", torch.distributed.get_rank() if torch.distributed.is_initialized() else 0)
        self.path.mkdir(parents=True, exist_ok=True)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> torch.futures.Future:
        file = data_file_name(self.rank, 0, "safetensors")
        tensors: dict[str, torch.Tensor] = {}
        results = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                raise ValueError(f"{item.index.fqn}: the safetensors layout stores tensors only, not byte objects")
            t = planner.resolve_data(item).detach().contiguous().cpu()
            name = tensor_name(item.index.fqn, tuple(item.index.offset or ()))
            tensors[name] = t
            results.append(WriteResult(item.index, t.numel() * t.element_size(), {"file": file, "name": name}))
        save_file(tensors, str(self.path / file), metadata={"format": "gtp-ckpt-chunks"})
        fsync_file(self.path / file)
        return _done(results)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        storage = {(r.index.fqn, tuple(r.index.offset or ())): r.storage_data for rs in results for r in rs}
        keys = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata):
                raise ValueError(f"{fqn}: the safetensors layout stores tensors only")
            keys[fqn] = {
                "dtype": str(md.properties.dtype),
                "shape": list(md.size),
                "chunks": [
                    {"offsets": list(c.offsets), "sizes": list(c.sizes), **storage[(fqn, tuple(c.offsets))]}
                    for c in md.chunks
                ],
            }
        write_durable(self.path / INDEX_FILE, json.dumps({"version": INDEX_VERSION, "keys": keys}).encode())

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True

    def storage_meta(self) -> None:
        return None
