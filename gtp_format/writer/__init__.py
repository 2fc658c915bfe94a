"""Writers of the formats torch reads, without torch: ``torch.save``'s archive of one tensor and DCP's
``.metadata`` pickle. ``ckpt reshard`` and ``ckpt export`` write torch_dist checkpoints through them."""
