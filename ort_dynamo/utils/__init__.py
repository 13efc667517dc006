"""Utilities around the ort backend: convergence hooks (hooks/), data helpers (data/)."""


def __getattr__(name: str):
    """``ort_dynamo.utils.data`` / ``.hooks`` load on first use."""
    if name in ("data", "hooks"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'ort_dynamo.utils' has no attribute {name!r}")
