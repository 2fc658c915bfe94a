"""Library behind ``ckpt migrate-aliased``: turn a pre-fix (aliased) checkpoint into a correct one.

The pre-fix writer left ``.cp_rank_{i}`` off the optimizer keys of folded buffers, so CP peers
offered the same key and offset and DCP kept one copy per chunk (docs/checkpoint-format.md).
What survives of chunk ``(key, offset)`` is one CP rank's state; the name ``__{rank}_{k}.distcp``
of the file holding it names the writer, and the manifest topology gives the writer's CP rank.

A migration never touches SRC:

1. each surviving chunk becomes a chunk of ``{key}.cp_rank_{w}`` (canonical suffix form). Only
   ``.metadata`` changes (state_dict_metadata, storage_data, planner_data); the data files are
   hard-linked (copied where links fail);
2. the other CP ranks' copies of that chunk are lost. Their fp32 master (``param``) is rebuilt
   from the model weights of the same checkpoint with the manifest's bucket layout: bit-exact
   when the weights are fp32 (the master is what the optimizer published into them), lossy
   otherwise (recorded). Their Adam moments are gone: written as zeros only when asked
   (``reset_lost_moments``), and recorded in the manifest (``notes`` and ``migration``);
3. the result is built in a hidden sibling folder, checked with ``ckpt verify``'s own structural
   checks, fsynced, and renamed into place.

One module per step, so that each can be read (and tested) alone:

- :mod:`.plan`: every rename, every lost chunk and every refusal, from metadata and the manifest.
  It imports no torch, so ``--dry-run`` costs what ``ckpt verify`` costs, not a torch start-up
  (docs/performance.md, "migrate-aliased --dry-run");
- :mod:`.weights`: lost fp32 masters rebuilt from the model weights;
- :mod:`.metadata`: the new ``.metadata``, rewritten from the records the reader kept
  (``.metadata`` is read and unpickled once, by :func:`gtp_format.reader.checkpoint.open_checkpoint`);
- :mod:`.write`: the bytes: links, the new data file, ``.metadata``; :mod:`.record`: the manifest;
- :mod:`.commit`: self-check, then commit through :mod:`gtp_format.commit`;
- :mod:`.run`: the whole command as one call, for ``ckpt_tool.commands.migrate``.

Only :mod:`.weights`, :mod:`.metadata` and :mod:`.write` import torch, and only a real run imports them.
"""
