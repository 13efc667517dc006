"""DDP and FSDP2 with backend="ort": 2 CPU processes (gloo) train exactly like one eager process.

Each rank trains on its half of every batch; gradient averaging makes that equal to one eager
process on the whole batch. Each rank saves its parameters and its ``ort_dynamo.report()``
summary to a file that the test (the parent process) compares.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

import ort_dynamo
from parity import free_port

WORLD_SIZE = 2
STEPS = 3
BATCH_PER_RANK = 4
LR = 0.1

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


class Block(nn.Module):
    # Our own module class: Dynamo does not trace frames of torch.nn's own modules when FSDP2
    # or DDP call them directly, so a bare nn.Linear per shard would silently stay eager.
    def __init__(self, n_in: int, n_out: int, activation: bool = True) -> None:
        super().__init__()
        self.linear = nn.Linear(n_in, n_out)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x)
        return F.gelu(x) if self.activation else x


class MLP(nn.Module):
    """Two 512x512 weights of exactly 1 MiB: with ``bucket_cap_mb=1`` DDP makes 3 buckets."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(16, 512), Block(512, 512), Block(512, 512), Block(512, 4, False)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def make_model() -> MLP:
    torch.manual_seed(0)
    return MLP()


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    n = BATCH_PER_RANK * WORLD_SIZE
    return torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)


def train_on_rank(rank: int, strategy: str, port: int, out_dir: str) -> None:
    """Body of each spawned process: wrap, compile with "ort", train, save params and report."""
    torch.set_num_threads(1)  # two ranks share the machine's cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    try:
        model = make_model()
        if strategy == "ddp":
            # DDPOptimizer splits the graph at bucket boundaries; each piece compiles on its own.
            step_fn = torch.compile(nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1), backend="ort")
        else:  # fsdp2: shard and compile block by block, the pattern torch recommends
            from torch.distributed.fsdp import fully_shard

            for block in model.blocks:
                fully_shard(block)
                block.compile(backend="ort")
            fully_shard(model)
            step_fn = model
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        mine = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
        for step in range(STEPS):
            x, y = global_batch(step)
            F.cross_entropy(step_fn(x[mine]), y[mine]).backward()
            optimizer.step()
            optimizer.zero_grad()
        params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
        report = ort_dynamo.report()
        torch.save({
            "params": [p.detach().clone() for p in params],
            "graphs": [{"kind": g.kind, "ort_nodes": g.ort_nodes, "torch_nodes": g.torch_nodes, "runs": g.runs}
                       for g in report.graphs],
            "fallback_nodes": report.fallback_nodes,
        }, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_two_ranks(strategy: str, tmp_path) -> list[dict]:
    mp.spawn(train_on_rank, args=(strategy, free_port(), str(tmp_path)), nprocs=WORLD_SIZE)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD_SIZE)]


def eager_single_process() -> list[torch.Tensor]:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = global_batch(step)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach() for p in model.parameters()]


def assert_trains_like_one_eager_process(ranks: list[dict]) -> None:
    for p0, p1 in zip(ranks[0]["params"], ranks[1]["params"]):
        assert torch.equal(p0, p1), "ranks diverged: gradients were not averaged identically"
    for got, want in zip(ranks[0]["params"], eager_single_process()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def assert_every_graph_on_ort(rank: dict) -> None:
    assert rank["fallback_nodes"] == 0, rank["graphs"]
    for graph in rank["graphs"]:
        assert graph["ort_nodes"] > 0 and graph["torch_nodes"] == 0, graph
        assert graph["runs"] >= STEPS, graph


def test_ddp_with_ort_backend_matches_single_process_eager(tmp_path):
    ranks = run_two_ranks("ddp", tmp_path)
    assert_trains_like_one_eager_process(ranks)
    for rank in ranks:
        forwards = [g for g in rank["graphs"] if g["kind"] == "forward"]
        assert len(forwards) == 3, f"expected one forward graph per DDP bucket, got {rank['graphs']}"
        assert_every_graph_on_ort(rank)


def test_fsdp2_with_ort_backend_matches_single_process_eager(tmp_path):
    pytest.importorskip("torch.distributed.fsdp", reason="needs FSDP2 (fully_shard)")
    ranks = run_two_ranks("fsdp2", tmp_path)
    assert_trains_like_one_eager_process(ranks)
    for rank in ranks:
        # Blocks 2 and 3 have the same shapes and share one compiled graph (it runs twice a step).
        assert sum(g["kind"] == "forward" for g in rank["graphs"]) == 3, rank["graphs"]
        assert_every_graph_on_ort(rank)
