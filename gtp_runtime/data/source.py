"""What a trainer reads: the configured dataset, its train/valid splits and each step's global batch.

The data position is ``consumed_train_samples`` (Megatron's name): the batch of the next step is
samples ``[consumed, consumed + B)``. It is saved in the checkpoint with the data's fingerprint,
so a resume continues on the next sample, and a resume on other data or another seed is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gtp_format.layout.config import ConfigError
from gtp_runtime.data.indexed import DataError, TokenDataset, open_dataset
from gtp_runtime.data.sampler import GPTSamples, split_documents


@dataclass(frozen=True)
class DataConfig:
    path: str | None = None
    """``PREFIX`` of an indexed dataset or a flat ``.bin``; ``None``: the stdlib corpus."""
    flat_dtype: str = "uint16"
    split: str = "98,2"
    seed: int | None = None
    """Data-order seed; ``None`` takes the model seed (Megatron uses ``--seed`` for both)."""
    recorded: tuple[tuple[str, int | float | str | bool | None], ...] | None = None
    """A checkpoint's recorded data fingerprint, for a run that only loads and saves it
    (:class:`RecordedData`); ``path`` is then information, never opened."""

    def weights(self) -> tuple[float, float]:
        from gtp_format.numbers import NumberError, parse_float

        try:  # ASCII and finite: float() took "nan" and "inf", and int(nan) ended the launch in a last-resort line
            w = [parse_float(x.strip(), "--split", 0.0, 1e12) for x in self.split.split(",")[:4]]
        except NumberError:
            w = []
        if len(w) not in (2, 3) or any(x < 0 for x in w) or w[0] <= 0 or len(self.split.split(",")) > 3:
            raise ConfigError(f"--split {self.split!r}: give train,valid[,test] weights like 98,2 (train > 0)")
        return w[0], w[1]


class RecordedData:
    """The data a checkpoint records, standing in for it in a run that never reads a batch.

    Why: ``verify-roundtrip PATH`` loads a checkpoint and saves it again; the load compares the
    data fingerprint and the save writes it back, and nothing else touches the data. Opening the
    recorded ``data_position.path`` would make every rank open a file the checkpoint names, outside
    the checkpoint, before any check (a crafted manifest pointed it at a 16 TiB sparse file, and
    the error line printed that file's size). A path in a checkpoint is information: this
    source reports the recorded fingerprint and refuses to produce tokens.
    """

    def __init__(self, cfg: DataConfig) -> None:
        assert cfg.recorded is not None
        self.cfg = cfg

    def fingerprint(self) -> dict[str, object]:
        return dict(self.cfg.recorded or ())

    def train_batch(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise DataError("this run only loads and saves a checkpoint and reads no data; pass --data-path to train")

    valid_batch = train_batch


def open_source(cfg: DataConfig, seq_length: int, vocab_size: int, model_seed: int) -> DataSource | RecordedData:
    """The data of a run: the recorded stand-in when ``cfg.recorded`` is set, else the dataset."""
    if cfg.recorded is not None:
        return RecordedData(cfg)
    return DataSource(cfg, seq_length, vocab_size, model_seed)


class DataSource:
    def __init__(self, cfg: DataConfig, seq_length: int, vocab_size: int, model_seed: int) -> None:
        from gtp_runtime.data.corpus import default_corpus

        self.cfg = cfg
        self.seed = model_seed if cfg.seed is None else cfg.seed
        self.data: TokenDataset = open_dataset(cfg.path or default_corpus(), cfg.flat_dtype)
        if cfg.path is None:
            self.data.name = "python-stdlib"  # the counts in the fingerprint tell versions apart
        # The byte corpus is folded into a smaller vocab (tests use 64 or 128); user data is checked.
        self.fold = cfg.path is None
        self.vocab_size = vocab_size
        (t0, t1), (v0, v1) = split_documents(self.data.num_documents, cfg.weights())
        self.train = GPTSamples(self.data, t0, t1, seq_length, self.seed, shuffle=True)
        self.valid = GPTSamples(self.data, v0, v1, seq_length, 0, shuffle=False, what="valid") if v1 > v0 else None

    def _tensors(self, samples: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fold:
            samples = samples % self.vocab_size
        elif samples.size and (samples.min() < 0 or samples.max() >= self.vocab_size):
            raise DataError(f"{self.data.name}: token id {int(samples.max())} is outside --vocab-size "
                            f"{self.vocab_size}; pass the tokenizer's vocab size")
        t = torch.from_numpy(samples)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    def train_batch(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and labels ``[count, seq_length]`` of train samples ``[first, first + count)``."""
        return self._tensors(self.train.batch(first, count))

    def valid_batch(self, index: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``index``-th validation batch (the same every evaluation)."""
        if self.valid is None:
            raise DataError(f"{self.data.name}: the valid split is empty; give it documents with --split")
        return self._tensors(self.valid.batch(index * count, count))

    def fingerprint(self) -> dict[str, object]:
        return {**self.data.fingerprint(), "split": self.cfg.split, "seed": self.seed}
