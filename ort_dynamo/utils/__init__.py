"""Utilities around the ort backend: convergence hooks (hooks/), data helpers (data/)."""
