"""The kernels compile for the machine they run on (``-march=native``), so the model tests see one
instruction set only. Here other targets are built on purpose: csrc/attention.h has a path per
instruction set (AVX-512, AVX2 with FMA: attention_avx2.h, generic vectors), each built on its own
(tests/csrc/attention_entry.c, called through ctypes) must give eager's attention, forward and
backward; and the generated kernels' loops with an exp must vectorize for an AVX2 target too."""

import ctypes
import os
import subprocess

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ort_dynamo import _kernels

CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ort_dynamo", "csrc")
ENTRY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "attention_entry.c")


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as fh:
            return {word for line in fh if line.startswith("flags") for word in line.split(":")[1].split()}
    except OSError:
        return set()


# (-march level, the path it must take, the CPU flags it needs)
TARGETS = {
    "avx512": ("x86-64-v4", 512, {"avx512f", "avx512bw", "avx512vl", "avx512dq"}),
    "avx2": ("x86-64-v3", 256, {"avx2", "fma"}),
    "generic": ("x86-64-v2", 0, {"sse4_2"}),
}


def _flags_for(march: str, flags=None) -> list[str]:
    """The kernels' compiler flags (``flags``, default ``_kernels._FLAGS``) for ``-march=march``
    instead of the machine's own."""
    return [f if f != "-march=native" else f"-march={march}" for f in (_kernels._FLAGS if flags is None else flags)]


@pytest.fixture(scope="module")
def attention_library(tmp_path_factory):
    """attention_library(target): tests/csrc/attention_entry.c built for that target, once per module."""
    built = {}

    def build(target: str) -> ctypes.CDLL:
        if target not in built:
            compiler = _kernels._compiler()
            if compiler is None:
                pytest.skip("no C compiler")
            march = TARGETS[target][0]
            out = tmp_path_factory.mktemp("attention") / f"attention_{march}.so"
            flags = _flags_for(march)
            subprocess.run([compiler[0], *flags, "-shared", "-I", CSRC, ENTRY, "-o", str(out), "-lm"], check=True,
                           capture_output=True, text=True)
            built[target] = ctypes.CDLL(str(out))
        return built[target]

    return build


def _pointer(a: np.ndarray):
    return a.ctypes.data_as(ctypes.c_void_p)


@pytest.mark.skipif(os.uname().machine not in ("x86_64", "AMD64"), reason="x86 instruction sets")
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("shape, causal", [((2, 3, 70, 70, 64), True), ((1, 2, 133, 37, 32), False),
                                           ((1, 1, 6, 200, 16), False)])
def test_each_instruction_set_path_gives_eagers_attention(attention_library, target, shape, causal):
    _, path, needs = TARGETS[target]
    missing = needs - _cpu_flags()
    if missing:
        pytest.skip(f"this CPU lacks {sorted(missing)}")
    lib = attention_library(target)
    assert lib.attention_path() == path  # the build took the path this case is about

    b, h, m, n, d = shape
    scale = d ** -0.5
    gen = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(b, h, rows, d, generator=gen) for rows in (m, n, n, m))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*leaves, is_causal=causal)
    want.backward(grad)

    qn, kn, vn, gn = (t.numpy().copy() for t in (q, k, v, grad))
    out, lse = np.zeros_like(qn), np.zeros((b, h, m), np.float32)
    i64, f32 = ctypes.c_int64, ctypes.c_float
    lib.attention_forward(i64(b), i64(h), i64(m), i64(n), i64(d), causal, f32(scale),
                          *map(_pointer, (qn, kn, vn, out, lse)))
    torch.testing.assert_close(torch.from_numpy(out), want.detach(), rtol=1e-5, atol=1e-5)
    scores = (q @ k.transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(m, n, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(torch.from_numpy(lse), torch.logsumexp(scores, -1), rtol=1e-5, atol=1e-5)

    gq, gk, gv = np.zeros_like(qn), np.zeros_like(kn), np.zeros_like(vn)
    lib.attention_backward(i64(b), i64(h), i64(m), i64(n), i64(d), causal, f32(scale),
                           *map(_pointer, (qn, kn, vn, gn, out, lse, gq, gk, gv)))
    for got, leaf in zip((gq, gk, gv), leaves):
        torch.testing.assert_close(torch.from_numpy(got), leaf.grad, rtol=1e-4, atol=2e-5)


@pytest.mark.skipif(os.uname().machine not in ("x86_64", "AMD64"), reason="x86 instruction sets")
def test_a_kernel_loop_with_an_exp_vectorizes_for_avx2(tmp_path):
    """pw_expf's clamps are selects GCC if-converts for AVX2 only under -fno-trapping-math (in
    _kernels._FLAGS); without it such loops (softmax, SiLU, GELU's backward) stayed scalar."""
    compiler = _kernels._compiler()
    if compiler is None or "clang" in compiler[1].lower():
        pytest.skip("needs GCC (its -fopt-info reports)")
    source = tmp_path / "exp_loop.c"
    source.write_text('#include "pointwise.h"\n'
                      "void f(const float* restrict x, float* restrict y, long n) {\n"
                      "#pragma omp simd\n"
                      "  for (long i = 0; i < n; ++i) y[i] = pw_expf(x[i]) * 0.5f;\n}\n")
    flags = [f for f in _flags_for("x86-64-v3") if f != "-w"]
    result = subprocess.run([compiler[0], *flags, "-fopt-info-vec-optimized", "-c", "-I", CSRC, str(source),
                             "-o", str(tmp_path / "exp_loop.o")], capture_output=True, text=True, check=True)
    assert "exp_loop.c:4" in result.stderr and "loop vectorized" in result.stderr, result.stderr


@pytest.mark.skipif(os.uname().machine not in ("x86_64", "AMD64"), reason="x86 instruction sets")
def test_avx512_without_bfloat16_builds_the_float32_products_and_convolutions(monkeypatch, tmp_path):
    """Skylake and Ice Lake Xeons have AVX-512 but not AVX512-BF16: there the float32 products
    and convolutions of csrc/bf16_gemm.h must still build (CPU autocast's bfloat16 products
    do not). Built here for -march=x86-64-v4 (AVX-512 F/BW/VL/DQ, no BF16), as on such a CPU."""
    import glob

    import onnx

    import ort_dynamo

    missing = TARGETS["avx512"][2] - _cpu_flags()
    if missing or _kernels._compiler() is None:
        pytest.skip(f"this CPU lacks {sorted(missing)}" if missing else "no C compiler")
    compiler, version, flags, libs = _kernels._toolchain()
    v4 = tuple(_flags_for("x86-64-v4", flags))
    cached = (_kernels.float32_products, _kernels.bfloat16_products)
    monkeypatch.setattr(_kernels, "_toolchain", lambda: (compiler, version, v4, libs))
    for question in cached:
        question.cache_clear()
    try:
        assert _kernels.float32_products() and not _kernels.bfloat16_products()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Conv2d(16, 24, 3, padding=1), torch.nn.Flatten(1),
                                    torch.nn.Linear(24 * 8 * 8, 128), torch.nn.Tanh(), torch.nn.Linear(128, 10))
        x = torch.randn(4, 16, 8, 8)
        want = model(x)
        want.square().sum().backward()
        expected = [p.grad.clone() for p in model.parameters()]
        ort_dynamo.reset()
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="ort", options={
            "save_onnx": True, "save_path": str(tmp_path), "cache_dir": str(tmp_path / "cache"),
            "cpu_matmul": "ort"})
        for _ in range(2):
            model.zero_grad()
            got = compiled(x)
            got.square().sum().backward()
            ort_dynamo.wait_for_kernels()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for p, g in zip(model.parameters(), expected):
            torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-4 * g.abs().max().item())
        assert ort_dynamo.report().fallback_nodes == 0, str(ort_dynamo.report())
        ops = {n.op_type.split("_")[0] for path in glob.glob(str(tmp_path / "*.onnx"))
               for n in onnx.load(path).graph.node}
        assert {"TorchConv", "F32MatMulNN"} <= ops, ops  # the backward's 4-row products: the few-rows path
    finally:
        for question in cached:
            question.cache_clear()


@pytest.mark.parametrize("target", ["native", "scalar", *TARGETS])
def test_pw_expf_is_within_one_ulp_flushes_below_flt_min_and_keeps_inf_and_nan(target, tmp_path):
    """The kernels' exp (csrc/pointwise.h) on a sample of every float32 bit pattern, vectorized for
    each instruction set this CPU runs and as scalar code: within 1 ulp of the true value where
    that is a normal float, 0 below FLT_MIN (-inf too), inf above FLT_MAX (+inf too), NaN for NaN.
    Its only select is the flush; NaN and overflow come out of the arithmetic itself."""
    compiler = _kernels._compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    flags = [f for f in _kernels._FLAGS if f != "-w"]
    if target == "scalar":
        flags += ["-fno-tree-vectorize"]
    elif target != "native":
        march, _, needs = TARGETS[target]
        if needs - _cpu_flags():
            pytest.skip(f"this CPU lacks {sorted(needs - _cpu_flags())}")
        flags = _flags_for(march, flags)
    source = tmp_path / "exp_entry.c"
    source.write_text('#include "pointwise.h"\n'
                      "__attribute__((visibility(\"default\")))\n"
                      "void exp_all(const float* restrict x, float* restrict y, long n) {\n"
                      "  for (long i = 0; i < n; ++i) y[i] = pw_expf(x[i]);\n}\n")
    library = tmp_path / "exp_entry.so"
    subprocess.run([compiler[0], *flags, "-shared", "-I", CSRC, str(source), "-o", str(library), "-lm"],
                   check=True, capture_output=True)
    x = np.arange(0, 1 << 32, 1021, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.concatenate([x, np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 88.72283, 88.72284, -87.33654,
                                     -87.33655, 89.0, 89.5, -104.0], np.float32)])
    y = np.empty_like(x)
    fn = ctypes.CDLL(str(library)).exp_all
    fn(_pointer(x), _pointer(y), ctypes.c_long(x.size))
    with np.errstate(over="ignore", invalid="ignore"):
        want = np.exp(x.astype(np.float64))
    nan = np.isnan(x)
    assert np.isnan(y[nan]).all()
    tiny, huge = want < np.finfo(np.float32).tiny, want > np.finfo(np.float32).max
    assert (y[tiny & ~nan] == 0).all(), x[tiny & ~nan & (y != 0)][:5]
    assert np.isposinf(y[huge]).all(), x[huge & ~np.isposinf(y)][:5]
    normal = ~(nan | tiny | huge)
    ulps = np.abs(y[normal] - want[normal]) / np.spacing(want[normal].astype(np.float32)).astype(np.float64)
    assert ulps.max() <= 1.0, (ulps.max(), x[normal][ulps.argmax()])
