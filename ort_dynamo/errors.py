"""The errors ort_dynamo raises. They reach the user as themselves, not wrapped by Dynamo.

Dynamo wraps any backend exception in ``BackendCompilerFailed`` except ``ShortenTraceback``
subclasses; deriving from it keeps ``except ValueError`` and friends working for users.
"""

from __future__ import annotations

try:
    from torch._dynamo.exc import ShortenTraceback as _DynamoPassThrough
except ImportError:  # older torch: errors arrive wrapped, with ours as inner_exception
    _DynamoPassThrough = RuntimeError

__all__ = ["OrtDynamoError", "OptionsError", "UnsupportedOpError", "ExportFailedError", "OrtRuntimeError"]


class OrtDynamoError(_DynamoPassThrough):
    """Base of every ort_dynamo error (a RuntimeError)."""

    first_useful_frame = None  # set even when a builtin base's __init__ runs first

    def __init__(self, *args) -> None:
        if _DynamoPassThrough is RuntimeError:
            super().__init__(*args)
        else:
            super().__init__(*args, first_useful_frame=None)


class OptionsError(ValueError, OrtDynamoError):
    """An option (or its environment variable) is unknown or has a bad value."""


class UnsupportedOpError(OrtDynamoError):
    """An op has no ONNX lowering and the fallback policy forbids running it in PyTorch."""


class ExportFailedError(OrtDynamoError):
    """A partition could not be exported to ONNX and the fallback policy forbids PyTorch."""


class OrtRuntimeError(OrtDynamoError):
    """ORT could not create a session for, or run, a partition."""
