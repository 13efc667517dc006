"""Train a small GPT on ONNX Runtime with torch.compile(backend="ort"), next to eager.

    python3 dev.py train                 # from the repository root (sets up .venv)
    python examples/train_gpt.py --steps 50 --layers 4

Both copies start from the same weights and see the same batches; the script prints each
step's loss for eager and ort, their relative difference, median step times and the
ort/eager ratio, and what ran on ORT (ort_dynamo.report()).
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import ort_dynamo

TEXT = (
    "ONNX Runtime trains PyTorch models through torch.compile. Dynamo captures the graph, "
    "AOTAutograd splits it into forward and backward, each graph is lowered to ONNX and runs "
    "in an ORT session, and anything without an ONNX lowering stays in PyTorch. "
) * 64


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A GPT-2-style byte-level language model (built in: nothing to download)."""

    def __init__(self, layers: int = 2, dim: int = 128, heads: int = 4, context: int = 64) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(256, dim), nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 256, bias=False)
        self.head.weight = self.tok.weight  # tied embeddings, as GPT-2
        for module in self.modules():  # GPT-2's initialization
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batches(batch: int, context: int, seed: int = 0):
    data = torch.tensor(list(TEXT.encode()), dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    while True:
        start = torch.randint(0, len(data) - context - 1, (batch,), generator=gen)
        x = torch.stack([data[s:s + context] for s in start])
        y = torch.stack([data[s + 1:s + context + 1] for s in start])
        yield x, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()
    try:
        from tqdm import tqdm
    except ImportError:  # the progress bar is a nicety
        tqdm = None

    torch.manual_seed(0)
    eager = TinyGPT(args.layers, args.dim, context=args.context)
    ort_model = copy.deepcopy(eager)
    compiled = torch.compile(ort_model, backend="ort")
    opt_eager = torch.optim.AdamW(eager.parameters(), lr=args.lr)
    opt_ort = torch.optim.AdamW(ort_model.parameters(), lr=args.lr)

    def step(fn, opt, x, y):
        start = time.perf_counter()
        loss = fn(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item(), time.perf_counter() - start

    times_e, times_o, worst = [], [], 0.0
    data = batches(args.batch, args.context)
    steps = range(args.steps)
    bar = tqdm(steps, desc="training", unit="step") if tqdm else steps
    print(f"{'step':>4} {'eager loss':>11} {'ort loss':>11} {'rel diff':>9} {'eager ms':>9} {'ort ms':>9}")
    for i in bar:
        x, y = next(data)
        loss_e, t_e = step(eager, opt_eager, x, y)
        loss_o, t_o = step(compiled, opt_ort, x, y)
        rel = abs(loss_o - loss_e) / max(abs(loss_e), 1e-12)
        worst = max(worst, rel)
        if i == 0:
            first_step = t_o
            # The pointwise kernels compile in the background; steps until then run without
            # them (and next to the compiler, on the same cores). Wait, so the median compares
            # steady steps, and say how long the build took past the first step.
            start = time.perf_counter()
            ort_dynamo.wait_for_kernels()
            kernel_wait = time.perf_counter() - start
        else:
            times_e.append(t_e)
            times_o.append(t_o)
        line = f"{i:>4} {loss_e:>11.5f} {loss_o:>11.5f} {rel:>9.1e} {t_e * 1e3:>9.1f} {t_o * 1e3:>9.1f}"
        (bar.write if tqdm else print)(line)

    med_e, med_o = statistics.median(times_e), statistics.median(times_o)
    report = ort_dynamo.report()
    print()
    print(f"parity: worst relative loss difference over {args.steps} steps = {worst:.2e}"
          f" ({'OK' if worst < 1e-4 else 'LARGER THAN 1e-4'})")
    print(f"speed: median step eager {med_e * 1e3:.1f} ms, ort {med_o * 1e3:.1f} ms, "
          f"ort/eager = {med_o / med_e:.2f}; first ort step (compile) {first_step:.1f} s, "
          f"its pointwise kernels built {kernel_wait:.1f} s after it")
    print(f"ORT ran {report.ort_nodes} node(s); {report.fallback_nodes} fell back to PyTorch")
    print(report)
    if not math.isfinite(worst) or report.ort_nodes == 0:
        raise SystemExit("ort training did not run")


if __name__ == "__main__":
    main()
