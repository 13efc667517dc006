"""ORT sessions and IOBindings for optimizer graphs: tensors bound by pointer, written in place.

On CPU a graph's elementwise chains can run as generated pointwise kernels (``_pointwise``):
one pass over each parameter's tensors in place of one pass per op. They compile in the
background; until they are built, the plain graph runs.
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import logging
import re
import warnings
from typing import Sequence

import onnx
import onnx_ir as ir
import onnxruntime as ort
import torch
from onnxruntime.capi import _pybind_state as C

from .. import _kernels, _openmp, _pointwise
from ..errors import OrtRuntimeError
from ..options import resolve_options
from ..run import ort_device, providers_for, run_options, session_options

__all__ = ["BoundSession", "input_names", "onnx_type"]

log = logging.getLogger("ort_dynamo")

_ONNX_TYPES = {
    torch.float32: 1, torch.uint8: 2, torch.int8: 3, torch.int16: 5, torch.int32: 6, torch.int64: 7,
    torch.bool: 9, torch.float16: 10, torch.float64: 11, torch.bfloat16: 16,
}


@functools.lru_cache(maxsize=256)
def input_names(prefix: str, n: int, suffix: str = "") -> tuple[str, ...]:
    """``("p0", "p1", ...)``: graph input/output names, cached per count."""
    return tuple(f"{prefix}{i}{suffix}" for i in range(n))


def onnx_type(dtype: torch.dtype) -> int:
    try:
        return _ONNX_TYPES[dtype]
    except KeyError:
        raise TypeError(f"no ONNX element type for {dtype}") from None


_TENSOR_NAME = re.compile(r"[a-z]+(\d+)(?:_out)?")


def with_pointwise_kernels(model_bytes: bytes) -> tuple[bytes, list[str]]:
    """``model_bytes`` with its elementwise chains fused into pointwise kernels, and the
    kernels' C code (empty if nothing fused). The flat tensors of one index (``p3``, ``g3``,
    ``m3_out``...) get one symbolic size, so a kernel serves every parameter whatever its size
    (and the small ones, which a static size would leave unfused, are fused too)."""
    proto = onnx.load_from_string(model_bytes)
    for info in itertools.chain(proto.graph.input, proto.graph.output):
        match = _TENSOR_NAME.fullmatch(info.name)
        dims = info.type.tensor_type.shape.dim
        if match and len(dims) == 1:
            dims[0].dim_param = f"n{match.group(1)}"
    model = ir.serde.deserialize_model(onnx.shape_inference.infer_shapes(proto, strict_mode=True))
    kernels = _pointwise.fuse_pointwise(model)
    if not kernels:
        return model_bytes, []
    ir.passes.common.RemoveUnusedNodesPass()(model)
    return ir.serde.serialize_model(model).SerializeToString(), kernels


class BoundSession:
    """An InferenceSession plus one IOBinding whose buffers are PyTorch tensors' storage.

    ``bind(names, tensors, output=...)`` rebinds only the names whose pointer changed since
    the last call, so steady-state steps (same params, same state, same grad buffers) bind
    nothing. Tensors are bound as flat 1-D buffers (0-d ones as scalars); callers pass dense
    tensors, and always the same list of names for a given first name.

    ``pointwise_kernels``: on CPU, build the graph's elementwise chains as kernels (as the
    model's partitions do, same option) and switch to them once built.
    """

    def __init__(self, model_bytes: bytes, device: torch.device, pointwise_kernels: bool = False) -> None:
        self.device = device
        self._ort_device = ort_device(device)
        self._run_options = run_options(device)
        self._bound: dict[tuple, list[int]] = {}
        #: (name, output) -> (element type, shape, pointer) of everything bound, to bind again
        #: when the session with the kernels takes over.
        self._specs: dict[tuple, tuple] = {}
        self._options = options = resolve_options(None)
        #: (model, future library, kernel count) while the kernels build; None once switched
        #: (or none wanted).
        self._pending = None
        #: Distinct pointwise kernels of the graph now running.
        self.kernels = 0
        #: The session with the kernels runs on PyTorch's OpenMP threads (``_openmp``): as the
        #: model's sessions do, so that neither pool's threads spin against the other's.
        self._torch_threads = False
        self.session = self._binding = None
        built = None
        if (pointwise_kernels and device.type == "cpu" and options.pointwise_kernels
                and options.enable_compute_optimizer and not options.deterministic_compute
                and _kernels.available()):
            try:
                fused, kernels = with_pointwise_kernels(model_bytes)
            except Exception as exc:  # an optimization: the plain graph runs
                log.warning("ort_dynamo: an optimizer graph runs without pointwise kernels, the fusion "
                            "failed: %s: %s", type(exc).__name__, exc)
                kernels = []
            if kernels:
                self._torch_threads = _openmp.applies(options, "cpu", products=False)
                built = _kernels.built(kernels, options.cache_dir, self._torch_threads)
                if built:
                    library = concurrent.futures.Future()
                    library.set_result(built)
                else:
                    library = _kernels.build(kernels, options.cache_dir, self._torch_threads)
                self._pending = (fused, library, len(kernels))
        if built:
            # An earlier process built them (an update's kernel is the same for any model): no
            # session of the plain graph, which would cost memory and a slower first step.
            self._switch_to_kernels(fallback=model_bytes)
        else:
            self._open(model_bytes, "")

    def _open(self, model_bytes: bytes, library: str) -> None:
        options = self._options
        so = session_options(options, self.device.type, library, self.device.index or 0,
                             torch_threads=self._torch_threads and bool(library))
        # Basic level: constant folding and Identity removal; the graph is already minimal.
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        try:
            self.session = ort.InferenceSession(model_bytes, so, providers=providers_for(self.device, options))
        except OrtRuntimeError:
            raise
        except Exception as exc:
            raise OrtRuntimeError(f"ONNX Runtime could not load an optimizer graph: {exc}") from exc
        self._binding = C.SessionIOBinding(self.session._sess)
        for (name, output), (elem_type, shape, ptr) in self._specs.items():
            fn = self._binding.bind_output if output else self._binding.bind_input
            fn(name, self._ort_device, elem_type, shape, ptr)

    def _switch_to_kernels(self, fallback: bytes = b"") -> None:
        """The session with the kernels replaces the plain one; if they cannot be built or
        loaded, the plain one stays, or is opened from ``fallback`` where there was none yet
        (said once): an optimization never costs the step."""
        fused, future, count = self._pending
        self._pending = None
        plain = (self.session, self._binding)
        try:
            self._open(fused, future.result())
        except Exception as exc:  # noqa: BLE001 - a build error or a library ORT refuses
            warnings.warn(f"ort_dynamo: an optimizer graph runs without its pointwise kernels: "
                          f"{type(exc).__name__}: {str(exc)[:300]}", stacklevel=3)
            if plain[0] is None:
                self._open(fallback, "")
            else:
                self.session, self._binding = plain
            return
        self.kernels = count

    def bind(self, names: Sequence[str], tensors: Sequence[torch.Tensor], output: bool) -> None:
        """Bind ``tensors`` to ``names``; dtypes and sizes are fixed by the graph, so only
        pointers are compared (one list compare when nothing moved)."""
        ptrs = [t.data_ptr() for t in tensors]
        slot = (names[0], output)
        last = self._bound.get(slot)
        if last == ptrs:
            return
        fn = self._binding.bind_output if output else self._binding.bind_input
        device = self._ort_device
        for i, (name, t, ptr) in enumerate(zip(names, tensors, ptrs)):
            if last is None or last[i] != ptr:
                spec = (_ONNX_TYPES[t.dtype], [t.numel()] if t.dim() else [], ptr)
                fn(name, device, *spec)
                self._specs[(name, output)] = spec
        self._bound[slot] = ptrs

    def run(self) -> None:
        if self._pending is not None and self._pending[1].done():
            self._switch_to_kernels()
        self.session._sess.run_with_iobinding(self._binding, self._run_options)
