"""RecordingSubscriber: keeps activations and gradients in memory (what ``compare`` diffs)."""

from __future__ import annotations

import torch

from ._subscriber_manager import SubscriberBase

__all__ = ["RecordingSubscriber"]


class RecordingSubscriber(SubscriberBase):
    """Holds CPU copies of every activation (``"forward"``) and gradient (``"backward"``).

    ``records[step]`` maps ``(kind, name)`` to the tensor, in the order they arrived.
    """

    def __init__(self, start_step: int | None = None, end_step: int | None = None) -> None:
        super().__init__(start_step, end_step)
        self.records: dict[int, dict[tuple[str, str], torch.Tensor]] = {}

    def on_forward(self, name: str, tensor: torch.Tensor, depth: int, step: int) -> None:
        self.records.setdefault(step, {})[("forward", name)] = tensor.detach().to("cpu", copy=True)

    def on_backward(self, name: str, grad: torch.Tensor, depth: int, step: int) -> None:
        self.records.setdefault(step, {})[("backward", name)] = grad.detach().to("cpu", copy=True)

    def pop(self, step: int) -> dict[tuple[str, str], torch.Tensor]:
        return self.records.pop(step, {})
