"""The fp32 single-process Muon reference: full matrices, one device, written apart from the runtime.

:class:`ReferenceMuon` updates the full weights of :class:`gtp_runtime.reference.ReferenceGPT`:
Muon for the params :func:`gtp_runtime.muon.muon_owned` names (which params is a configuration
fact, shared on purpose), ``torch.optim.AdamW`` for the rest. Its Newton-Schulz is written in the
other orientation from the runtime's (a tall matrix is iterated as ``X (X^T X)`` instead of being
transposed), so a slip in either shows as a parity failure rather than being copied.
"""

from __future__ import annotations

import torch

from gtp_runtime.muon import MuonConfig, muon_owned
from gtp_runtime.optimizer import AdamConfig

_A, _B, _C = 3.4445, -4.7750, 2.0315


def reference_newton_schulz(u: torch.Tensor, steps: int) -> torch.Tensor:
    """Quintic Newton-Schulz on the smaller Gram matrix, without transposing ``u``."""
    x = u / (torch.linalg.matrix_norm(u) + 1e-7)
    for _ in range(steps):
        if x.shape[0] > x.shape[1]:
            s = x.t() @ x
            x = _A * x + x @ (_B * s + _C * s @ s)
        else:
            s = x @ x.t()
            x = _A * x + (_B * s + _C * s @ s) @ x
    return x


class ReferenceMuon:
    """Muon (Nesterov momentum, NS5, ``sqrt(max(1, rows/cols))`` scale, decoupled weight decay)
    and AdamW, stepping the gradients already in ``p.grad`` (clipped by the caller)."""

    def __init__(self, params: dict[str, torch.Tensor], adam: AdamConfig, muon: MuonConfig) -> None:
        self.cfg = muon
        self.muon = {n: p for n, p in params.items() if muon_owned(n)}
        self.momentum = {n: torch.zeros_like(p) for n, p in self.muon.items()}
        self.peak_lr = adam.lr
        rest = [p for n, p in params.items() if not muon_owned(n)]
        self.adam = torch.optim.AdamW(rest, lr=adam.lr, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                                      weight_decay=adam.weight_decay, foreach=False)

    @property
    def param_groups(self) -> list[dict]:
        """AdamW's groups: a schedule sets their ``lr``, and Muon follows it by the same factor."""
        return self.adam.param_groups

    @torch.no_grad()
    def step(self) -> None:
        c = self.cfg
        lr_now = self.adam.param_groups[0]["lr"]
        lr = c.lr * (lr_now / self.peak_lr if self.peak_lr else 1.0)
        for n, p in self.muon.items():
            g = p.grad
            m = self.momentum[n]
            m.mul_(c.momentum).add_(g, alpha=1 - c.momentum)
            u = (1 - c.momentum) * g + c.momentum * m
            o = reference_newton_schulz(u, c.ns_steps) * max(1.0, p.shape[0] / p.shape[1]) ** 0.5
            p.mul_(1 - lr * c.weight_decay).sub_(lr * o)
        self.adam.step()
