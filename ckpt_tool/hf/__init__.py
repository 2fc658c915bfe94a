"""Hugging Face interchange: the name table (:mod:`.mapping`), reading an HF folder (:mod:`.folder`) and
``ckpt import --from hf`` (:mod:`.importer`). Torch-free: ``ckpt export``/``import`` never import torch."""
