"""megatron-core's checkpoint format: what this project knows of it, by role, lowest first.

- :mod:`~gtp_format.megatron.keys`: the keys megatron-core's GPT writes (module order, buffers,
  gated linears, expert keys and their expert-TP split) and the one refusal line.
- :mod:`~gtp_format.megatron.topology`: the parallel sizes and optimizer format read back from a
  checkpoint (``common_state``'s args decoded as inert records).
- :mod:`~gtp_format.megatron.args`: the one typed model description, args checked against shapes.
- :mod:`~gtp_format.megatron.layout`: megatron-core's bucket layout at a *target* topology (reshard).
- :mod:`~gtp_format.megatron.buckets`: the bucket rules as a stored checkpoint shows them.
- :mod:`~gtp_format.megatron.moe` and :mod:`~gtp_format.megatron.view`: the per-parameter view
  (experts, then the whole model).
- :mod:`~gtp_format.megatron.padding`: the alignment padding, from the view's ranges.
"""
