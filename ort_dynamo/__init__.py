"""ort_dynamo: ``torch.compile(model, backend="ort")`` trains on ONNX Runtime.

The public API lives here and nowhere else.
"""

from __future__ import annotations

from .capture import OrtBackend, ort_backend, register_name_without_entry_point
from .errors import ExportFailedError, OptionsError, OrtDynamoError, OrtRuntimeError, UnsupportedOpError
from .options import FallbackPolicy, LogLevel, OrtOptions
from .report import FallbackNode, GraphReport, Report

__version__ = "0.1.0"

register_name_without_entry_point()

__all__ = [
    "ExportFailedError", "FallbackNode", "OptionsError", "OrtDynamoError", "FallbackPolicy", "GraphReport", "LogLevel",
    "OrtBackend", "OrtOptions", "OrtRuntimeError", "Report", "UnsupportedOpError",
    "ort_backend", "report", "reset", "wait_for_kernels",
]


_SUBMODULES = ("debug", "inspectors", "integrations", "optim", "utils")


def __getattr__(name: str):
    """``ort_dynamo.optim`` etc. load on first use: ``import ort_dynamo`` stays light."""
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'ort_dynamo' has no attribute {name!r}")


def report() -> Report:
    """What the backend compiled since the last ``reset()``: graphs, ORT/PyTorch nodes, fallbacks."""
    from .report import current_report

    return current_report()


def wait_for_kernels() -> None:
    """Block until the pointwise kernels being compiled in the background are built. Steps
    before that run each partition without its kernels (same results within rounding, less
    speed); call this after a warm-up step to measure, or to pin the numerics, from the start."""
    from ._kernels import wait

    wait()


def reset() -> None:
    """Clear the report and the once-per-cause warnings, and reset Dynamo: compiled graphs
    and their ORT sessions are dropped, so the next call recompiles. The on-disk
    ``cache_dir`` is kept (delete the folder to clear it)."""
    import torch._dynamo

    from .partition import _WARNED
    from .report import clear_report

    torch._dynamo.reset()
    clear_report()
    _WARNED.clear()
