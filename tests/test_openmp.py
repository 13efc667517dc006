"""Option cpu_thread_pool: a CPU session on one thread whose products (torch's BLAS) and kernels
split their work over PyTorch's OpenMP threads, the ones eager's ops use; "auto" picks it for
graphs without ORT's own threaded ops, "ort" keeps ORT's intra-op threads."""

import ctypes
import glob
import os

import onnx
import onnx_ir as ir
import pytest
import torch

import ort_dynamo
from ort_dynamo import _openmp, _torch_blas
from ort_dynamo import run as run_stage
from ort_dynamo.errors import OptionsError
from ort_dynamo.options import OrtOptions

needs_openmp = pytest.mark.skipif(bool(_openmp.problem() or _torch_blas.problem()),
                                  reason=f"needs torch's GNU OpenMP, its BLAS and a compiler: {_openmp.problem()}")


class _Block(torch.nn.Module):
    """A pre-norm transformer block: products, LayerNorm, GELU, attention with heads of 16."""

    def __init__(self, hidden=64, heads=4):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)
        self.qkv, self.out = torch.nn.Linear(hidden, 3 * hidden), torch.nn.Linear(hidden, hidden)
        self.up, self.down = torch.nn.Linear(hidden, 4 * hidden), torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, h))
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))


def _recorded_runners(monkeypatch) -> list:
    runners = []
    make = run_stage.OrtRunner.__init__

    def record(self, *args, **kwargs):
        make(self, *args, **kwargs)
        runners.append(self)

    monkeypatch.setattr(run_stage.OrtRunner, "__init__", record)
    return runners


def _train(model, x, steps, compiled=None):
    """Each step's loss and, at the end, the parameters (SGD: the gradients reach the weights)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fn = model if compiled is None else compiled
    losses = []
    for _ in range(steps):
        loss = fn(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()]


@needs_openmp
def test_a_transformer_block_trains_like_eager_on_pytorchs_openmp_threads(monkeypatch):
    runners = _recorded_runners(monkeypatch)
    ort_dynamo.reset()
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = _Block(), torch.randn(4, 32, 64)
    twin = _Block()
    twin.load_state_dict(model.state_dict())
    compiled = torch.compile(twin, backend="ort", options={"cpu_thread_pool": "torch", "fallback_policy": "DISABLE"})
    compiled(x).sum().backward()
    ort_dynamo.wait_for_kernels()  # the steps below run the kernels, not the interim model
    twin.zero_grad()
    want_losses, want_params = _train(model, x, 3)
    got_losses, got_params = _train(twin, x, 3, compiled)
    torch.testing.assert_close(got_losses, want_losses, rtol=1e-4, atol=1e-5)
    for got, want in zip(got_params, want_params, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert runners and all(r.exported.torch_threads for r in runners)
    sessions = [s for r in runners for s, *_ in r._sessions.values()]
    assert sessions and all(s.get_session_options().intra_op_num_threads == 1 for s in sessions)
    libraries = {r.kernel_library.result() for r in runners if r.kernel_library is not None}
    assert libraries, "no kernels: nothing ran on OpenMP's threads"
    if torch.get_num_threads() > 1:
        # The kernels' tasks were given PyTorch's threads, not run one by one on the session's.
        teams = [ctypes.CDLL(path).ortd_pw_openmp_largest_team() for path in libraries]
        assert max(teams) == torch.get_num_threads(), teams


@needs_openmp
def test_products_on_pytorchs_threads_are_marked_for_the_blas_to_thread(tmp_path):
    ort_dynamo.reset()
    torch._dynamo.reset()
    layer = torch.nn.Linear(32, 48)
    compiled = torch.compile(layer, backend="ort", options={"cpu_thread_pool": "torch", "save_onnx": True,
                                                             "save_path": str(tmp_path)})
    x = torch.randn(64, 32, requires_grad=True)
    compiled(x).sum().backward()
    want = x.grad.clone()
    x.grad = None
    layer(x).sum().backward()
    torch.testing.assert_close(want, x.grad)
    products = [node for path in glob.glob(f"{tmp_path}/*.onnx") for node in onnx.load(path).graph.node
                if node.domain == _torch_blas.DOMAIN]
    assert products and all(onnx.helper.get_node_attr_value(n, "torch_threads") == 1 for n in products)


def _value(name, shape):
    return ir.Value(name=name, shape=ir.Shape(shape), type=ir.TensorType(ir.DataType.FLOAT))


def _product(domain, a, b, out, **attributes):
    node = ir.node("MatMul", [_value("a", a), _value("b", b)], attributes=attributes, domain=domain)
    node.outputs[0].shape = ir.Shape(out)
    return node


def _conv(x, w, out):
    node = ir.node("Conv", [_value("x", x), _value("w", w)])
    node.outputs[0].shape = ir.Shape(out)
    return node


def test_the_share_of_work_left_to_orts_threaded_ops_counts_multiply_adds():
    blas = _torch_blas.DOMAIN
    products = [_product(blas, ["batch", 64, 256], [256, 256], ["batch", 64, 256]) for _ in range(10)]
    # A ViT's patch embedding: 64 patches of 3 x 4 x 4 values into 256 channels, next to 10 products
    # of 64 x 256 x 256 each (per sample): 786 432 against 41 943 040 multiply-adds.
    patches = _conv(["batch", 3, 32, 32], [256, 3, 4, 4], ["batch", 256, 8, 8])
    share = _openmp.threaded_ort_share([*products, patches], blas)
    assert share == pytest.approx(786432 / (786432 + 41943040))
    assert _openmp.applies(OrtOptions(), "cpu", share) == (not _openmp.problem() and _torch_blas.applies(
        OrtOptions(), "cpu") and os.environ.get("OMP_WAIT_POLICY", "").lower() != "passive")
    # A ResNet's convolutions are nearly all of it.
    convs = [_conv(["batch", 64, 32, 32], [64, 64, 3, 3], ["batch", 64, 32, 32]) for _ in range(8)]
    assert _openmp.threaded_ort_share([*convs, products[0]], blas) > 0.9
    # A product MLAS keeps weighs as much as one on torch's BLAS (transA reads the other axis).
    mlas = _product("com.microsoft", [256, 1024], [256, 64], [1024, 64], transA=1)
    assert _openmp.threaded_ort_share([mlas, _product(blas, [1024, 256], [256, 64], [1024, 64])], blas) == 0.5
    # An op whose work the shapes do not tell (an RNN) or a shape not known: ORT's threads keep it.
    assert _openmp.threaded_ort_share([ir.node("LSTM", [_value("x", [5, 2, 8])]), *products], blas) == 1.0
    assert _openmp.threaded_ort_share(products, blas) == 0.0


def test_auto_keeps_orts_threads_where_they_do_much_or_the_user_asked_for_them(monkeypatch):
    assert not _openmp.applies(OrtOptions(), "cpu", 0.5)
    assert not _openmp.applies(OrtOptions(), "cpu", 0.0, kernels=False)
    assert not _openmp.applies(OrtOptions(intra_op_num_threads=2), "cpu")
    assert not _openmp.applies(OrtOptions(cpu_thread_pool="ort"), "cpu")
    assert not _openmp.applies(OrtOptions(), "cuda")
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")  # PyTorch's threads sleep between ops too
    assert not _openmp.applies(OrtOptions(), "cpu")


@needs_openmp
def test_auto_takes_pytorchs_threads_for_a_graph_of_products_and_kernels(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert _openmp.applies(OrtOptions(cpu_matmul="torch_blas"), "cpu", 0.1)
    assert _openmp.applies(OrtOptions(cpu_matmul="auto"), "cpu") == _torch_blas.applies(OrtOptions(), "cpu")


@pytest.mark.parametrize("options, message", [
    ({"cpu_thread_pool": "openmp"}, "cpu_thread_pool must be one of"),
    ({"cpu_thread_pool": "torch", "cpu_matmul": "ort"}, "cpu_matmul='ort' rules out"),
    ({"cpu_thread_pool": "torch", "intra_op_num_threads": 4}, "intra_op_num_threads=4"),
])
def test_contradicting_thread_options_are_refused_by_name(options, message):
    with pytest.raises(OptionsError, match=message):
        OrtOptions.from_mapping(options)


def test_an_explicit_torch_pool_that_cannot_apply_says_why_and_keeps_orts_threads(monkeypatch):
    from ort_dynamo import partition

    monkeypatch.setattr(_openmp, "problem", lambda: "this torch's OpenMP is not GNU OpenMP")
    monkeypatch.setattr(partition, "_WARNED", set())
    with pytest.warns(UserWarning, match="cpu_thread_pool='torch' cannot apply.*not GNU OpenMP"):
        assert not _openmp.applies(OrtOptions(cpu_thread_pool="torch"), "cpu")
    assert not _openmp.applies(OrtOptions(), "cpu")  # auto: quietly
