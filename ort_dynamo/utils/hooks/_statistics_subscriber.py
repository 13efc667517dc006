"""StatisticsSubscriber: one file of statistics per activation and per gradient, per step.

Layout (``rank_<r>/`` is inserted when ``torch.distributed`` is initialized)::

    output_dir/step_<n>/order.txt                         file names in the order they were written
    output_dir/step_<n>/<Module>_<index>_<i>th_output_forward    statistics of the activation
    output_dir/step_<n>/<Module>_<index>_<i>th_output_backward   statistics of its gradient
"""

from __future__ import annotations

import math
import os
import shutil
import warnings
from typing import TextIO

import torch

from ._subscriber_manager import SubscriberBase

__all__ = ["StatisticsSubscriber", "summarize_tensor", "SAMPLE_COUNT"]

#: Values written verbatim at the end of each summary.
SAMPLE_COUNT = 128


def _rank_dir(output_dir: str) -> str:
    """Per-rank folder when running distributed: ranks never write the same file."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return os.path.join(output_dir, f"rank_{dist.get_rank()}")
    return output_dir


class StatisticsSubscriber(SubscriberBase):
    """Writes activation statistics of steps in ``[start_step, end_step)`` under ``output_dir``.

    Args:
        output_dir: folder for the statistics; per rank ``output_dir/rank_<r>`` when
            ``torch.distributed`` is initialized (construct the subscriber after
            ``init_process_group``).
        start_step: first step to record (None = from the start).
        end_step: step to stop at, exclusive (None = never stop).
        override_output_dir: delete an existing ``output_dir`` instead of raising.
        run_on_cpu: copy each bucket to CPU before computing: the last resort when the
            statistics' temporaries raise the GPU memory peak.
        bucket_size: elements per bucket; statistics of a large tensor are computed bucket by
            bucket and combined, so temporaries stay at ``bucket_size`` elements.
    """

    def __init__(self, output_dir: str, start_step: int | None = None, end_step: int | None = None,
                 override_output_dir: bool = False, run_on_cpu: bool = False,
                 bucket_size: int = 1024 * 1024) -> None:
        super().__init__(start_step, end_step)
        if not isinstance(output_dir, (str, os.PathLike)) or not os.fspath(output_dir):
            raise ValueError(f"output_dir must be a non-empty path, got {output_dir!r}")
        if not isinstance(bucket_size, int) or isinstance(bucket_size, bool) or bucket_size < 2:
            raise ValueError(f"bucket_size must be an int >= 2, got {bucket_size!r}")
        self.output_dir = _rank_dir(os.fspath(output_dir))
        self.run_on_cpu = bool(run_on_cpu)
        self.bucket_size = bucket_size
        if os.path.exists(self.output_dir):
            if not override_output_dir:
                raise FileExistsError(
                    f"output directory {self.output_dir} already exists; pass "
                    "override_output_dir=True to StatisticsSubscriber to replace it")
            warnings.warn(f"StatisticsSubscriber: replacing existing {self.output_dir}", stacklevel=2)
            shutil.rmtree(self.output_dir)

    def on_forward(self, name: str, tensor: torch.Tensor, depth: int, step: int) -> None:
        self._write(name + "_forward", name + " forward", tensor, depth, step)

    def on_backward(self, name: str, grad: torch.Tensor, depth: int, step: int) -> None:
        self._write(name + "_backward", name + " backward", grad, depth, step)

    def _write(self, file_name: str, title: str, tensor: torch.Tensor, depth: int, step: int) -> None:
        step_dir = os.path.join(self.output_dir, f"step_{step}")
        os.makedirs(step_dir, exist_ok=True)
        with open(os.path.join(step_dir, "order.txt"), "a", encoding="utf-8") as fh:
            fh.write(file_name + "\n")
        with open(os.path.join(step_dir, file_name), "w", encoding="utf-8") as fh:
            summarize_tensor(title, tensor, fh, depth, self.run_on_cpu, self.bucket_size)


def _bucket_stats(flat: torch.Tensor, bucket_size: int, run_on_cpu: bool) -> dict:
    """Counts, min/max and mean/std combined over buckets (Chan's parallel variance)."""
    total = flat.numel()
    stats = dict(nan=0, inf=0, neg=0, zero=0, pos=0, min=math.inf, max=-math.inf)
    count, mean, m2 = 0, 0.0, 0.0
    for start in range(0, total, bucket_size):
        bucket = flat[start:start + bucket_size]
        if run_on_cpu:
            bucket = bucket.cpu()
        values = bucket.to(torch.float64)
        stats["nan"] += int(torch.isnan(values).sum())
        stats["inf"] += int(torch.isinf(values).sum())
        stats["neg"] += int((values < 0).sum())
        stats["zero"] += int((values == 0).sum())
        stats["pos"] += int((values > 0).sum())
        low, high = float(values.min()), float(values.max())
        stats["min"] = low if math.isnan(low) else min(stats["min"], low)
        stats["max"] = high if math.isnan(high) else max(stats["max"], high)
        n = values.numel()
        bucket_mean = float(values.mean())
        bucket_m2 = float(((values - bucket_mean) ** 2).sum())
        delta = bucket_mean - mean
        combined = count + n
        mean += delta * n / combined
        m2 += bucket_m2 + delta * delta * count * n / combined
        count = combined
    stats["mean"] = mean
    stats["std"] = math.sqrt(m2 / (count - 1)) if count > 1 else math.nan
    return stats


def _fmt(value: float) -> str:
    return f"{value:.8g}"


def summarize_tensor(title: str, tensor: torch.Tensor, out: TextIO, depth: int = 0,
                     run_on_cpu: bool = False, bucket_size: int = 1024 * 1024) -> None:
    """Write ``tensor``'s statistics to ``out``; the format merge_activation_summary expects."""
    flat = tensor.detach().reshape(-1)
    out.write(f"{'>' * max(depth, 0)}{title} shape: {list(tensor.shape)} dtype: {tensor.dtype} "
              f"numel: {flat.numel()}\n")
    if flat.numel() == 0:
        out.write("empty tensor\n" + "=" * 16 + "\n")
        return
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    s = _bucket_stats(flat, bucket_size, run_on_cpu)
    out.write(f"min: {_fmt(s['min'])} max: {_fmt(s['max'])} mean: {_fmt(s['mean'])} "
              f"std: {_fmt(s['std'])}\n")
    out.write(f"nan: {s['nan']} inf: {s['inf']}\n")
    out.write(f"neg: {s['neg']} zero: {s['zero']} pos: {s['pos']}\n")
    samples = flat[:SAMPLE_COUNT].cpu().to(torch.float64).tolist()
    out.write(f"samples (first {len(samples)}):\n")
    for row in range(0, len(samples), 8):
        out.write(" ".join(_fmt(v) for v in samples[row:row + 8]) + "\n")
    out.write("=" * 16 + "\n")
