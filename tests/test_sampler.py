"""Load-balancing samplers: exclusive shards, balanced total complexity, per-epoch shuffles."""

import random

import pytest
import torch

from ort_dynamo.utils.data import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler


def skewed_dataset(n=400, seed=0):
    """Variable-length 'sentences': 85% short (4-32 tokens), 15% long (200-512 tokens)."""
    rng = random.Random(seed)
    return [list(range(rng.randint(4, 32) if rng.random() < 0.85 else rng.randint(200, 512))) for _ in range(n)]


def samplers(dataset, num_replicas, **kwargs):
    return [LoadBalancingDistributedSampler(dataset, complexity_fn=len, num_replicas=num_replicas, rank=r, **kwargs)
            for r in range(num_replicas)]


@pytest.mark.parametrize("group_size", [None, 50])
def test_every_sample_on_exactly_one_rank_each_epoch(group_size):
    dataset = skewed_dataset(400)
    shards = samplers(dataset, 4, group_size=group_size)
    for epoch in range(3):
        per_rank = []
        for s in shards:
            s.set_epoch(epoch)
            per_rank.append(list(s))
        assert all(len(ix) == 100 == len(s) for ix, s in zip(per_rank, shards))
        everything = sorted(i for ix in per_rank for i in ix)
        assert everything == list(range(400))


def test_uneven_dataset_wraps_or_drops_like_distributed_sampler():
    dataset = skewed_dataset(10)
    padded = [list(s) for s in samplers(dataset, 4)]
    assert [len(ix) for ix in padded] == [3] * 4
    assert set().union(*map(set, padded)) == set(range(10))  # 2 samples appear twice
    dropped = [list(s) for s in samplers(dataset, 4, drop_last=True)]
    assert [len(ix) for ix in dropped] == [2] * 4
    assert len(set().union(*map(set, dropped))) == 8


def test_ranks_total_complexity_is_balanced_on_skewed_data():
    dataset = skewed_dataset(400)
    lengths = [len(x) for x in dataset]
    totals = [sum(lengths[i] for i in s) for s in samplers(dataset, 4)]
    # Dealing sorted runs bounds the spread by max - min; random sharding is far worse.
    assert max(totals) - min(totals) <= max(lengths) - min(lengths)
    plain = [sum(lengths[i] for i in torch.utils.data.DistributedSampler(dataset, 4, r, seed=0))
             for r in range(4)]
    assert max(totals) - min(totals) < (max(plain) - min(plain)) / 3
    # random_level=1 trades balance for randomness but still covers everything once.
    noisy = samplers(dataset, 4, random_level=1.0)
    assert sorted(i for s in noisy for i in s) == list(range(400))


def test_epochs_reshuffle_deterministically():
    dataset = skewed_dataset(200)
    a, b = LoadBalancingDistributedSampler(dataset, len, 2, 0, seed=7), LoadBalancingDistributedSampler(dataset, len, 2, 0, seed=7)
    orders = []
    for epoch in range(3):
        a.set_epoch(epoch)
        b.set_epoch(epoch)
        assert list(a) == list(b)  # same seed and epoch, same order (on every rank)
        orders.append(list(a))
    assert orders[0] != orders[1] != orders[2]
    a.set_epoch(1)
    assert list(a) == orders[1]
    fixed = LoadBalancingDistributedSampler(dataset, len, 2, 0, shuffle=False)
    first = list(fixed)
    fixed.set_epoch(5)
    assert list(fixed) == first
    lengths = [len(dataset[i]) for i in first]
    assert lengths == sorted(lengths)  # unshuffled: ascending complexity


def test_batch_sampler_with_dataloader_gives_equal_batch_counts():
    dataset = skewed_dataset(120)
    token_budget = 200

    def batch_fn(indices):
        """Token-budget batches: many short samples or few long ones."""
        batches, current, tokens = [], [], 0
        for i in indices:
            if current and tokens + len(dataset[i]) > token_budget:
                batches.append(current)
                current, tokens = [], 0
            current.append(i)
            tokens += len(dataset[i])
        return batches + [current] if current else batches

    batch_samplers = [LoadBalancingDistributedBatchSampler(s, batch_fn) for s in samplers(dataset, 3)]
    for epoch in range(2):
        seen = []
        for bs in batch_samplers:
            bs.set_epoch(epoch)
            loader = torch.utils.data.DataLoader(dataset, batch_sampler=bs, collate_fn=lambda b: b)
            batches = list(loader)
            assert len(batches) == len(bs) == batch_samplers[0].total_batch
            seen.append({id(x) for batch in batches for x in batch})
        assert set().union(*seen) == {id(x) for x in dataset}
    dropping = LoadBalancingDistributedBatchSampler(samplers(dataset, 3)[0], batch_fn, drop_last=True)
    assert len(list(dropping)) == len(dropping) <= batch_samplers[0].total_batch


def test_bad_arguments():
    data = skewed_dataset(10)
    with pytest.raises(ValueError, match="Invalid rank"):
        LoadBalancingDistributedSampler(data, len, num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="random level"):
        LoadBalancingDistributedSampler(data, len, 2, 0, random_level=1.5)
    with pytest.raises(RuntimeError, match="torch.distributed"):
        LoadBalancingDistributedSampler(data, len)
    with pytest.raises(ValueError, match="drop_last of sampler"):
        LoadBalancingDistributedBatchSampler(LoadBalancingDistributedSampler(data, len, 2, 0, drop_last=True), list)
    assert LoadBalancingDistributedSampler(data, len, world_size=2, rank=1).num_replicas == 2


def test_public_path():
    import ort_dynamo

    assert ort_dynamo.utils.data.LoadBalancingDistributedSampler is LoadBalancingDistributedSampler
    assert ort_dynamo.utils.data.LoadBalancingDistributedBatchSampler is LoadBalancingDistributedBatchSampler
