"""``ckpt reshard``: :mod:`.engine` for this runtime's checkpoints, :mod:`.megatron_dp` for megatron-core's
``dp_reshardable`` ones; both run on the copy kernel (:mod:`ckpt_tool.copying`)."""
