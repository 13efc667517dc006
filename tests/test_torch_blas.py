"""Option cpu_matmul: on CPU, float32 matrix products run on the BLAS eager's own products run on
(torch's `sgemm_`, MKL in its x86 builds) inside the ORT session, with their transposes folded
in; "auto" picks it on Intel CPUs, "ort" keeps ORT's products."""

import glob

import onnx
import pytest
import torch

import ort_dynamo
from ort_dynamo import _kernels, _openmp, _torch_blas
from ort_dynamo.errors import OptionsError

pytestmark = pytest.mark.skipif(bool(_torch_blas.problem()), reason="needs a C compiler and torch's sgemm_")


def _products(save_path) -> list[tuple[str, str]]:
    """(domain, op) of every product in the models the compile saved."""
    return [(node.domain, node.op_type) for path in sorted(glob.glob(f"{save_path}/*.onnx"))
            for node in onnx.load(path).graph.node if node.op_type in ("MatMul", "Gemm", "FusedMatMul", "Bf16MatMul")]


def _train_step(fn, inputs, tmp_path=None, matmul="torch_blas", **options):
    """Output and every input's gradient, eager without ``tmp_path``, else compiled with
    ``cpu_matmul=matmul`` and ``options``, its models saved under ``tmp_path``."""
    args = [t.clone().requires_grad_() for t in inputs]
    if tmp_path is not None:
        ort_dynamo.reset()
        torch._dynamo.reset()
        fn = torch.compile(fn, backend="ort", options={"cpu_matmul": matmul, "fallback_policy": "DISABLE",
                                                       "save_onnx": True, "save_path": str(tmp_path), **options})
    out = fn(*args)
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return [out.detach(), *(a.grad for a in args)]


def _assert_like_eager(got, want):
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


CASES = {
    # a Linear: addmm forward (bias), weight gradient from x^T, input gradient by w
    "linear": (lambda x, w, b: torch.nn.functional.linear(x, w, b), [(8, 12, 32), (24, 32), (24,)]),
    "linear without bias": (lambda x, w: x @ w.t(), [(5, 7, 16), (9, 16)]),
    "transposed first operand": (lambda a, b: a.t() @ b, [(33, 20), (33, 18)]),
    "both transposed": (lambda a, b: a.t() @ b.t(), [(17, 6), (11, 17)]),
    "transposed result": (lambda a, b: (a @ b).t() * 2, [(6, 40), (40, 30)]),
    # too few rows to cut: pieces of columns (an RNN's step), b held transposed or not, uneven
    "short and wide, cut into columns": (lambda h, w, b: torch.nn.functional.linear(h, w, b),
                                         [(16, 64), (512, 64), (512,)]),
    "short and wide, transposed first operand": (lambda a, b: a.t() @ b, [(40, 16), (40, 301)]),
    # more columns than rows (an MLP's weight gradient): pieces of columns too
    "wider than tall": (lambda a, b: a @ b, [(130, 24), (24, 300)]),
    "wider than tall, transposed first operand": (lambda a, b: a.t() @ b, [(24, 130), (24, 300)]),
}


@pytest.mark.parametrize("case", CASES)
def test_products_run_on_torchs_blas_with_eagers_values(case, tmp_path):
    fn, shapes = CASES[case]
    torch.manual_seed(0)
    inputs = [torch.randn(s) for s in shapes]
    got = _train_step(fn, inputs, tmp_path)
    _assert_like_eager(got, _train_step(fn, inputs))
    products = _products(tmp_path)
    assert products and all(p == (_torch_blas.DOMAIN, "MatMul") for p in products), products


def test_a_transformer_trains_like_eager_with_every_product_on_torchs_blas(tmp_path):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    x = torch.randn(2, 10, 64)
    compiled = torch.compile(layer, backend="ort", options={"cpu_matmul": "torch_blas", "save_onnx": True,
                                                             "save_path": str(tmp_path)})
    eager = [layer(x)]
    eager[0].sum().backward()
    eager += [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    got = [compiled(x)]
    got[0].sum().backward()
    got += [p.grad for p in layer.parameters()]
    for a, b in zip(got, eager, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-4, atol=1e-5)
    products = _products(tmp_path)
    assert products.count((_torch_blas.DOMAIN, "MatMul")) >= 8 and ("", "Gemm") not in products


#: Products of two batches of the same shape: attention written out (XLNet's einsums, a
#: hand-written softmax(q k^T) v), in forward and in each gradient.
BATCHED = {
    "scores, k transposed": (lambda q, k: q @ k.transpose(-1, -2), [(2, 3, 10, 8), (2, 3, 12, 8)]),
    "weighted values": (lambda p, v: p @ v, [(2, 3, 10, 12), (2, 3, 12, 8)]),
    "first operand transposed": (lambda a, b: a.transpose(-1, -2) @ b, [(4, 9, 5), (4, 9, 7)]),
    "einsum": (lambda q, k: torch.einsum("bind,bjnd->bnij", q, k), [(2, 6, 3, 8), (2, 7, 3, 8)]),
}


@pytest.mark.parametrize("pool", ["torch", "ort"])
@pytest.mark.parametrize("case", BATCHED)
def test_batched_products_run_on_torchs_blas_on_either_threads(case, pool, tmp_path):
    """On PyTorch's threads a batch is one MKL batch call (sgemm_batch_, as eager's bmm); on
    ORT's it is cut into single-threaded products. Either way every product is torch's BLAS."""
    if pool == "torch" and _openmp.problem():
        pytest.skip(f"needs torch's GNU OpenMP: {_openmp.problem()}")
    fn, shapes = BATCHED[case]
    torch.manual_seed(0)
    inputs = [torch.randn(s) for s in shapes]
    got = _train_step(fn, inputs, tmp_path, cpu_thread_pool=pool)
    _assert_like_eager(got, _train_step(fn, inputs))
    nodes = [node for path in glob.glob(f"{tmp_path}/*.onnx") for node in onnx.load(path).graph.node
             if node.op_type in ("MatMul", "Gemm", "FusedMatMul", "Einsum")]
    assert nodes and all(node.domain == _torch_blas.DOMAIN for node in nodes), [n.op_type for n in nodes]
    on_pool = [onnx.helper.get_node_attr_value(n, "torch_threads") if any(a.name == "torch_threads" for a in n.attribute)
               else 0 for n in nodes]
    assert on_pool == [int(pool == "torch")] * len(nodes)


def test_batches_that_broadcast_multiply_right(tmp_path):
    """One operand's batch broadcast against the other's (a [1, n, k, k] bias shared by a batch):
    the product sees both batches at full size, and gives eager's values."""
    torch.manual_seed(0)
    inputs = [torch.randn(2, 3, 6, 5), torch.randn(1, 3, 5, 4)]
    fn = lambda a, b: a @ b  # noqa: E731
    _assert_like_eager(_train_step(fn, inputs, tmp_path), _train_step(fn, inputs))
    assert _products(tmp_path)


@pytest.mark.skipif(not _torch_blas.bfloat16_products(), reason="this torch's BLAS has no bfloat16 product")
def test_autocast_products_read_bfloat16_on_torchs_blas(tmp_path):
    """CPU autocast's products: MKL's bfloat16 product (AMX where the CPU has it) reads the
    operands as bfloat16, transposes folded in, and gives what ort_dynamo's own products give."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 32))
    x = torch.randn(4, 10, 64)

    def step(matmul, save_path):
        ort_dynamo.reset()
        torch._dynamo.reset()
        model.zero_grad()
        compiled = torch.compile(model, backend="ort", options={"cpu_matmul": matmul, "save_onnx": True,
                                                                "save_path": str(save_path)})
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = compiled(x)
        out.float().square().sum().backward()
        return [out.float(), *(p.grad.clone() for p in model.parameters())]

    got, theirs = step("torch_blas", tmp_path / "blas"), step("ort", tmp_path / "ort")
    for a, b in zip(got, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=1e-2 * b.abs().max().item())
    products = _products(tmp_path / "blas")
    assert products.count((_torch_blas.DOMAIN, "Bf16MatMul")) == 5, products
    transposes = [n for path in glob.glob(str(tmp_path / "blas" / "*.onnx"))
                  for n in onnx.load(path).graph.node if n.op_type == "Transpose"]
    assert not transposes


@pytest.mark.skipif(not _torch_blas.bfloat16_products(), reason="this torch's BLAS has no bfloat16 product")
def test_autocast_attention_written_out_multiplies_its_heads_on_torchs_blas(tmp_path):
    """Under autocast attention is written out: its batched products of bfloat16 heads are MKL's too."""
    torch.manual_seed(0)
    projection = torch.nn.Linear(32, 96)
    x = torch.randn(2, 20, 32)

    def attention(x):
        q, k, v = (t.view(2, 20, 4, 8).transpose(1, 2) for t in projection(x).split(32, dim=-1))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    def step(fn, matmul=None):
        projection.zero_grad()
        if matmul:
            ort_dynamo.reset()
            torch._dynamo.reset()
            fn = torch.compile(fn, backend="ort", options={"cpu_matmul": matmul, "save_onnx": True,
                                                           "save_path": str(tmp_path / matmul)})
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn(x)
        out.float().square().sum().backward()
        return [out.float(), *(p.grad.clone() for p in projection.parameters())]

    got, theirs = step(attention, "torch_blas"), step(attention, "ort")
    for a, b in zip(got, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=1e-2 * b.abs().max().item())
    # The projection's 3 (forward, two gradients), attention's 2 forward and 4 backward.
    assert _products(tmp_path / "torch_blas") == [(_torch_blas.DOMAIN, "Bf16MatMul")] * 9


def test_ort_keeps_its_own_products(tmp_path):
    fn, shapes = CASES["linear"]
    inputs = [torch.randn(s) for s in shapes]
    _assert_like_eager(_train_step(fn, inputs, tmp_path, matmul="ort"), _train_step(fn, inputs))
    assert all(domain != _torch_blas.DOMAIN for domain, _ in _products(tmp_path))


def test_batches_of_any_size_none_included_multiply_right_under_dynamic_shapes():
    fn = torch.compile(lambda x, w: x @ w, backend="ort", dynamic=True, options={"cpu_matmul": "torch_blas"})
    w = torch.randn(16, 8)
    for rows in (3, 11, 0):
        x = torch.randn(rows, 5, 16)
        torch.testing.assert_close(fn(x, w), x @ w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pool", ["torch", "ort"])
def test_batches_of_products_of_any_count_none_included_multiply_right(pool):
    if pool == "torch" and _openmp.problem():
        pytest.skip(f"needs torch's GNU OpenMP: {_openmp.problem()}")
    ort_dynamo.reset()
    torch._dynamo.reset()
    fn = torch.compile(lambda a, b: a @ b, backend="ort", dynamic=True,
                       options={"cpu_matmul": "torch_blas", "cpu_thread_pool": pool, "fallback_policy": "DISABLE"})
    for batch in (1, 7, 0):
        a, b = torch.randn(batch, 9, 16), torch.randn(batch, 16, 5)
        torch.testing.assert_close(fn(a, b), a @ b, rtol=1e-5, atol=1e-5)


def test_a_library_that_does_not_build_leaves_the_products_to_ort(monkeypatch, tmp_path):
    def failing_compiler(command, cwd):
        raise _kernels.KernelBuildError("cc failed")

    monkeypatch.setattr(_kernels, "_run", failing_compiler)
    fn, shapes = CASES["linear"]
    inputs = [torch.randn(s) for s in shapes]
    ort_dynamo.reset()
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="ort", options={"cpu_matmul": "torch_blas", "pointwise_kernels": False,
                                                         "cache_dir": str(tmp_path), "fallback_policy": "DISABLE"})
    with pytest.warns(UserWarning, match="torch's BLAS products could not be built, ORT multiplies instead"):
        torch.testing.assert_close(compiled(*inputs), fn(*inputs))


def test_unknown_choice_is_refused():
    with pytest.raises(OptionsError, match="cpu_matmul must be one of"):
        ort_dynamo.OrtOptions(cpu_matmul="mkl")
