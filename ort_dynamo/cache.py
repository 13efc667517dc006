"""On-disk cache of exported, rewritten models (ORTModule's ORTMODULE_CACHE_DIR).

Key: the partition's FX code, its inputs' dtypes/shapes/devices, the options that change
the model, and the versions of every package that shapes it. A restarted process with the
same key skips export and rewrite. Entries are written atomically; a corrupt or foreign
entry is ignored and rewritten, never trusted. A folder that cannot be read or written (read-only,
full, not a folder) costs only the cache: compiling goes on without it, said once per folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import tempfile
import warnings

import torch
from torch.fx._lazy_graph_module import _LazyGraphModule
import torch.fx

from . import _openmp, _torch_blas
from .export import ExportedGraph, OutputSlot
from .options import OrtOptions

__all__ = ["cache_key", "load", "store", "load_json", "store_json", "versions_key", "write_atomically"]

log = logging.getLogger("ort_dynamo")
_FORMAT = 4  # 2: rewrites to fused kernels, view slots; 3: permuted inputs; 4: pointwise kernels


@functools.lru_cache(None)
def _versions() -> str:
    import onnx
    import onnx_ir
    import onnxruntime
    import onnxscript

    from . import __version__

    return "|".join([__version__, _own_source_digest(), torch.__version__, onnxruntime.__version__,
                     onnxscript.__version__, onnx.__version__, onnx_ir.__version__, str(_FORMAT)])


def _own_source_digest() -> str:
    """ort_dynamo's own code is part of every key: an edited lowering or rewrite invalidates
    the cache even when the version number did not change."""
    digest = hashlib.sha256()
    package = os.path.dirname(os.path.abspath(__file__))
    for folder, dirs, files in sorted(os.walk(package)):
        dirs.sort()
        for name in sorted(f for f in files if f.endswith((".py", ".h", ".c"))):
            with open(os.path.join(folder, name), "rb") as fh:
                digest.update(name.encode() + fh.read())
    return digest.hexdigest()[:16]


def _describe(val) -> str:
    if isinstance(val, torch.Tensor):
        return f"T({val.dtype},{tuple(str(d) for d in val.shape)},{tuple(str(d) for d in val.stride())},{val.device.type})"
    return f"S({type(val).__name__})"


def cache_key(gm: torch.fx.GraphModule, options: OrtOptions) -> str:
    inputs = [_describe(n.meta.get("val")) for n in gm.graph.nodes if n.op == "placeholder"]
    # save_onnx keeps provenance; the others pick ops the traced graph does not show.
    relevant = (options.opset, options.enable_compute_optimizer, options.deterministic_compute,
                options.pointwise_kernels, options.save_onnx, options.cpu_torch_attention,
                _torch_blas.applies(options, "cpu"), options.cpu_thread_pool, options.intra_op_num_threads,
                _openmp.applies(options, "cpu"))
    text = "\n".join([_versions(), repr(relevant), ";".join(inputs), _source(gm)])
    return hashlib.sha256(text.encode()).hexdigest()


def _source(gm: torch.fx.GraphModule) -> str:
    """The graph's Python code; for a partition not yet compiled to Python (they are made
    lazily), generated without compiling it."""
    if isinstance(gm, _LazyGraphModule) and gm._needs_recompile():
        return gm.graph.python_code(root_module="self").src
    return gm.code


_UNUSABLE: set[tuple[str, str]] = set()  # (cache_dir, "read" | "write"): said once each


def _unusable(cache_dir: str, action: str, exc: OSError) -> None:
    if (cache_dir, action) not in _UNUSABLE:
        _UNUSABLE.add((cache_dir, action))
        warnings.warn(f"ort_dynamo: cannot {action} the on-disk cache cache_dir={cache_dir!r} "
                      f"({type(exc).__name__}: {exc}); compiling without it", stacklevel=3)


def _paths(cache_dir: str, key: str) -> tuple[str, str]:
    base = os.path.join(cache_dir, key[:2], key)
    return base + ".onnx", base + ".json"


def load(cache_dir: str, key: str) -> tuple[ExportedGraph, bytes] | None:
    model_path, meta_path = _paths(cache_dir, key)
    try:
        with open(meta_path) as fh:
            meta = json.load(fh)
        with open(model_path, "rb") as fh:
            model_bytes = fh.read()
        if meta.get("key") != key or hashlib.sha256(model_bytes).hexdigest() != meta.get("model_sha256"):
            raise ValueError("key or checksum mismatch")
        exported = ExportedGraph(
            model=None,
            input_names=meta["input_names"],
            output_names=meta["output_names"],
            slots=[OutputSlot(slot["kind"], slot["index"], tuple(slot["value"]) if slot["kind"] in ("view", "permute") else slot["value"])
                   for slot in meta["slots"]],
            output_dtypes=[getattr(torch, name) for name in meta["output_dtypes"]],
            input_kinds=meta["input_kinds"],
            returns_tuple=meta["returns_tuple"],
            device=meta["device"],
            input_permutations=meta["input_permutations"],
            kernels=meta["kernels"],
            torch_threads=meta.get("torch_threads", False),
        )
        return exported, model_bytes
    except FileNotFoundError:
        return None
    except OSError as exc:
        _unusable(cache_dir, "read", exc)
        return None
    except Exception as exc:  # a damaged entry is a miss, never a wrong model
        log.warning("ignoring damaged cache entry %s: %s", meta_path, exc)
        return None


def store(cache_dir: str, key: str, exported: ExportedGraph, model_bytes: bytes) -> None:
    if any(slot.kind == "const" and not isinstance(slot.value, (type(None), bool, int, float))
           for slot in exported.slots):
        return  # not representable in JSON; simply not cached
    model_path, meta_path = _paths(cache_dir, key)
    meta = {
        "key": key,
        "model_sha256": hashlib.sha256(model_bytes).hexdigest(),
        "input_names": exported.input_names,
        "output_names": exported.output_names,
        "slots": [dataclasses.asdict(slot) for slot in exported.slots],
        "output_dtypes": [str(d).removeprefix("torch.") for d in exported.output_dtypes],
        "input_kinds": exported.input_kinds,
        "returns_tuple": exported.returns_tuple,
        "device": exported.device,
        "input_permutations": exported.input_permutations,
        "kernels": exported.kernels,
        "torch_threads": exported.torch_threads,
    }
    if _write(cache_dir, model_path, model_bytes):  # the metadata last: it makes the entry
        _write(cache_dir, meta_path, json.dumps(meta).encode())


def _write(cache_dir: str, path: str, data: bytes) -> bool:
    """``write_atomically``; a failure only warns (once per folder)."""
    try:
        write_atomically(path, data)
        return True
    except OSError as exc:
        _unusable(cache_dir, "write", exc)
        return False


def write_atomically(path: str, data: bytes) -> None:
    """Write ``path`` whole or not at all: concurrent processes never see half a file. Raises
    OSError (folder read-only, full, or a file), leaving no temporary file behind."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def versions_key(*parts) -> str:
    """A key for facts that depend only on the installed packages (and ``parts``)."""
    return hashlib.sha256("|".join([_versions(), *map(str, parts)]).encode()).hexdigest()


def load_json(cache_dir: str, key: str, kind: str):
    """A small cached fact (``kind`` names it), or None: missing or damaged is a miss."""
    path = os.path.join(cache_dir, key[:2], f"{key}.{kind}.json")
    try:
        with open(path) as fh:
            entry = json.load(fh)
        if entry.get("key") != key:
            raise ValueError("key mismatch")
        return entry["value"]
    except FileNotFoundError:
        return None
    except OSError as exc:
        _unusable(cache_dir, "read", exc)
        return None
    except Exception as exc:
        log.warning("ignoring damaged cache entry %s: %s", path, exc)
        return None


def store_json(cache_dir: str, key: str, kind: str, value) -> None:
    path = os.path.join(cache_dir, key[:2], f"{key}.{kind}.json")
    _write(cache_dir, path, json.dumps({"key": key, "value": value}).encode())
