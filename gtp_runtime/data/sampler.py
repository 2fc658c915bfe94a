"""Samples like Megatron's GPT dataset: shuffled documents, ``seq_length + 1`` tokens across boundaries.

One epoch of a split is its documents in an order shuffled by ``(seed, epoch)``, concatenated into
one token stream. Sample ``j`` of the epoch is the stream's tokens ``[j*L, j*L + L + 1)``: inputs
are the first ``L``, labels the last ``L``, and a sample may span several documents (Megatron's
``sample_idx``). The samples of an epoch are then visited in an order shuffled by the same
``(seed, epoch)`` (Megatron's ``shuffle_idx``), epoch after epoch.

Global sample ``k`` is therefore a pure function of ``(seed, k)``, and the global batch of step
``s`` is samples ``[(s-1)*B, s*B)`` for a global batch size ``B``: nothing depends on how many
ranks read it or how they are arranged, which keeps parity, resume and resharding exact.

Differences from Megatron, on purpose: each epoch is shuffled on its own (Megatron shuffles the
document order of all epochs as one array and may separate the last epoch), and a validation split
is read in file order without shuffling, so its loss is comparable across data-order seeds.
Indices are built per epoch on first use (a permutation of the epoch's samples, 8 bytes each):
nothing is materialised for epochs that are never reached.
"""

from __future__ import annotations

import numpy as np

from gtp_runtime.data.indexed import DataError, TokenDataset


def split_documents(num_docs: int, weights: tuple[float, ...]) -> list[tuple[int, int]]:
    """Document ranges per split, by ratio (Megatron's ``--split 969,30,1`` rounding)."""
    total = float(sum(weights))
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + w / total)
    edges = [round(b * num_docs) for b in bounds]
    edges[-1] = num_docs
    return list(zip(edges[:-1], edges[1:]))


class GPTSamples:
    """The samples of one split: document range ``[doc_lo, doc_hi)`` of ``data``."""

    def __init__(self, data: TokenDataset, doc_lo: int, doc_hi: int, seq_length: int, seed: int,
                 shuffle: bool = True, what: str = "train") -> None:
        self.data, self.seq_length, self.seed, self.shuffle = data, seq_length, seed, shuffle
        s_lo, s_hi = int(data.doc_index[doc_lo]), int(data.doc_index[doc_hi])
        self.seqs = np.arange(s_lo, s_hi, dtype=np.int64)
        lengths = data.lengths[s_lo:s_hi].astype(np.int64)
        self.seqs, lengths = self.seqs[lengths > 0], lengths[lengths > 0]
        self.lengths = lengths
        self.tokens_per_epoch = int(lengths.sum())
        self.samples_per_epoch = max(0, (self.tokens_per_epoch - 1) // seq_length)
        if self.samples_per_epoch == 0:
            raise DataError(f"{data.name}: the {what} split has {self.tokens_per_epoch} tokens, fewer than one sample "
                            f"of --seq-length {seq_length} + 1; use more data or change --split")
        self._epoch: tuple[int, np.ndarray, np.ndarray, np.ndarray] | None = None

    def _epoch_index(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(sequence order, token offset of each in the stream, sample order) of ``epoch``."""
        if self._epoch is None or self._epoch[0] != epoch:
            order = np.arange(len(self.seqs))
            samples = np.arange(self.samples_per_epoch, dtype=np.int64)
            if self.shuffle:
                rng = np.random.RandomState(np.random.SeedSequence([self.seed, epoch]).generate_state(1)[0])
                order = rng.permutation(len(self.seqs))
                samples = rng.permutation(self.samples_per_epoch).astype(np.int64)
            offsets = np.concatenate([[0], np.cumsum(self.lengths[order])])
            self._epoch = (epoch, order, offsets, samples)
        return self._epoch[1:]

    def sample(self, k: int) -> np.ndarray:
        """Global sample ``k``: ``seq_length + 1`` tokens as int64."""
        epoch, j = divmod(k, self.samples_per_epoch)
        order, offsets, samples = self._epoch_index(epoch)
        start = int(samples[j]) * self.seq_length
        end = start + self.seq_length + 1
        out = np.empty(self.seq_length + 1, dtype=np.int64)
        d = int(np.searchsorted(offsets, start, side="right")) - 1
        pos = 0
        while pos < len(out):
            seq = int(self.seqs[order[d]])
            a = start + pos - int(offsets[d])
            n = min(int(self.lengths[order[d]]) - a, end - start - pos)
            first = int(self.data.starts[seq]) + a
            out[pos : pos + n] = self.data.tokens[first : first + n]
            pos, d = pos + n, d + 1
        return out

    def batch(self, first: int, count: int) -> np.ndarray:
        """Samples ``[first, first + count)`` stacked: ``[count, seq_length + 1]`` int64."""
        return np.stack([self.sample(k) for k in range(first, first + count)])
