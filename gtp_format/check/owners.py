"""The manifest's per-param optimizer owners agree with its layout (``ckpt verify``, code ``param_optimizers``).

A Muon checkpoint stores Muon's momentum where AdamW keeps its first moment (``exp_avg``), so the
only thing that says how to read a param's state is ``optimizer.param_optimizers``. A name there
that is no param of the layout, a param of a Muon checkpoint it does not name, a Muon owner on a
param that is not a matrix, or a Muon owner in an AdamW checkpoint would have a loader or a
reshard read momentum as a moment (or the reverse) without any error: each is refused here.
"""

from __future__ import annotations

from gtp_format.model import Checkpoint, Problem

CODE = "param_optimizers"


def check_param_optimizers(ckpt: Checkpoint) -> list[Problem]:
    m = ckpt.manifest
    if m is None or m.optimizer is None or m.buffers is None:
        return []
    opt = m.optimizer
    shapes = {p.name: p.full_shape for b in m.buffers for k in b.buckets for p in k.params}
    out: list[Problem] = []
    unknown = sorted(set(opt.param_optimizers) - set(shapes))
    if unknown:
        out.append(Problem("error", CODE, f"{len(unknown)} name(s) are no param of the manifest's bucket layout, "
                           f"e.g. {unknown[0]!r}; the manifest was edited or belongs to another model"))
    muon = sorted(n for n, o in opt.param_optimizers.items() if o == "muon")
    if opt.type != "muon" and muon:
        out.append(Problem("error", CODE, f"optimizer type {opt.type!r} but {len(muon)} param(s) are Muon's, e.g. "
                           f"{muon[0]!r}; restore the manifest the run wrote"))
    if opt.type == "muon":
        missing = sorted(set(shapes) - set(opt.param_optimizers))
        if missing:
            out.append(Problem("error", CODE, f"a Muon checkpoint must name every param's optimizer; "
                               f"{len(missing)} unnamed, e.g. {missing[0]!r}"))
    for n in muon:
        if n in shapes and len(shapes[n]) != 2:
            out.append(Problem("error", CODE, f"Muon owns {n!r} of shape {list(shapes[n])}; Muon updates matrices "
                               "only", key=n))
    return out
