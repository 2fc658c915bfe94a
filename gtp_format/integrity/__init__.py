"""Integrity per chunk: a content hash and value statistics for every stored chunk, recorded at save.

Why below the file: a file checksum says that one multi-GB data file is damaged, not which tensor
or box; it cannot tell ``ckpt diff`` which chunks two checkpoints share; and it says nothing about
the values. Each chunk record (:mod:`.records`) holds the xxh3-128 of the chunk's stored bytes
(:mod:`.hash`; chosen by ``benchmarks/bench_chunk_hash.py``) and its NaN/Inf/zero counts, min,
max and fp64 sum of squares (:mod:`.stats`). Writers feed :func:`.record_file.record_file` once
per data file they wrote; readers get the records through :func:`.records.read_records`.
"""
