"""Data helpers: load-balancing distributed samplers (onnxruntime-training's utils.data)."""

from .sampler import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler

__all__ = ["LoadBalancingDistributedBatchSampler", "LoadBalancingDistributedSampler"]
