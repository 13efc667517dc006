"""Samplers that give every rank about the same total work (e.g. sequence length) per epoch.

Same arguments and semantics as onnxruntime-training's ``utils.data`` samplers (adapted there
from bagua's load-balancing data loader): samples are sorted by complexity, consecutive runs of
``num_replicas`` samples are dealt one per rank, and the order of those runs is shuffled per
epoch. Rank r's total complexity then differs from any other rank's by at most
``max(complexity) - min(complexity)`` (with ``random_level=0``).
"""

from __future__ import annotations

import math
from typing import Callable, Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Sampler

__all__ = ["LoadBalancingDistributedSampler", "LoadBalancingDistributedBatchSampler"]


def _world(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    if num_replicas is None or rank is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("num_replicas and rank are needed when torch.distributed is not initialized")
        num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
        rank = dist.get_rank() if rank is None else rank
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if not 0 <= rank < num_replicas:
        raise ValueError(f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]")
    return num_replicas, rank


class LoadBalancingDistributedSampler(Sampler[int]):
    """Like ``torch.utils.data.DistributedSampler``, but ranks get equal total complexity.

    Args:
        dataset: a map-style dataset (constant size).
        complexity_fn: ``sample -> int``, e.g. the sequence length. Called once per sample.
        num_replicas, rank: default to torch.distributed's world size and rank
            (``world_size`` is accepted as onnxruntime-training's name for ``num_replicas``).
        shuffle: shuffle the order of the dealt runs (or of the groups, with ``group_size``).
        seed: shuffling seed; must be the same on every rank. Epoch ``e`` uses ``seed + e``.
        drop_last: drop the tail so every rank gets ``len(dataset) // num_replicas`` samples;
            otherwise wrap around to the start so every rank gets ``ceil(len / num_replicas)``.
        random_level: in [0, 1]; adds per-epoch random noise of up to
            ``random_level * (max - min)`` complexity before sorting: 0 = best balance.
        group_size: sort only within consecutive groups of this many samples, and shuffle the
            order of the groups instead of the runs.
    """

    def __init__(self, dataset, complexity_fn: Callable[..., int], num_replicas: int | None = None,
                 rank: int | None = None, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 random_level: float = 0.0, group_size: int | None = None, *,
                 world_size: int | None = None) -> None:
        if world_size is not None:
            if num_replicas is not None and num_replicas != world_size:
                raise ValueError(f"num_replicas={num_replicas} and world_size={world_size} disagree")
            num_replicas = world_size
        self.num_replicas, self.rank = _world(num_replicas, rank)
        if not 0.0 <= random_level <= 1.0:
            raise ValueError(f"Invalid random level {random_level}, should be in the range [0.0, 1.0]")
        if group_size is not None and group_size < 1:
            raise ValueError(f"group_size must be a positive int or None, got {group_size}")
        if len(dataset) == 0:
            raise ValueError("LoadBalancingDistributedSampler needs a non-empty dataset")
        self.dataset = dataset
        self.complexity_fn = complexity_fn
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.random_level, self.group_size = random_level, group_size
        self.epoch = 0
        n = len(dataset)
        if drop_last and n % self.num_replicas:
            self.num_samples = n // self.num_replicas
        else:
            self.num_samples = math.ceil(n / self.num_replicas)
        if self.num_samples == 0:
            raise ValueError(f"drop_last=True leaves no samples: {n} samples for {self.num_replicas} replicas")
        self.total_size = self.num_samples * self.num_replicas
        self._complexities: np.ndarray | None = None

    @property
    def world_size(self) -> int:  # onnxruntime-training's name
        return self.num_replicas

    @property
    def complexities(self) -> np.ndarray:
        """Complexity of every sample (computed on first use)."""
        if self._complexities is None:
            values = [self.complexity_fn(self.dataset[i]) for i in range(len(self.dataset))]
            self._complexities = np.asarray(values, dtype=np.int64)
        return self._complexities

    def set_epoch(self, epoch: int) -> None:
        """Call at each epoch's start (on every rank) for a new, shared shuffle."""
        self.epoch = epoch

    def runs(self) -> list[list[int]]:
        """This epoch's runs: ``runs()[i][r]`` is the i-th sample of rank r."""
        complexities = self.complexities.copy()
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        spread = int((complexities.max() - complexities.min()) * self.random_level + 1)
        if spread > 1:
            complexities += torch.randint(spread, (len(complexities),), generator=g).numpy()
        n = len(complexities)
        group = self.group_size or n
        order = np.concatenate([start + np.argsort(complexities[start:start + group], kind="stable")
                                for start in range(0, n, group)])
        if self.shuffle and self.group_size is not None:
            groups = [order[start:start + group] for start in range(0, n, group)]
            order = np.concatenate([groups[i] for i in torch.randperm(len(groups), generator=g).tolist()])
        # Deal runs of num_replicas consecutive (similar) samples, wrapping around the end.
        wrapped = [int(order[i % n]) for i in range(self.total_size)]
        runs = [wrapped[i:i + self.num_replicas] for i in range(0, self.total_size, self.num_replicas)]
        if self.shuffle and self.group_size is None:
            runs = [runs[i] for i in torch.randperm(len(runs), generator=g).tolist()]
        return runs

    def indices_for(self, rank: int) -> list[int]:
        return [run[rank] for run in self.runs()]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices_for(self.rank))

    def __len__(self) -> int:
        return self.num_samples


class LoadBalancingDistributedBatchSampler(Sampler[list[int]]):
    """Batches of a ``LoadBalancingDistributedSampler``'s indices, as many on every rank.

    Args:
        sampler: a ``LoadBalancingDistributedSampler`` with ``drop_last=False``.
        batch_fn: ``indices -> list of batches (lists of indices)``; called for every rank's
            indices so all ranks agree on the number of batches.
        drop_last: keep only as many batches as the rank with the fewest; otherwise ranks with
            fewer batches repeat their first ones.
    """

    def __init__(self, sampler: LoadBalancingDistributedSampler,
                 batch_fn: Callable[[list[int]], Sequence[Sequence[int]]], drop_last: bool = False) -> None:
        if not isinstance(sampler, LoadBalancingDistributedSampler):
            raise ValueError(f"sampler should be a LoadBalancingDistributedSampler, got {type(sampler).__name__}")
        if sampler.drop_last:
            raise ValueError("drop_last of sampler should be False")
        self.sampler, self.batch_fn, self.drop_last = sampler, batch_fn, drop_last
        self.num_replicas, self.rank = sampler.num_replicas, sampler.rank
        self.generate_batches()

    def generate_batches(self) -> None:
        runs = self.sampler.runs()
        per_rank = [[list(b) for b in self.batch_fn([run[r] for run in runs])] for r in range(self.num_replicas)]
        if any(not batches for batches in per_rank):
            raise ValueError("batch_fn returned no batches for some rank")
        counts = [len(b) for b in per_rank]
        self.total_batch = min(counts) if self.drop_last else max(counts)
        self.padded_batches = [[b[i % len(b)] for i in range(self.total_batch)] for b in per_rank]

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)
        self.generate_batches()

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.padded_batches[self.rank])

    def __len__(self) -> int:
        return self.total_batch
