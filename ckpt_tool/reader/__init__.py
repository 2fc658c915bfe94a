"""Readers that turn a checkpoint folder into :class:`ckpt_tool.model.Checkpoint`.

Nothing here needs ``torch.distributed`` to be initialised, and nothing here trusts the folder:
metadata is parsed with an allow-list, storage paths must stay inside the folder, and every byte
range is checked against the real file size before it is read.
"""
