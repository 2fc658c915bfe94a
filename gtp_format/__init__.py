"""The checkpoint format, readable without torch: one owner for what both products must agree on.

``gtp_runtime`` writes checkpoints and loads them for training; the ``ckpt`` CLI reads, checks and
rewrites them on machines that may have no GPU and files nobody trusts. Both import this package,
so a key name, a dtype, a manifest field, a rank's place in the topology or the rule for opening a
file inside a checkpoint folder is written once. Nothing here imports torch until a tensor is
built, and then only :mod:`gtp_format.torch_adapter` does: the CLI's read-only commands start in a
fraction of a second, and ``tests/format/test_format_no_torch.py`` imports every module with torch
blocked.

- :mod:`gtp_format.names`: key and file names, and their parsers.
- :mod:`gtp_format.dtypes`: the dtype table.
- :mod:`gtp_format.manifest`: the typed ``gtp_manifest.json`` schema, one writer, one parser.
- :mod:`gtp_format.layout`: parallel config, topology, shard specs, ``dp_group_idx``, writer election,
  the bucket-layout records and the box arithmetic.
- :mod:`gtp_format.reader`: folder access, the pickle pre-scan and allow-list, the readers that
  build :mod:`gtp_format.model` from a folder.
- :mod:`gtp_format.check`: the checks ``ckpt verify`` and ``--load`` run on that model.
- :mod:`gtp_format.views`: the per-parameter view (ours from the manifest, megatron-core's from its rules).
- :mod:`gtp_format.torch_adapter`: the one module that imports torch, on first use.
- :mod:`gtp_format.compare`: the one comparison engine (``diff``, ``verify-roundtrip``, the ranks'
  own checks after a load); torch only for values.
"""

__version__ = "0.1.0"  # the one version: pyproject.toml reads it, `ckpt --version` and `gtp-train --version` print it
