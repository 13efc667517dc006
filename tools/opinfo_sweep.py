#!/usr/bin/env python3
"""OpInfo sweep: every float32 CPU OpInfo of torch's ``op_db`` through ``backend="ort"``.

For each op, its first ``--samples`` sample inputs run eagerly and through
``torch.compile(fn, backend="ort", dynamic=False)``; forward outputs and input gradients
(ops that support autograd) are compared. Per op we record pass / mismatch / error /
timeout and the nodes that fell back to PyTorch (``ort_dynamo.report().fallbacks``).

    .venv/bin/python tools/opinfo_sweep.py                       # all ops -> docs/ops.json + docs/ops.md
    .venv/bin/python tools/opinfo_sweep.py --ops add,nn.functional.gelu --out /tmp/x.json
    .venv/bin/python tools/opinfo_sweep.py --resume              # skip ops already in the JSON
    .venv/bin/python tools/opinfo_sweep.py --report-only         # regenerate docs/ops.md

Ops run in long-lived worker processes (``--jobs``); a worker stuck on one op for more than
``--timeout`` seconds is killed, the op recorded as ``timeout`` and a new worker takes the
rest. Results are written to the JSON after every op, so an interrupted sweep resumes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import queue
import shlex
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_JSON = os.path.join(ROOT, "docs", "ops.json")
DEFAULT_MD = os.path.join(ROOT, "docs", "ops.md")

#: Ops whose values are random by design: only shapes and dtypes are compared
#: (ORT's random ops draw their own numbers; see docs/ops.md).
RANDOM_OPS = {
    "bernoulli", "normal", "normal.number_mean", "normal.in_place", "rand_like", "randn_like",
    "randint_like", "randint", "randn", "rand", "multinomial", "uniform", "cauchy", "exponential",
    "geometric", "log_normal", "nn.functional.dropout", "nn.functional.dropout2d",
    "nn.functional.dropout3d", "nn.functional.alpha_dropout", "nn.functional.feature_alpha_dropout",
    "nn.functional.feature_alpha_dropout.with_train", "nn.functional.feature_alpha_dropout.without_train",
    "nn.functional.rrelu", "nn.functional.fractional_max_pool2d", "nn.functional.fractional_max_pool3d", "new_empty", "new_empty_strided", "empty_like", "empty",
    "empty_strided", "empty_permuted", "nn.functional.multi_head_attention_forward",
    "torch.empty", "bernoulli", "native_dropout_backward", "_refs.empty", "_refs.empty_like",
}

#: Hand-written part of docs/ops.md: what the sweep found and how ort_dynamo handles it.
NOTES = """## Wrong results found by the sweep, and their fixes

Each was a silently wrong value before; each is now either computed correctly on ORT or
left in PyTorch with a reason in `ort_dynamo.report()`.

| problem | where | fix (file) |
|---|---|---|
| `ScatterND(reduction="add")` sums repeated indices from several threads without synchronization: an embedding gradient with repeated tokens was off by up to 7%, differently each run (also `index_put(accumulate=True)`, `index_add`, interpolate's and grid_sample's backward) | onnxruntime 1.31 CPU kernel (torchlib lowers to it) | accumulating `index_put` through adjacent index tensors and `index_add` become `scatter_add` (ScatterElements, which sums correctly); index tensors apart from each other stay in PyTorch with that reason (decompositions.py, partition.py; tests/test_op_gaps.py). On CPU with pointwise kernels, the whole-row scatter-adds (embedding gradients) run as our `ScatterAddRows` kernel, parallel over columns, a tenth of ScatterElements' time (tests/test_pointwise.py) |
| `ReduceMax`/`ReduceMin` pass over NaN: the `amax`, `amin`, `max`, `min` (and `max.dim`/`min.dim` values) of values holding a NaN came out finite (torch: NaN) | onnxruntime 1.31 CPU kernels | every float ReduceMax/ReduceMin also reduces `IsNaN` over the same axes and yields NaN where one was seen (rewrite.py; tests/test_op_gaps.py) |
| `ArgMax`/`ArgMin` pass over NaN: `argmax`, `argmin` and the `max.dim`/`min.dim` indices pointed at a number (torch: the first NaN) | onnxruntime 1.31 CPU kernels | every float ArgMax/ArgMin also finds the first `IsNaN` and takes it where the slice holds one (rewrite.py; tests/test_corner_cases.py) |
| `TopK` puts NaNs anywhere: `sort`, `argsort`, `msort`, `topk`, `kthvalue` of values holding a NaN came out in the wrong order (torch: NaN above +inf) | onnxruntime 1.31 CPU kernel | every float TopK becomes two stable full sorts, by the value with NaN as +inf, then by the NaN flag, and the first K of that (rewrite.py; tests/test_corner_cases.py). Among equal values, `topk` and `kthvalue` return the lowest index; torch does not promise which |
| `sign(nan)` is NaN (torch: 0); `heaviside(nan, v)` is 1 (torch: 0); `cummax`/`cummin` indices were -1 from a NaN on (torch: the last NaN's index) | ONNX `Sign`; torchlib; our decomposition | `sign`/`sgn` as `(x > 0) - (x < 0)` and `heaviside` as `x == 0 ? v : x > 0` (lowerings/fixes.py); the cumulative index counts a NaN as reaching the NaN extreme (decompositions.py); tests/test_corner_cases.py |
| `Clip` with one bound missing clips to the type's largest value: `clamp(min=...)`, `clamp_min`, `clamp_max` turned +inf into 3.4e38 (and `normalize` of a row holding inf gave inf, torch NaN) | onnxruntime 1.31 CPU kernel | a one-sided clamp is a `Max` or `Min` (lowerings/fixes.py; tests/test_corner_cases.py) |
| integer `div(rounding_mode="floor"/"trunc")` divided in float32: wrong beyond 2**24 (2**40 // -7 was off by 7000) | torchlib | exact int64 `Div`, rounded down by the remainder's sign; ORT reports a zero divisor, the partition falls back and PyTorch raises ZeroDivisionError as eager (lowerings/fixes.py) |
| float floor division and `remainder` as `floor(a / b)`: `1 // 0.1` was 10 (torch 9), `1 % 0.1` 0 (torch 0.09999), `0 % inf` NaN (torch 0), `inf // 1` inf (torch NaN) | torchlib | c10's algorithms, from `fmod` (ONNX `Mod(fmod=1)`) (lowerings/fixes.py) |
| `log1p`, `expm1` as `Log(1 + x)`, `Exp(x) - 1`: 5% off at x = 1e-6, 0 for tiny x (also `xlog1py`, `logsigmoid`, `log_ndtr`) | torchlib | Goldberg's and Kahan's formulas, a few ulp (lowerings/fixes.py) |
| `atan2` mapped every NaN to 0 (for atan2(0, 0)): `atan2(nan, 1)` was 0, `atan2(inf, inf)` 0 (torch pi/4); `xlogy(0, nan)` was 0 (torch NaN); `logaddexp(-inf, 1e30)` was inf; `hypot(inf, nan)` NaN (torch inf) and `hypot(0, 1e30)` inf; `(-inf) ** 0.5` inf (torch NaN); `ndtri(nan)` a number | torchlib; torch's hypot decomposition; our ndtri | each written out with its special values (lowerings/fixes.py, decompositions.py, lowerings/special.py; tests/test_corner_cases.py) |
| Python floats that no tensor input types (`op.CastLike(0.1, self)`, `scalar_tensor(0.1, dtype=float64)`) became float32 constants: in float64 graphs `x * 0.1` was `x * float32(0.1)` (1.5e-8 off), `clamp_min(1e-12)` clamped at 9.99999996e-13, `nan_to_num(inf)` gave inf | torchlib (through torch.onnx's exporter, which makes an untyped Python float a float32 constant) | `scalar_tensor` (which the type promotion makes of every scalar operand), `full`, `full_like`, `new_full`, `fill`, `masked_fill`, `sinc` (its pi) and our own lowerings make the constant in the result's dtype (lowerings/fixes.py; tests/test_export.py). Scalar arguments torchlib takes as ONNX attributes, which are float32, are still rounded to float32 in float64 graphs (1e-8 relative): `leaky_relu`'s slope, `elu`/`celu` alpha, `softplus` beta, `hardtanh` bounds, `addcmul`/`addcdiv` value |
| `Sigmoid` on CPU is a float32 approximation: 0 below about -16 (torch: 2.1e-9 at -20), and float64 sigmoid float32-accurate (0.1% off at -30); `erfc` as `1 - erf`: 0.1% off at 3, 0 at 5 (torch 1.5e-12) | onnxruntime 1.31 CPU kernel; torchlib | on CPU, `Sigmoid` is written as `1 / (1 + exp(-x))` (the pointwise kernels fuse it as before; rewrite.py); `erfc` from `exp(-x^2) erfcx(x)` in float64 from 0.5 on, float64 inputs in PyTorch (lowerings/special.py; tests/test_corner_cases.py) |
| bfloat16 `hardtanh`/`relu6` failed in ORT (`Clip` given float32 data and bfloat16 bounds) and ran in PyTorch | our bf16 -> fp32 rewrite: the bounds, `CastLike` outputs inside torchlib's function, carry no dtype after inlining | `CastLike`/`Cast` outputs get their dtype before the rewrite (rewrite.py; tests/test_autocast.py) |
| a -0.0 that ORT's `Where` selects from its first branch comes out as +0.0; so the sign of a zero result can differ from eager's in some ops (`fmax`/`fmin`, `heaviside`, `celu`, `erfinv`, cumulative sums and products, `layer_norm` of zeros) | onnxruntime 1.31 CPU kernel | where the sign of zero is the point (`signbit`, `copysign`, `trunc`, `frac`, `atan2`, `log1p`, `expm1`, floor division) it is set by a factor after the last `Where`; elsewhere it is not fixed. Eager itself gives NaN for `fmod`/`remainder` by a subnormal divisor and `gelu(inf)`; ORT gives the exact values |
| `Bernoulli` returns 1 with probability 1-p (inverse of the ONNX spec) | onnxruntime 1.31 CPU kernel | `bernoulli` lowered as `RandomUniformLike < p` (lowerings/core.py) |
| `MatMul(Transpose(A), v)` with 1-D `v` is wrong after the extended optimizer's MatMul+Transpose fusion: every `mv` backward | onnxruntime 1.31 optimizer | `mv`/`dot` lowered with 2-D MatMuls (lowerings/core.py) |
| `avg_pool2d/3d` ignore `divisor_override` | torchlib | decomposed as a ones-kernel convolution when it is set (lower.py) |
| `scatter_reduce(reduce="mean", include_self=False)` averages wrongly | torchlib | decomposed as scatter-sum / scatter-count (lower.py) |
| `special.erfcx` off by up to 0.13 for negative inputs | torchlib | lowered anew: series below 2, continued fraction above, reflection for x < 0 (lowerings/special.py) |
| `signbit(-0.0)` is False (`x < 0`), so `copysign` loses the sign of -0.0 | torchlib | `signbit`/`copysign` lowered on the sign of `1/x` for zeros (lowerings/fixes.py); a NaN's sign bit cannot be read without a bit cast (not in opset 18): `-nan` counts as positive |
| a negative reduction axis is ignored when the input is empty: `ReduceSum(axes=[-1])` of a (3, 0) tensor returns (3, 0) | onnxruntime 1.31 | reduction axes made non-negative at export and on constant `axes` (export.py, rewrite.py) |
| mean/var/std over an empty dim give 0 (torch: NaN), `any` gives True (torch: False) | onnxruntime 1.31 | results with a static zero-size dim are computed at export as torch defines them (export.py) |
| complex results come back as (..., 2) real pairs | torchlib's complex representation | partitions producing complex tensors are refused at export and run in PyTorch (export.py) |
| mixed-dtype elementwise ops (`mul(float, int64)`, ...) fail in ORT | torchlib omits torch's implicit promotion | torch.onnx's type-promotion pass on every partition (export.py) |
| bf16 LayerNorm/GroupNorm with fp32 weights (autocast); a float16 model's LayerNorm (statistics in a type ORT refused) and a bfloat16 model's GroupNorm (no kernel) ran in PyTorch | torchlib needs one dtype | a half input's norm computed in fp32, weights cast too, results cast back, as PyTorch's kernels do (export.py; tests/test_autocast.py) |
| max/min/argmax over bool | ONNX ArgMax/ReduceMax reject bool | computed in int32 (export.py) |
| reductions / scatter / gather of 0-d tensors | ONNX reduce/scatter ops reject rank 0 | identity decompositions for rank 0 (lower.py) |

The rows on NaN, infinities, zeros and accuracy near zero were found by `tools/special_values_sweep.py`
(every op on NaN, +-inf, +-0.0, subnormal, huge and tiny inputs, every pair for binary ops). Its tolerance is relative (rtol 1e-4,
no absolute floor), so tails such as sigmoid's count. On the current code it reports 16 ops that
differ from eager: 11 in the sign of a zero result only, 3 where eager itself gives NaN (`fmod`/`remainder`
by a subnormal, `gelu(inf)`), and 2 where eager's rounding is the larger error (`lgamma(1)` is
-1.1e-16 on ORT, 0 in eager; `logaddexp2(-1, -1)` is -1.06e-8 in eager, exactly 0 on ORT). With float64
inputs, 12: the same signs of zero and `logaddexp2`, and `sinc(1)`, -0.0 on ORT and 3.9e-17 in eager.

Failures to compile the sweep found (2026-11-27): since 2026-11-25 `take` and `bucketize` of 0-d
tensors raised (the decomposition table had taken torch's Python ref of `aten.item`, which calls
`prims.item` on a fake tensor, where `core_aten_decompositions()` runs the op's composite
kernel; `lower._composite_kernels`). Before that they ran in PyTorch through a graph break
Dynamo reported only as "Backend compiler exception": torch's decompositions index with the 0-d
tensor as Python does, which reads it on the host. They index with 1-d tensors now and run on
ORT. So does `index_put` by a boolean mask with one value for every masked place, now a `where`
(`lower.masked_setitem`, `masked_index_put`), whose values' gradient had gathered the masked
places. Where AOTAutograd still cannot trace a graph (`narrow` and `tensor_split` at tensor
positions, an `index_fill` sample), the report now names the op and the reason, and those
samples count as fallbacks ([fallback.md](fallback.md)).

Backward and missing ops added as decompositions (decompositions.py): `avg_pool{2,3}d_backward`,
`_adaptive_avg_pool{2,3}d_backward`, `_adaptive_avg_pool3d`, `diagonal_scatter` and
`as_strided_scatter` (torch's own are not functional), `cumprod`, `prod`, `cummax`, `cummin`,
`median`, `kthvalue`; and as ONNX lowerings (`ort_dynamo/lowerings/`): `sort.stable` (ONNX TopK
breaks ties by index), the gamma family (`lgamma`, `digamma`, `polygamma`, `zeta`, `mvlgamma`
through them), `erfinv`, `ndtri`, `erfcx`, `log_ndtr`, `frexp` (special.py); Bessel, Airy and the
orthogonal polynomials (bessel.py, the recurrences as ONNX `Loop`); LU, Cholesky, QR, triangular
solves, `inv`, `det`, `slogdet`, `solve`, `householder_product`, `matrix_exp` (linalg.py: LAPACK's
algorithms unrolled per column, so `info` and pivots are eager's, up to 32x32); `squeeze` of
non-1 dims, `convolution` with `output_padding >= stride`, negative replicate padding (fixes.py).

Ops that are correct but were slow, written anew: slicing's backward (a Pad, not Transpose +
ScatterND + Transpose), `slice_scatter` (a Concat), `select`'s backward (a Pad, not
ScatterElements with an int64 index per element: nanoGPT-style `q, k, v = qkv` and classification
poolers' `hidden[:, 0]`) and `select_scatter` (a Concat). Where the CPU pointwise kernels apply,
`select`'s backward and that of a strided slice taking one element of every run (`x[..., ::2]`,
`x[..., 1::2]`: GPT-J's and torchtune's interleaved rotary embeddings) are a Where the kernels fuse
instead: ORT's Pad along an axis of two is slow. Reflection and replication padding's backward
(slices, flips and sums of the borders, not GatherND or ScatterElements) and `Tensor.unfold`
(the input cut into rows of `step`, read as Slices and a Concat, not a Gather with an index per
element; its backward Pads and adds, not ScatterElements): up to 42x eager's time before
(`benchmarks/layer_ops.py`). Adaptive average pooling whose windows tile the input is a mean and
one Expand, not products against an averaging matrix. Nearest upsampling by whole numbers is ONNX
Resize, its backward a reshaped sum; linear upsampling is Resize where ORT computes what torch does,
and its backward, along a dim of up to 256 inputs (64 for whole-number scales), one MatMul with the
(out, in) weights; by whole numbers beyond that, sums and shifts (torch's tracing would write all of
them as index gathers and scatters; `lower.whole_upsampling`). Max pooling's indices are numbered
per plane from the shape, not with a second MaxPool over the whole input, and a NaN in a window
pools to NaN at the window's last NaN, as in torch (ORT's MaxPool skips NaN); on CPU the pointwise
stage runs it as one kernel. Adaptive max pooling whose windows tile the input is that pooling.
Group norm is a LayerNormalization over the groups (CPU float32), pixel shuffle and unshuffle a
Reshape, a Transpose and a Reshape of static shapes, and a patch convolution's weight gradient
(stride = kernel) one MatMul. F.unfold's patches are strided slices, stacked. ORT has no complex
tensors: a complex STFT stays in PyTorch (reported), except where its every use is `.abs()` (a
magnitude or power spectrogram), which is frames times the DFT's bases in real arithmetic
(`lower.stft_magnitude`). `tools/idiom_scan.py` lists, for common indexing and splitting
idioms, the index-driven ONNX ops their graphs still use: only the strided slices without the
kernels, and the idioms whose indices are data.

Approximations accurate to float32 only (the gamma family, Chebyshev polynomials) declare so
(`ACCURATE_DTYPES`): their float64 inputs stay in PyTorch, with that reason in the report.

## Ops the OpInfos do not sample (tests/test_op_gaps.py)

* Fake quantization for quantization-aware training (`torch.fake_quantize_per_tensor_affine`
  with number or tensor scale and zero point, `torch.fake_quantize_per_channel_affine` with
  integer or float zero points, and the `fake_quant_enabled` switch that `FakeQuantize` modules
  pass) runs on ORT and gives eager's values and gradients bit for bit, in float32, float16 and
  bfloat16: `x * (1 / scale)` rounded half to even, as ATen computes it (torchlib's lowering
  divides by the scale through `QuantizeLinear`, which rounds some values the other way).
  `torch.ao.quantization`'s eager-mode modules themselves are skipped by Dynamo (graph breaks:
  the whole module runs in PyTorch, as with Inductor); torchao's QAT writes the same arithmetic
  in plain ops. The learnable variant (`_fake_quantize_learnable_per_*_affine`, LSQ) is a
  reported fallback.
* `nn.Embedding(scale_grad_by_freq=True)`: its gradient divides each row by the count of its id
  in the batch, on ORT (`EmbeddingBag`'s stays in PyTorch: eager's CPU kernel divides by another
  id's count there).

## What stays in PyTorch by design

* Random draws on CPU (dropout's masks, `rand`, `bernoulli`, `multinomial`, ...; option
  `torch_random`): PyTorch's generator draws them, so a seed reproduces them and they are eager's;
  the arithmetic around them runs on ORT. The report lists them as kept in PyTorch by design.
* Complex tensors (all `fft.*`, `view_as_complex`, `polar`, ...): ORT has no complex type.
* SVD, eigendecompositions, `lstsq`, and factorizations of matrices larger than 32x32 or of
  dynamic size (the unrolled lowering refuses them at export, with that reason).
* `igamma`/`igammac` (eager switches among four iterative methods; not matched to 1e-4 yet), `nextafter`.
* Data-dependent output shapes (`nonzero`, `unique`, `masked_select`) and Python-scalar results
  (`item`, `allclose`, `equal`, and torch functions that test values, e.g. `cov`,
  `gaussian_nll_loss`) graph-break in Dynamo.
* `nn.LSTM`, `nn.GRU` and `nn.RNN`, unless you set Dynamo's own switch,
  `torch._dynamo.config.allow_rnn = True`: without it Dynamo gives up on the frame that calls
  them, so that whole frame runs in PyTorch, and the report's graph breaks say so with that
  hint. With it they are unrolled over the sequence into their cells' products and
  elementwise ops and train on ORT with eager's gradients (tests/test_recurrent.py): one
  graph per sequence length, and its size and compile time grow with the length (not
  measured by a project script yet). `nn.LSTMCell`/`nn.GRUCell` need no switch. Speed against eager's fused oneDNN
  kernels (`benchmarks/layer_ops.py lstm_16 lstm_64 gru_64`, hidden 256, batch 16, forward and
  backward, 2-core AMD EPYC Zen 4): LSTM over 16 steps ort/eager 0.99, over 64 steps 1.04; GRU
  over 64 steps 0.56.
  The switch is global and other backends see it too: PyTorch's own decomposition writes an
  LSTM whose input needs no gradient as oneDNN's inference-only op, so training such a model
  fails under `aot_eager` and Inductor; ort_dynamo turns oneDNN off while it traces a graph with
  an RNN, which avoids that.

Known and not fixed: ORT 1.31's CPU `Where` returns +0.0 where its true branch holds -0.0 (the
false branch keeps it), so `torch.where`/`masked_fill` selecting a negative zero can lose its
sign; `copysign` avoids `Where` for this reason.

The one mismatch, `matrix_exp` sample 1, is float32 rounding on an ill-conditioned element:
against a float64 reference, eager is off by 2.4e-3 relative there and ORT by 1.1e-3 (same
algorithm as eager's, different rounding).

Random OpInfos call their op through `wrapper_set_seed`, which re-seeds torch's generator around
the call: a graph break in the test harness, not in the op. The sweep calls the op itself.
"""

RTOL, ATOL = 1e-4, 1e-5
#: Gradients get a looser absolute floor: they sum many products, and some samples are
#: ill-conditioned (LayerNorm over one element scales rounding by 1/sqrt(eps) = 316).
GRAD_ATOL = 1e-4


def op_key(op) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


# ---- worker: runs ops in this process -------------------------------------------------------------


def _float32_ops():
    import torch
    from torch.testing._internal.common_methods_invocations import op_db

    return {op_key(op): op for op in op_db if torch.float32 in op.supported_dtypes("cpu")}


def _close(expected, actual, what: str, atol: float = ATOL) -> str:
    """'' if ``actual`` matches ``expected`` (tree of tensors/values), else the difference."""
    import torch
    from torch.utils._pytree import tree_flatten

    exp_leaves, exp_spec = tree_flatten(expected)
    act_leaves, act_spec = tree_flatten(actual)
    if len(exp_leaves) != len(act_leaves):
        return f"{what}: {len(act_leaves)} values, eager has {len(exp_leaves)}"
    for i, (e, a) in enumerate(zip(exp_leaves, act_leaves)):
        if isinstance(e, torch.Tensor) != isinstance(a, torch.Tensor):
            return f"{what}[{i}]: {type(a).__name__}, eager {type(e).__name__}"
        if not isinstance(e, torch.Tensor):
            if e != a and not (isinstance(e, float) and e != e and a != a):
                return f"{what}[{i}]: {a!r} != eager {e!r}"
            continue
        if e.dtype != a.dtype or e.shape != a.shape:
            return f"{what}[{i}]: {a.dtype}{list(a.shape)} vs eager {e.dtype}{list(e.shape)}"
        try:
            torch.testing.assert_close(a.detach(), e.detach(), rtol=RTOL, atol=atol, equal_nan=True,
                                       check_stride=False)
        except AssertionError as exc:
            lines = [ln.strip() for ln in str(exc).splitlines() if "Greatest" in ln or "Mismatched" in ln]
            return f"{what}[{i}]: " + ("; ".join(lines) or str(exc).splitlines()[0])[:200]
    return ""


def _shape_check(expected, actual, what: str) -> str:
    import torch
    from torch.utils._pytree import tree_flatten

    exp, act = tree_flatten(expected)[0], tree_flatten(actual)[0]
    if len(exp) != len(act):
        return f"{what}: {len(act)} values, eager has {len(exp)}"
    for i, (e, a) in enumerate(zip(exp, act)):
        if isinstance(e, torch.Tensor) and (not isinstance(a, torch.Tensor) or e.shape != a.shape
                                            or e.dtype != a.dtype):
            return f"{what}[{i}]: shape/dtype differ from eager"
    return ""


def _grads(fn, tensors, weights_seed: int):
    """Forward outputs and d(sum(w * out))/d(inputs) for the float inputs that require grad."""
    import torch
    from torch.utils._pytree import tree_flatten

    out = fn(*tensors)
    leaves = [t for t in tree_flatten(out)[0]
              if isinstance(t, torch.Tensor) and t.requires_grad and t.dtype.is_floating_point]
    wrt = [t for t in tensors if t.requires_grad]
    if not leaves or not wrt:
        return out, None
    gen = torch.Generator().manual_seed(weights_seed)
    loss = sum((leaf * torch.rand(leaf.shape, generator=gen, dtype=leaf.dtype)).sum() for leaf in leaves)
    grads = torch.autograd.grad(loss, wrt, allow_unused=True)
    return out, [g if g is not None else torch.zeros_like(w) for g, w in zip(grads, wrt)]


def run_one_op(op, samples: int) -> dict:
    """Compare eager and ``backend="ort"`` on ``op``'s first ``samples`` sample inputs."""
    import torch
    import torch._dynamo
    from torch._dynamo.utils import counters
    from torch.utils._pytree import tree_flatten, tree_unflatten

    import ort_dynamo

    key = op_key(op)
    random_op = key in RANDOM_OPS or op.name in RANDOM_OPS
    result = {"op": key, "status": "pass", "samples": 0, "detail": "", "fallbacks": [],
              "fallback_nodes": 0, "ort_nodes": 0, "graph_breaks": 0, "random": random_op,
              "grad_checked": False}
    autograd = bool(op.supports_autograd)
    try:
        sample_iter = iter(op.sample_inputs("cpu", torch.float32, requires_grad=autograd))
    except Exception as exc:
        result.update(status="skipped", detail=f"sample_inputs failed: {type(exc).__name__}: {exc}"[:300])
        return result
    fallbacks: dict[str, str] = {}
    problems: list[tuple[str, str]] = []
    for index in range(samples):
        try:
            sample = next(sample_iter)
        except StopIteration:
            break
        except Exception as exc:
            problems.append(("skipped", f"sample {index}: {type(exc).__name__}: {exc}"[:300]))
            break
        leaves, spec = tree_flatten((sample.input, sample.args, sample.kwargs))
        positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]

        def fn(*tensors, _leaves=leaves, _spec=spec, _positions=positions):
            filled = list(_leaves)
            for pos, t in zip(_positions, tensors):
                filled[pos] = t
            inp, args, kwargs = tree_unflatten(filled, _spec)
            return op.op(inp, *args, **kwargs)

        def fresh():
            return [leaves[p].detach().clone().requires_grad_(leaves[p].requires_grad) for p in positions]

        torch.manual_seed(0)
        try:
            expected, expected_grads = _grads(fn, fresh(), index)
        except Exception:
            continue  # eager rejects this sample: nothing to compare
        result["samples"] += 1
        ort_dynamo.reset()
        counters.clear()
        compiled = torch.compile(fn, backend="ort", dynamic=False)
        torch.manual_seed(0)
        try:
            actual, actual_grads = _grads(compiled, fresh(), index)
        except Exception as exc:
            problems.append(("error", f"sample {index}: {type(exc).__name__}: {' '.join(str(exc).split())}"[:400]))
            continue
        finally:
            rep = ort_dynamo.report()
            result["ort_nodes"] += rep.ort_nodes
            result["fallback_nodes"] += rep.fallback_nodes
            result["graph_breaks"] += sum(counters["graph_break"].values())
            for fb in rep.fallbacks:
                fallbacks.setdefault(fb.op, fb.reason[:200])
        # attention with dropout draws a mask: random for that sample only
        random_sample = random_op or (sample.kwargs.get("dropout_p") or 0) > 0
        check = _shape_check if random_sample else _close
        diff = check(expected, actual, "output")
        if random_sample and not diff:  # the draws are PyTorch's on CPU (option torch_random): eager's values?
            same = not _close(expected, actual, "output")
            result["random_values_match"] = result.get("random_values_match", True) and same
        if not diff and expected_grads is not None:
            result["grad_checked"] = True
            diff = (_shape_check(expected_grads, actual_grads, "grad") if random_sample
                    else _close(expected_grads, actual_grads, "grad", GRAD_ATOL))
        if diff:
            problems.append(("mismatch", f"sample {index}: {diff}"))
    result["fallbacks"] = [{"op": k, "reason": v} for k, v in sorted(fallbacks.items())]
    for status in ("error", "mismatch", "skipped"):
        found = [d for s, d in problems if s == status]
        if found:
            result["status"], result["detail"] = status, found[0]
            break
    if result["samples"] == 0 and result["status"] == "pass":
        result.update(status="skipped", detail="no sample input that eager accepts")
    return result


def _unwrap_seed_wrapper() -> None:
    """Random OpInfos call their op through ``wrapper_set_seed``, which saves and re-seeds
    torch's generator around the call: a Dynamo graph break in the test harness, not in the
    op. ORT draws its own numbers and random ops are compared on shapes only, so the sweep
    calls the op itself. (The lambdas look the wrapper up as a module global at call time.)"""
    from torch.testing._internal import common_methods_invocations as cmi

    cmi.wrapper_set_seed = lambda op, *args, **kwargs: op(*args, **kwargs)


def worker_main(names: list[str], samples: int) -> None:
    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("ORT_DYNAMO_INTRA_OP_NUM_THREADS", "1")
    import warnings

    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)
    _unwrap_seed_wrapper()
    ops = _float32_ops()
    for name in names:
        print("START " + name, flush=True)
        start = time.perf_counter()
        try:
            rec = run_one_op(ops[name], samples)
        except Exception as exc:  # a bug in the harness, not in the backend
            rec = {"op": name, "status": "error", "detail": f"harness: {type(exc).__name__}: {exc}"[:300],
                   "fallbacks": [], "fallback_nodes": 0, "ort_nodes": 0, "graph_breaks": 0,
                   "samples": 0, "random": False, "grad_checked": False}
        rec["seconds"] = round(time.perf_counter() - start, 2)
        print("RESULT " + json.dumps(rec), flush=True)


# ---- supervisor: workers, timeouts, incremental JSON -----------------------------------------------


class Results:
    def __init__(self, path: str, meta: dict, keep: dict) -> None:
        self.path, self.meta, self.ops = path, meta, dict(keep)
        self.lock = threading.Lock()

    def add(self, rec: dict) -> None:
        with self.lock:
            self.ops[rec["op"]] = rec
            self._write()

    def _write(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump({"meta": self.meta, "ops": dict(sorted(self.ops.items()))}, fh, indent=1)
        os.replace(tmp, self.path)


def _run_slot(names: list[str], args, results: Results, log) -> None:
    pending = list(names)
    while pending:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--ops", ",".join(pending),
               "--samples", str(args.samples)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
        lines: queue.Queue = queue.Queue()

        def pump(stream=proc.stdout):
            for line in stream:
                lines.put(line.rstrip("\n"))
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        current, started = None, time.monotonic()
        while True:
            wait = (started + (args.timeout if current else 300)) - time.monotonic()
            try:
                line = lines.get(timeout=max(wait, 0.1))
            except queue.Empty:
                proc.kill()
                proc.wait()
                victim = current or pending[0]
                results.add({"op": victim, "status": "timeout", "detail": f"over {args.timeout}s",
                             "fallbacks": [], "fallback_nodes": 0, "ort_nodes": 0, "graph_breaks": 0,
                             "samples": 0, "random": False, "grad_checked": False,
                             "seconds": args.timeout})
                log(f"TIMEOUT {victim}")
                pending.remove(victim)
                break
            if line is None:
                proc.wait()
                if current:
                    results.add({"op": current, "status": "error",
                                 "detail": f"worker died (exit {proc.returncode})", "fallbacks": [],
                                 "fallback_nodes": 0, "ort_nodes": 0, "graph_breaks": 0, "samples": 0,
                                 "random": False, "grad_checked": False, "seconds": 0})
                    log(f"CRASH {current}")
                    pending.remove(current)
                elif pending:
                    log(f"worker exited (rc {proc.returncode}) before {pending[0]}")
                    return
                break
            if line.startswith("START "):
                current, started = line[6:], time.monotonic()
            elif line.startswith("RESULT "):
                rec = json.loads(line[7:])
                results.add(rec)
                log(f"{rec['status']:8s} {rec['op']} ({rec['seconds']}s, fallbacks={rec['fallback_nodes']})")
                if rec["op"] in pending:
                    pending.remove(rec["op"])
                current = None


def versions() -> dict:
    import onnxruntime
    import onnxscript
    import torch

    return {"torch": torch.__version__, "onnxruntime": onnxruntime.__version__,
            "onnxscript": onnxscript.__version__}


def supervise(args) -> None:
    names = sorted(_float32_ops())
    if args.ops:
        wanted = [n.strip() for n in args.ops.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in names]
        if unknown:
            sys.exit(f"unknown float32 OpInfo name(s): {unknown}")
        names = wanted
    keep = {}
    if args.resume and os.path.exists(args.out):
        with open(args.out) as fh:
            keep = json.load(fh)["ops"]
        redo = {"timeout", "error"} if args.retry_failed else set()
        # Ops named with --ops are re-run; otherwise only those not done yet (or failed).
        if not args.ops:
            names = [n for n in names if n not in keep or keep[n]["status"] in redo]
    if args.limit:
        names = names[: args.limit]
    command = "python tools/opinfo_sweep.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    meta = {"command": command.strip(), "date": datetime.date.today().isoformat(),
            "samples_per_op": args.samples, "timeout_s": args.timeout, "rtol": RTOL, "atol": ATOL, "grad_atol": GRAD_ATOL,
            **versions()}
    if args.resume and os.path.exists(args.out):
        with open(args.out) as fh:
            previous = json.load(fh)["meta"]
        # Keep the command of the full run; later partial re-runs are listed after it.
        meta["command"] = previous["command"]
        meta["reruns"] = previous.get("reruns", []) + [command.strip()]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    results = Results(args.out, meta, keep)
    print_lock = threading.Lock()

    def log(msg: str) -> None:
        with print_lock:
            print(f"[{len(results.ops)}] {msg}", flush=True)

    slots = [names[i:: args.jobs] for i in range(args.jobs)]
    threads = [threading.Thread(target=_run_slot, args=(s, args, results, log)) for s in slots if s]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if args.md:
        write_markdown(args.out, args.md)


# ---- docs/ops.md ------------------------------------------------------------------------------


#: Random ops whose values are undefined (uninitialized memory), not drawn.
UNDEFINED_VALUES = {"empty", "empty_like", "empty_permuted", "empty_strided", "new_empty", "new_empty_strided"}


def _random_values_line(tested: dict) -> str:
    compared = {k: r["random_values_match"] for k, r in tested.items()
                if "random_values_match" in r and k not in UNDEFINED_VALUES}
    if not compared:
        return "not recorded in this sweep's results."
    same = sorted(k for k, m in compared.items() if m)
    differ = sorted(k for k, m in compared.items() if not m)
    return (f"{len(same)} of {len(compared)} give eager's own values ({', '.join(same)})"
            + (f"; {', '.join(differ)} draw from the same generator in another way than eager's kernels "
               "(reproducible under a seed, other values)." if differ else "."))


def _pct(n: int, d: int) -> str:
    return f"{100.0 * n / d:.1f}%" if d else "n/a"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")[:220]


def write_markdown(json_path: str, md_path: str) -> None:
    with open(json_path) as fh:
        data = json.load(fh)
    meta, ops = data["meta"], data["ops"]
    tested = {k: r for k, r in ops.items() if r["status"] != "skipped"}
    n = len(tested)
    passed = [k for k, r in tested.items() if r["status"] == "pass"]
    no_fallback = [k for k, r in tested.items()
                   if r["status"] in ("pass", "mismatch") and r["fallback_nodes"] == 0]
    fully = sorted(k for k, r in tested.items() if r["status"] == "pass" and r["fallback_nodes"] == 0
                   and r["graph_breaks"] == 0)
    lines = [
        "# Operator coverage (OpInfo sweep)",
        "",
        "Generated by `tools/opinfo_sweep.py`: every OpInfo of "
        "`torch.testing._internal.common_methods_invocations.op_db` that supports float32 on CPU, "
        f"its first {meta['samples_per_op']} sample inputs, eager vs "
        "`torch.compile(fn, backend=\"ort\", dynamic=False)`: forward outputs and, for ops that "
        f"support autograd, input gradients (rtol={meta['rtol']}, atol={meta['atol']}; gradients "
        f"atol={meta.get('grad_atol', meta['atol'])}; NaNs equal).",
        "",
        f"* Command: `{meta['command']}`"
        + "".join(f"; then `{r}` (re-ran those ops after fixes)" for r in meta.get("reruns", [])),
        f"* Date: {meta['date']}; torch {meta['torch']}, onnxruntime {meta['onnxruntime']}, "
        f"onnxscript {meta['onnxscript']}; per-op time cap {meta['timeout_s']} s",
        "",
        "## Headline",
        "",
        f"* **{_pct(len(passed), n)}** of {n} float32 OpInfo ops match eager ({len(passed)} ops).",
        f"* **{_pct(len(no_fallback), n)}** run with no node falling back to PyTorch "
        f"({len(no_fallback)} ops; compiled and ran, `report().fallback_nodes == 0`).",
        f"* {len(fully)} ops match eager entirely on ORT with no Dynamo graph break.",
        f"* {len(ops) - n} ops skipped (no sample input eager accepts) are not counted.",
        "",
        "Random ops (" + ", ".join(sorted(k for k, r in tested.items() if r.get("random"))) + ") pass "
        "on shapes and dtypes: their values are random by design. On CPU they draw from PyTorch's generator "
        "(option `torch_random`), so the sweep, which seeds torch before eager's call and before ort's, also "
        "compares their values: " + _random_values_line(tested) + " ORT's own random ops, which CUDA and "
        "`torch_random=False` use, are tested for their statistics in tests/test_random_ops.py.",
        "",
    ]
    lines.extend(NOTES.splitlines())
    lines.append("")
    by_status = {}
    for k, r in sorted(tested.items()):
        by_status.setdefault(r["status"], []).append((k, r))

    def table(title: str, rows, columns, render) -> None:
        lines.extend([f"## {title} ({len(rows)})", ""])
        if not rows:
            lines.extend(["None.", ""])
            return
        lines.append("| " + " | ".join(columns) + " |")
        lines.append("|" + "---|" * len(columns))
        for row in rows:
            lines.append("| " + " | ".join(_cell(c) for c in render(row)) + " |")
        lines.append("")

    lines.extend([f"## Ops that run fully on ORT and match eager ({len(fully)})", "",
                  ", ".join(f"`{k}`" for k in fully) or "None.", ""])
    falls = [(k, r) for k, r in sorted(tested.items()) if r["fallback_nodes"] or r["graph_breaks"]]
    table("Ops with nodes in PyTorch", falls, ["op", "status", "fallback nodes", "graph breaks", "reason"],
          lambda kr: [kr[0], kr[1]["status"], kr[1]["fallback_nodes"], kr[1]["graph_breaks"],
                      "; ".join(f"{f['op']}: {f['reason']}" for f in kr[1]["fallbacks"][:2])
                      or ("Dynamo graph break" if kr[1]["graph_breaks"] else "")])
    table("Mismatches", by_status.get("mismatch", []), ["op", "detail"], lambda kr: [kr[0], kr[1]["detail"]])
    errors = by_status.get("error", []) + by_status.get("timeout", [])
    table("Errors and timeouts", errors, ["op", "status", "detail"],
          lambda kr: [kr[0], kr[1]["status"], kr[1]["detail"]])
    skipped = sorted(k for k, r in ops.items() if r["status"] == "skipped")
    lines.extend([f"## Skipped ({len(skipped)})", "", ", ".join(f"`{k}`" for k in skipped) or "None.", ""])
    with open(md_path, "w") as fh:
        fh.write("\n".join(lines))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", default="", help="comma-separated OpInfo names (name.variant)")
    parser.add_argument("--limit", type=int, default=0, help="at most N ops (after --ops/--resume)")
    parser.add_argument("--samples", type=int, default=3, help="sample inputs per op")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes")
    parser.add_argument("--timeout", type=float, default=120, help="seconds per op before it is killed")
    parser.add_argument("--out", default=DEFAULT_JSON, help="per-op results JSON")
    parser.add_argument("--md", default=None,
                        help="markdown report ('' = none; default: docs/ops.md for the default "
                             "--out, else next to --out)")
    parser.add_argument("--resume", action="store_true", help="skip ops already in --out")
    parser.add_argument("--retry-failed", action="store_true", help="with --resume: redo errors/timeouts")
    parser.add_argument("--report-only", action="store_true", help="only regenerate --md from --out")
    parser.add_argument("--list", action="store_true", help="print the float32 OpInfo names")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error("--jobs must be >= 1")
    if args.md is None:  # a partial sweep into another JSON must not overwrite docs/ops.md
        same = os.path.abspath(args.out) == os.path.abspath(DEFAULT_JSON)
        args.md = DEFAULT_MD if same else os.path.splitext(args.out)[0] + ".md"
    if args.worker:
        worker_main([n for n in args.ops.split(",") if n], args.samples)
    elif args.list:
        print("\n".join(sorted(_float32_ops())))
    elif args.report_only:
        write_markdown(args.out, args.md)
    else:
        supervise(args)


if __name__ == "__main__":
    main()
