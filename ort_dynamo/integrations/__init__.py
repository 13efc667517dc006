"""Glue between ort_dynamo and other libraries (HuggingFace Trainer, ...).

Each integration is a submodule imported on demand, so ``import ort_dynamo`` never pulls in
``transformers`` or ``accelerate``.
"""
