"""The write side of the format, without torch: :mod:`.checkpoint` is the one checkpoint writer every
writer (the runtime's save, ``reshard``, ``export``, ``migrate-aliased``) lays out and commits its
output through (its work folders and their owners are :mod:`gtp_format.work`); ``torch.save``'s
archive of one tensor (:mod:`.torch_blob`) and DCP's ``.metadata`` pickle (:mod:`.dcp_metadata`)
are how ``ckpt reshard`` and ``ckpt export`` write torch_dist files."""
