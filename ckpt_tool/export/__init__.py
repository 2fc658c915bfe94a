"""``ckpt export``: :mod:`.engine` writes a Hugging Face folder or a ``fully_reshardable`` checkpoint,
:mod:`.to_torch` one ``torch.save`` file; both run on the copy kernel (:mod:`ckpt_tool.copying`) and
take the Hugging Face names from :mod:`ckpt_tool.hf`."""
