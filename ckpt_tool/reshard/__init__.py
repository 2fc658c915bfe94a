"""The streaming reshard and export engine behind ``ckpt reshard`` and ``ckpt export``.

:mod:`.source` opens and checks SRC, :mod:`.plan` lists every target chunk, :mod:`.writers`
writes the data files, :mod:`.engine` runs a reshard atomically, :mod:`.export` the exports.
The layout arithmetic they use is torch-free and lives in :mod:`gtp_format.params` and
:mod:`gtp_format.layout.params`.
"""
