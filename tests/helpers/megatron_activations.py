"""megatron-core's own activation functions on a grid (run by the megatron venv).

``python megatron_activations.py OUT.npz``: for each activation a Megatron-LM flag selects (none:
``F.gelu``, megatron's TransformerConfig default; ``--openai-gelu``; ``--squared-relu``; ``--swiglu``'s
SiLU; ``--quick-geglu``'s quick GELU), the values megatron-core computes in float64 on
``linspace(-8, 8, 4001)``. The test compares them with the transformers function that the exported
``config.json`` names: a tanh GELU written as the erf one is only 2e-6 off in a tiny model's logits.
"""

from __future__ import annotations

import sys


def main(out: str) -> None:
    import numpy as np
    import torch
    import torch.nn.functional as F
    from megatron.core.activations import quick_gelu, squared_relu
    from megatron.core.transformer.utils import openai_gelu

    x = torch.linspace(-8, 8, 4001, dtype=torch.float64)
    funcs = {"gelu": F.gelu, "gelu_tanh": openai_gelu, "squared_relu": squared_relu, "silu": F.silu,
             "quick_gelu": quick_gelu}
    np.savez(out, x=x.numpy(), **{name: f(x).numpy() for name, f in funcs.items()})


if __name__ == "__main__":
    main(sys.argv[1])
