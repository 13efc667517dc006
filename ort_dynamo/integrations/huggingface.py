"""HuggingFace Trainer: turn the ``ort`` backend on with ``torch_compile_backend="onnxrt"``.

accelerate checks ``torch_compile_backend`` against its fixed ``DynamoBackend`` enum, which has
``ONNXRT`` ("onnxrt") but no "ort"; PyTorch dropped its own "onnxrt" backend, so ort_dynamo
answers to that name too. With ort_dynamo installed the name comes from the package's
``torch_dynamo_backends`` entry point; :func:`enable` registers it by hand for a source
checkout that is not pip-installed::

    from ort_dynamo.integrations import huggingface as ort_hf
    ort_hf.enable()
    args = TrainingArguments(..., torch_compile_backend="onnxrt")
    trainer = Trainer(model, args, optimizer_cls_and_kwargs=ort_hf.fused_adam(args))

Options reach the backend through ``ORT_DYNAMO_*`` variables (Trainer passes none itself).
"""

from __future__ import annotations

from typing import Any

__all__ = ["TRAINER_BACKEND_NAME", "enable", "fused_adam", "is_enabled"]

#: The name accelerate's ``DynamoBackend`` enum accepts and that maps onto ort_dynamo.
TRAINER_BACKEND_NAME = "onnxrt"

_OUR_ENTRY_POINT = "ort_dynamo.capture:ort_backend"


def is_enabled(name: str = TRAINER_BACKEND_NAME) -> bool:
    """True when ``torch.compile(backend=name)`` reaches ort_dynamo (entry point or :func:`enable`)."""
    from torch._dynamo.backends import registry

    from ..capture import ort_backend

    registry._lazy_import()  # loads torch's own backends and the installed entry points
    if name in registry._COMPILER_FNS:
        return registry._COMPILER_FNS[name] is ort_backend
    entry_point = registry._BACKENDS.get(name)
    return entry_point is not None and entry_point.value == _OUR_ENTRY_POINT


def enable(name: str = TRAINER_BACKEND_NAME) -> None:
    """Make ``torch.compile(backend=name)`` (default "onnxrt") run ort_dynamo. Idempotent.

    Raises ``RuntimeError`` if another backend already owns the name: we never replace it.
    """
    from torch._dynamo.backends import registry

    from ..capture import ort_backend

    if is_enabled(name):
        return
    if name in registry._BACKENDS or name in registry._COMPILER_FNS:
        owner = registry._COMPILER_FNS.get(name) or registry._BACKENDS.get(name)
        raise RuntimeError(
            f"the torch.compile backend name {name!r} already belongs to {owner!r}; ort_dynamo does "
            f"not replace it. Compile the model yourself with torch.compile(model, backend='ort') "
            f"and hand it to Trainer without torch_compile_backend.")
    registry.register_backend(ort_backend, name=name)


def fused_adam(args: Any = None, **overrides: Any) -> tuple[type, dict[str, Any]]:
    """``(FusedAdam, kwargs)`` for ``Trainer(optimizer_cls_and_kwargs=...)``.

    The ORTModule/optimum ``optim="adamw_ort_fused"`` spelling cannot pass Trainer's ``optim``
    enum check; this is its replacement. It updates like Trainer's default ``adamw_torch``
    (``AdamWMode.ADAMW_TORCH``); learning rate, betas and eps are read from ``args``
    (``TrainingArguments``); weight decay comes from Trainer's parameter groups (no decay on
    biases and norms). ``overrides`` (e.g. ``adam_w_mode=AdamWMode.ADAMW_TRANSFORMERS``) win.
    """
    from ..optim import AdamWMode, FusedAdam

    kwargs: dict[str, Any] = {"adam_w_mode": AdamWMode.ADAMW_TORCH}
    if args is not None:
        kwargs |= {"lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2),
                  "eps": args.adam_epsilon}
    kwargs.update(overrides)
    return FusedAdam, kwargs
