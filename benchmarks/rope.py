"""Rotary position embeddings, forward and backward, eager against ``backend="ort"``: the three
ways models write them, on one attention input (batch 8, 128 tokens, 4 heads of 64).

    .venv/bin/python benchmarks/rope.py

rotate_half: HF Llama, Mistral, GPT-NeoX (halves of the head dim, a Concat); pairs: torchtune
(interleaved pairs read as ``x.reshape(..., -1, 2)[..., 0]`` and ``[..., 1]``, then stacked);
strided: GPT-J (``x[..., ::2]``, ``x[..., 1::2]``). Each is timed interleaved with eager, after
the generated kernels are built; prints the median ms of 30 steps and ort/eager.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(__file__))
from train_step import interleaved_ms  # noqa: E402

import ort_dynamo  # noqa: E402


def rotate_half(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def pairs(x, cos, sin):
    xs = x.reshape(*x.shape[:-1], -1, 2)
    cos, sin = cos[..., ::2], sin[..., ::2]
    return torch.stack([xs[..., 0] * cos - xs[..., 1] * sin, xs[..., 1] * cos + xs[..., 0] * sin], -1).flatten(-2)


def strided(x, cos, sin):
    return x * cos + torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2) * sin


def main() -> None:
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    x = torch.randn(8, 4, 128, 64, requires_grad=True)
    cos, sin = torch.randn(128, 64), torch.randn(128, 64)

    print(f"torch {torch.__version__}; input {tuple(x.shape)}; forward + backward, median of 30 interleaved steps")
    for function in (rotate_half, pairs, strided):
        e, o, _ = interleaved_ms(function, (x, cos, sin), 30, loss=lambda out: out.square().sum())
        print(f"{function.__name__:12s} eager {e:6.2f} ms  ort {o:6.2f} ms  ort/eager {o / e:.2f}  "
              f"fallback nodes {ort_dynamo.report().fallback_nodes}", flush=True)


if __name__ == "__main__":
    main()
