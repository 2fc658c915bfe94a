"""Where a checkpoint lives: a local folder or an object store, parsed once (:mod:`.location`), and the one
interface every reader and writer reaches its files through (:mod:`.base`: :class:`~.base.Storage`, chosen
once by :func:`~.base.storage_for`).

Why a package of its own: every command, the launcher's ``--save``/``--load`` and the one reader and
writer take the same PATH, and a URL parsed by hand in each of them is how ``--save s3://bucket/run``
came to write a local folder ``s3:/bucket/run`` and exit 0 (``pathlib`` folds ``//`` into ``/``).
"""
