#!/usr/bin/env python3
"""Idiom scan: ways models commonly index, split and reorder tensors, compiled on ORT; prints
for each the nodes that fell back to PyTorch and the index-driven ONNX ops (Scatter*, Gather*)
in its forward and backward models, with the default options (so the pointwise kernels where
a C compiler is found: ``ORT_DYNAMO_POINTWISE_KERNELS=0`` scans without them).

Those ops take an index per element and run far slower than a copy. They are right where the
indices are data (gather, sort, topk, max); where the indices are fixed by the code (a
selection, a strided slice) a Pad, Concat or Slice does the same work. This scan is how
``select_backward`` was found lowering to ScatterElements (43 ms of a nanoGPT-style step, see
docs/performance-log.md, "A slow lowering the HF models never showed").

    .venv/bin/python tools/idiom_scan.py            # all idioms
    .venv/bin/python tools/idiom_scan.py qkv_select  # some
"""

from __future__ import annotations

import glob
import os
import sys
import tempfile
import warnings

import onnx
import torch
import torch.nn.functional as F

import ort_dynamo

INDEXED_OPS = {"ScatterElements", "ScatterND", "GatherElements", "GatherND"}
X = torch.randn(4, 16, 32)
INDEX = torch.randint(0, 16, (4, 16))

#: name -> (function of X, whether index-driven ops are expected: the indices are data)
IDIOMS = {
    "qkv_select": (lambda t: sum(u.exp() for u in t.view(4, 16, 2, 16).permute(2, 0, 1, 3)), False),
    "unbind": (lambda t: sum(u.exp() for u in t.unbind(0)), False),
    "chunk": (lambda t: sum(c.exp() for c in t.chunk(4, dim=-1)), False),
    "split_sizes": (lambda t: sum(c.exp().sum() for c in t.split([8, 24], dim=-1)), False),
    "cls_pool": (lambda t: t[:, 0].tanh(), False),
    "last_token": (lambda t: t[:, -1, :].exp(), False),
    "rotate_half": (lambda t: torch.cat((-t[..., 16:], t[..., :16]), dim=-1) * 2, False),
    "rope_interleaved": (lambda t: torch.stack((-t[..., 1::2], t[..., ::2]), dim=-1).flatten(-2) * 2, False),
    "rope_pairs": (lambda t: torch.stack([t.unflatten(-1, (-1, 2))[..., 0], -t.unflatten(-1, (-1, 2))[..., 1]],
                                         -1).flatten(-2) * 2, False),
    "diagonal": (lambda t: t[:, :16, :16].diagonal(dim1=1, dim2=2).exp(), False),
    "triu": (lambda t: t[:, :, :16].triu().exp(), False),
    "roll": (lambda t: t.roll(3, dims=1).exp(), False),
    "flip": (lambda t: t.flip(1).exp(), False),
    "repeat_interleave": (lambda t: t.repeat_interleave(2, dim=1).exp(), False),
    "unfold": (lambda t: t.unfold(1, 4, 2).exp(), False),
    "pad_reflect": (lambda t: F.pad(t, (2, 2), mode="reflect").exp(), False),
    "pad_replicate": (lambda t: F.pad(t, (2, 2), mode="replicate").exp(), False),
    "gather": (lambda t: t.gather(1, INDEX.unsqueeze(-1).expand(4, 16, 32)).exp(), True),
    "index_tensor": (lambda t: t[:, INDEX[0]].exp(), True),
    "sort": (lambda t: t.sort(-1).values.exp(), True),
    "topk": (lambda t: t.topk(4, -1).values.exp(), True),
    "max_dim": (lambda t: t.max(-1).values.exp(), True),
}


def scan(name: str) -> str:
    function, data_indexed = IDIOMS[name]
    ort_dynamo.reset()
    torch._dynamo.reset()
    with tempfile.TemporaryDirectory() as folder:
        compiled = torch.compile(function, backend="ort", options={"save_onnx": True, "save_path": folder})
        try:
            compiled(X.clone().requires_grad_()).sum().backward()
        except Exception as exc:  # noqa: BLE001 - a scan reports, it does not stop
            return f"{name:18s} ERROR {type(exc).__name__}: {' '.join(str(exc).split())[:120]}"
        found: dict[str, set] = {}
        for path in sorted(glob.glob(os.path.join(folder, "*.onnx"))):
            kind = "backward" if "backward" in os.path.basename(path) else "forward"
            found.setdefault(kind, set()).update(
                node.op_type for node in onnx.load(path).graph.node if node.op_type in INDEXED_OPS)
    ops = "; ".join(f"{kind}: {', '.join(sorted(names))}" for kind, names in found.items() if names) or "none"
    flag = "" if data_indexed or ops == "none" else "   <- fixed indices: a copy would do"
    return f"{name:18s} fallbacks {ort_dynamo.report().fallback_nodes:2d}  indexed ops: {ops}{flag}"


def main(names: list[str]) -> int:
    unknown = sorted(set(names) - set(IDIOMS))
    if unknown:
        print(f"unknown idiom(s) {unknown}; known: {', '.join(IDIOMS)}", file=sys.stderr)
        return 2
    warnings.simplefilter("ignore")
    for name in names or IDIOMS:
        print(scan(name), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
