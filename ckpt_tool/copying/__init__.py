"""The copy kernel under ``ckpt reshard``, ``ckpt export`` and ``ckpt import``, below all three and
importing none of them: :mod:`.source` opens and checks SRC, :mod:`.plan` lists every target chunk,
:mod:`.writers` writes the data files, :mod:`.engine` runs the writes and builds the output
atomically (:mod:`.ranked` under torchrun). The layout arithmetic they use is torch-free and lives in
:mod:`gtp_format.views` and :mod:`gtp_format.layout.params`.
"""

DEFAULT_MAX_MEMORY = 2 << 30
"""Bytes of tensor data in flight unless ``--max-memory`` says otherwise (here, not in :mod:`.engine`,
so that the command modules can name it without importing the engine at CLI start-up)."""

WEIGHT_STATE = "weight"
"""The model-weight "state" of a parameter view, next to the optimizer's param / exp_avg / exp_avg_sq
(not :data:`gtp_format.layout.topology.WEIGHT`, the group a dense GTP weight shards over)."""
