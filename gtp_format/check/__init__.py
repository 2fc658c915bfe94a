"""Checks over a read checkpoint: the ones ``ckpt verify`` reports and ``--load`` refuses on."""
