#!/usr/bin/env python3
"""DistributedDataParallel + ``torch.compile(backend="ort")``, launched by torchrun:

    torchrun --nproc_per_node 2 examples/ddp.py            # CPU: gloo
    torchrun --nproc_per_node 2 examples/ddp.py --steps 50 # GPUs: NCCL, one GPU per rank

Sequences have different useful lengths (the rest is padding), so
``LoadBalancingDistributedSampler`` gives each rank the same total number of real tokens.
See docs/distributed.md.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import GPT2Config, GPT2LMHeadModel

import ort_dynamo
from ort_dynamo.utils.data import LoadBalancingDistributedSampler

VOCAB, LENGTH, PAD = 64, 16, 0


class PaddedCountingDataset(torch.utils.data.Dataset):
    """Counting sequences of 4..16 real tokens, right-padded to 16 (labels -100 on padding)."""

    def __init__(self, size: int = 512) -> None:
        g = torch.Generator().manual_seed(0)
        starts = torch.randint(1, VOCAB, (size, 1), generator=g)
        self.ids = (starts + torch.arange(LENGTH)) % (VOCAB - 1) + 1
        self.lengths = torch.randint(4, LENGTH + 1, (size,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        real = torch.arange(LENGTH) < self.lengths[i]
        return {"input_ids": torch.where(real, self.ids[i], PAD), "attention_mask": real.long(),
                "labels": torch.where(real, self.ids[i], -100)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8, help="per rank")
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")  # torchrun sets RANK, WORLD_SIZE, ...
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if use_cuda else torch.device("cpu")
    if not use_cuda:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))

    torch.manual_seed(0)  # same initial weights on every rank (DDP also broadcasts rank 0's)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=LENGTH,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config).to(device)
    ddp_model = DistributedDataParallel(model, device_ids=[device.index] if use_cuda else None)
    compiled = torch.compile(ddp_model, backend="ort")  # compile the DDP wrapper, not the inner model
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    dataset = PaddedCountingDataset()
    sampler = LoadBalancingDistributedSampler(dataset, complexity_fn=lambda s: int(s["attention_mask"].sum()))
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)  # a new shuffle, the same on every rank
        for batch in loader:
            batch = {k: v.to(device) for k, v in batch.items()}
            loss = compiled(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if rank == 0 and (step % 10 == 0 or step == 1):
                print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)
            if step == args.steps:
                break
        epoch += 1

    report = ort_dynamo.report()
    print(f"[rank {rank}] {len(report.graphs)} graph(s), {report.ort_nodes} node(s) on ORT, "
          f"{report.fallback_nodes} in PyTorch", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
