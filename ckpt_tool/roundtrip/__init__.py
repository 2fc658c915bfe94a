"""``ckpt verify-roundtrip`` as a library: start ranks, save, load, re-save, compare, report.

- :mod:`ckpt_tool.roundtrip.training` (no PATH): train on local ranks, save, load in fresh
  processes, resume; every rank compares its state with what it held
  (:func:`gtp_runtime.roundtrip.resume_phase`, through :mod:`gtp_format.compare`).
- :mod:`ckpt_tool.roundtrip.resaved` (PATH): gate the checkpoint through ``ckpt verify``'s reader
  and checks, load it on local ranks with its manifest's config, save it again, compare the two
  folders key by key with :mod:`gtp_format.compare`.
- :mod:`ckpt_tool.roundtrip.jobs`: what the ranks run; :mod:`ckpt_tool.roundtrip.rows`: the
  report's check rows.

Ranks are started with :func:`gtp_runtime.launch.run_local_ranks` and configs are built from the
runtime's dataclasses directly (an earlier version re-encoded its options as argv strings for the
launcher's parser). Failures are :class:`gtp_format.errors.FormatError` with the exit code; the
command module only prints.
"""
