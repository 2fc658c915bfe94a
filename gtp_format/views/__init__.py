"""The per-parameter view: where every piece of every parameter sits in a checkpoint's optimizer keys.

- :mod:`gtp_format.views.records`: the records (``KeyRef``, ``Holder``, ``ParamView``), ``full_box``,
  and the rows ``ckpt inspect --params`` prints.
- :mod:`gtp_format.views.ours`: the view of our checkpoints, from the manifest's bucket layout.
- :mod:`gtp_format.megatron.view` (and :mod:`gtp_format.megatron.moe`): the view of megatron-core's,
  from its bucketing rules (the megatron package sits below this one: it uses these records).
- :mod:`gtp_format.views.checkpoint`: ``param_views_of``, the view of an opened checkpoint of either kind.
"""
