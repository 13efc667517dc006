"""Ops closed by decompositions (ort_dynamo/decompositions.py) or small lowerings
(ort_dynamo/lowerings/core.py): each runs wholly on ORT and matches eager, forward and
gradients, including the edge cases their decompositions take care of (NaN, ties, padding,
empty bags, zero distances). Random ops (rrelu, uniform) draw from ORT's RNG: checked
statistically."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F

import ort_dynamo

NAN, INF = float("nan"), float("inf")


def run_on_ort(fn, *inputs):
    """Outputs and input gradients of ``fn`` compiled on ORT; asserts nothing fell back."""
    ort_dynamo.reset()
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="ort", dynamic=False)
    result = _outputs_and_grads(compiled, inputs)
    rep = ort_dynamo.report()
    assert rep.fallback_nodes == 0, rep.fallbacks
    assert rep.ort_nodes > 0
    return result


def _outputs_and_grads(fn, inputs):
    leaves = [x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
              for x in inputs]
    out = fn(*leaves)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    wrt = [x for x in leaves if isinstance(x, torch.Tensor) and x.requires_grad]
    diff = [o for o in outs if o.requires_grad]
    if not wrt or not diff:
        return outs, ()
    gen = torch.Generator().manual_seed(0)
    loss = sum((o * torch.rand(o.shape, generator=gen)).nansum() for o in diff)
    return outs, torch.autograd.grad(loss, wrt, allow_unused=True)


def check(fn, *inputs, atol=1e-5):
    outs, grads = run_on_ort(fn, *inputs)
    expected_outs, expected_grads = _outputs_and_grads(fn, inputs)
    for got, want in zip(outs, expected_outs):
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=atol, equal_nan=True)
    assert len(grads) == len(expected_grads)
    for got, want in zip(grads, expected_grads):
        if got is None or want is None:  # unused input: the other side must be all zeros
            assert (want if got is None else got) is None or not (want if got is None else got).any()
        else:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, equal_nan=True)


def test_sgn_squeeze_multiple_empty_permuted():
    x = torch.tensor([[-2.0, 0.0, 3.0]]).reshape(1, 3, 1).requires_grad_()
    check(lambda t: (torch.sgn(t) * t).squeeze((0, 2)), x)
    outs, _ = run_on_ort(lambda t: (t + torch.empty_permuted((2, 3, 4), (2, 0, 1)).shape[1]), torch.ones(3))
    assert torch.equal(outs[0], torch.full((3,), 4.0))


_ACTIVATIONS = {
    "hardtanh": F.hardtanh, "relu6": F.relu6, "relu": F.relu, "threshold": lambda t: F.threshold(t, 1.0, -5.0),
    "leaky_relu": F.leaky_relu, "hardsigmoid": F.hardsigmoid, "hardswish": F.hardswish, "elu": F.elu,
    "celu": F.celu, "selu": F.selu, "softplus": lambda t: F.softplus(t, threshold=2.0), "hardshrink": F.hardshrink,
    "softshrink": F.softshrink, "clamp": lambda t: t.clamp(-1, 1), "clamp_min": lambda t: t.clamp(min=0.0),
    "rrelu_eval": lambda t: F.rrelu(t, training=False), "abs": torch.abs, "silu": F.silu, "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "mish": F.mish,
    "maximum": lambda t: torch.maximum(t, torch.zeros_like(t)), "prelu": lambda t: F.prelu(t, torch.tensor([0.25])),
    "logsigmoid": F.logsigmoid, "softsign": F.softsign,
}


@pytest.mark.parametrize("name", sorted(_ACTIVATIONS))
def test_activation_gradients_at_their_kinks_and_infinities_are_eagers(name):
    """Each activation's gradient exactly at its kinks and thresholds, at the infinities and at
    NaN, where eager picks a side (hardtanh's bounds had the wrong one: the test below)."""
    points = [-6.0, -3.0, -2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0, 3.0, 6.0, float("nan"), float("inf"), -float("inf")]
    if name == "gelu":  # eager's float32 CPU GELU gives NaN at +inf; its float64 one and ORT give inf
        points.remove(float("inf"))
    points = torch.tensor(points, requires_grad=True)
    fn = _ACTIVATIONS[name]
    (got,), _ = run_on_ort(lambda t: fn(t).nansum(), points)
    (got_grad,) = torch.autograd.grad(torch.compile(lambda t: fn(t).nansum(), backend="ort")(points), points)
    (want_grad,) = torch.autograd.grad(fn(points).nansum(), points)
    torch.testing.assert_close(got, fn(points).nansum(), equal_nan=True)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_hardtanh_and_relu6_pass_no_gradient_at_their_bounds(dtype):
    """ATen's hardtanh_backward gives 0 at the bounds themselves (``x <= min or x >= max``);
    torchlib's let the gradient through there, so ReLU6 at exactly 0 or 6 had a gradient eager
    does not have, silently, and its float32 masks failed float16 and float64 graphs in ORT."""
    x = torch.tensor([-7.0, -1.0, -0.5, 0.0, 0.5, 1.0, 3.0, 6.0, 9.0], dtype=dtype, requires_grad=True)
    check(lambda t: F.hardtanh(t) * 3, x)
    check(lambda t: F.relu6(t) * 3, x)
    check(lambda t: F.hardtanh(t, -0.5, 3.0) * 3, x)


def test_float64_layer_and_group_norms_run_on_ort():
    """ORT's CPU provider has no float64 LayerNormalization or InstanceNormalization, and
    torchlib's layer norm asks for float32 statistics: a float64 model's norms failed at run
    time and their partition ran in PyTorch. In float64 they are torch's decompositions now."""
    x = torch.randn(3, 4, 8, dtype=torch.float64, requires_grad=True)
    w, b = torch.rand(8, dtype=torch.float64) + 0.5, torch.randn(8, dtype=torch.float64)
    check(lambda t: F.layer_norm(t, (8,), w, b).sin(), x, atol=1e-12)
    check(lambda t: F.layer_norm(t, (4, 8)).sin(), x, atol=1e-12)
    check(lambda t: F.group_norm(t, 2).sin(), x, atol=1e-12)


def test_a_gather_of_an_empty_uint8_index_and_its_gradient_run_on_ort():
    """torch's gather takes an empty uint8 index (OpInfo's last sample); ONNX indices are int32
    or int64, so the backward's scatter failed ORT's type check and ran in PyTorch. Indices of
    other integer types are cast to int64."""
    x = torch.randn(5, requires_grad=True)
    check(lambda t: torch.gather(t * 2, 0, torch.empty(0, dtype=torch.uint8)).sum() + t.square().sum(), x)


@pytest.mark.parametrize("right", [False, True])
def test_searchsorted_isin(right):
    # NaNs sort last; values hit ties, infinities and NaN; results are where eager's loop ends.
    boundaries = torch.tensor([-INF, 0.0, 1.0, 1.0, 2.0, INF, NAN])
    values = torch.tensor([[-INF, -1.0, 0.0, 1.0], [1.5, 2.0, INF, NAN]])
    check(lambda b, v: torch.searchsorted(b, v, right=right), boundaries, values)
    rows = torch.tensor([[0.0, 1.0, 1.0, 3.0], [2.0, 2.0, 5.0, 7.0]])
    check(lambda b, v: torch.searchsorted(b, v, side="right" if right else "left", out_int32=True),
          rows, values[:, :3])
    shuffled = torch.tensor([3.0, 1.0, 2.0, 1.0])
    check(lambda b, s, v: torch.searchsorted(b, v, sorter=s, right=right), shuffled, shuffled.argsort(),
          torch.tensor([0.5, 1.0, 2.5, 9.0]))
    elements = torch.arange(60.0).reshape(6, 10) % 7
    check(lambda e, t: torch.isin(e, t, invert=right), elements, torch.tensor([0.0, 3.0, 6.0]))


def test_take_put():
    x = torch.randn(3, 4, requires_grad=True)
    index = torch.tensor([[0, -1], [5, 11]])
    source = torch.randn(2, 2, requires_grad=True)
    check(lambda t: torch.take(t, index) * 2, x)
    check(lambda t, s: torch.put(t, index, s), x, source)
    repeated = torch.tensor([1, 1, -11, 2])  # -11 is element 1 again: accumulates three times
    check(lambda t, s: torch.put(t, repeated, s, accumulate=True), x, torch.randn(4, requires_grad=True))


@pytest.mark.parametrize("reduce", ["amax", "amin", "mean", "prod"])
def test_index_reduce(reduce):
    x = torch.randn(5, 3, requires_grad=True)
    source = torch.randn(4, 3, requires_grad=True)
    index = torch.tensor([0, 4, 0, 2])
    for include_self in (True, False):
        check(lambda t, s: t.index_reduce(0, index, s, reduce, include_self=include_self), x, source)
    scalar = torch.tensor(2.0, requires_grad=True)
    check(lambda t, s: t.index_reduce(0, torch.tensor([0]), s, reduce), scalar, torch.tensor(-3.0))


def test_bilinear():
    layer_weight = torch.randn(4, 3, 5, requires_grad=True)
    bias = torch.randn(4, requires_grad=True)
    check(F.bilinear, torch.randn(2, 6, 3, requires_grad=True), torch.randn(2, 6, 5, requires_grad=True),
          layer_weight, bias)


@pytest.mark.parametrize("p", [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, INF])
def test_cdist_pdist(p):
    x1 = torch.randn(2, 4, 3)
    x1[:, 1] = x1[:, 0]  # zero distances: torch's backward conventions apply
    x2 = torch.cat([x1[:, :1], torch.randn(2, 2, 3)], 1)
    x1.requires_grad_()
    x2.requires_grad_()
    check(lambda a, b: torch.cdist(a, b, p=p), x1, x2, atol=1e-4)
    check(lambda a: F.pdist(a, p=p), x1[0].detach().requires_grad_(), atol=1e-4)
    if p == 2.0:  # the matmul form eager picks for more than 25 rows
        check(lambda a, b: torch.cdist(a, b), torch.randn(30, 3, requires_grad=True),
              torch.randn(5, 3, requires_grad=True), atol=1e-4)


def test_adaptive_max_pool():
    # Uneven, overlapping windows; ties take the first maximum, NaN the last NaN (eager's CPU rule).
    x = torch.randn(2, 3, 7, 5)
    x[0, 0, 0, :2] = 5.0
    x[1, 1, 2, 1] = NAN
    x[1, 1, 3, 0] = NAN
    x.requires_grad_()
    check(lambda t: F.adaptive_max_pool2d(t, (3, 2), return_indices=True), x)
    check(lambda t: F.adaptive_max_pool1d(t, 4, return_indices=True), x[0].detach().requires_grad_())
    check(lambda t: F.adaptive_max_pool3d(t, (2, 3, 2), return_indices=True),
          torch.randn(1, 2, 3, 7, 5, requires_grad=True))


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag(mode):
    weight = torch.randn(6, 4, requires_grad=True)
    indices = torch.tensor([4, 1, 2, 0, 1, 4, 2, 2, 5])
    offsets = torch.tensor([0, 3, 3, 5])  # bag 1 is empty
    check(lambda w: F.embedding_bag(indices, w, offsets, mode=mode), weight)
    check(lambda w: F.embedding_bag(indices, w, offsets, mode=mode, padding_idx=4), weight)
    check(lambda w: F.embedding_bag(indices, w, torch.tensor([0, 3, 3, 9]), mode=mode,
                                    include_last_offset=True), weight)
    if mode != "max":  # its backward stays in PyTorch (eager's CPU kernel has its own counts)
        ort_dynamo.reset()
        torch._dynamo.reset()
        fn = lambda w: F.embedding_bag(indices, w, offsets, mode=mode, scale_grad_by_freq=True)  # noqa: E731
        outs, grads = _outputs_and_grads(torch.compile(fn, backend="ort", dynamic=False), (weight,))
        assert [fb.op for fb in ort_dynamo.report().fallbacks] == ["aten._embedding_bag_backward.default"]
        expected_outs, expected_grads = _outputs_and_grads(fn, (weight,))
        torch.testing.assert_close(outs, expected_outs)
        torch.testing.assert_close(grads, expected_grads)
    if mode == "sum":
        check(lambda w, s: F.embedding_bag(indices, w, offsets, mode="sum", per_sample_weights=s,
                                             padding_idx=1),
              weight, torch.randn(9, requires_grad=True))
        check(lambda w: F.embedding_bag(indices.reshape(3, 3), w), weight)


def test_masked_scatter():
    x = torch.randn(3, 4, requires_grad=True)
    mask = torch.tensor([True, False, True, True])  # broadcast over rows
    source = torch.randn(4, 3, requires_grad=True)  # more elements than the mask selects
    check(lambda t, s: t.masked_scatter(mask, s), x, source)


def test_nanmedian():
    x = torch.tensor([[3.0, NAN, 1.0, 2.0, 4.0], [NAN, NAN, NAN, NAN, 6.0], [1.0, INF, NAN, 5.0, INF]])
    x.requires_grad_()
    check(lambda t: torch.nanmedian(t, dim=1), x)
    check(lambda t: torch.nanmedian(t, dim=0, keepdim=True), x)
    check(torch.nanmedian, x)
    check(torch.nanmedian, torch.tensor([NAN, NAN], requires_grad=True))
    # median (not nan-): a row with NaN gives its first NaN.
    check(lambda t: torch.median(t, dim=1), x)
    # An all-NaN row: NaN, at an index eager leaves to std::nth_element (ours: the first).
    outs, _ = run_on_ort(lambda t: torch.nanmedian(t, dim=1), torch.full((2, 5), NAN))
    assert outs[0].isnan().all() and outs[1].tolist() == [0, 0]


def test_mode():
    # Ties between runs take the smallest value; the index is that value's last position.
    x = torch.tensor([[3.0, 1.0, 3.0, 1.0, 2.0], [5.0, 5.0, -1.0, 4.0, 4.0], [7.0, 6.0, 6.0, 6.0, 7.0]])
    check(lambda t: torch.mode(t, 1), x.requires_grad_())
    check(lambda t: torch.mode(t, 0, keepdim=True), x)


@pytest.mark.parametrize("mode,padding,align_corners", [("bilinear", "zeros", False),
                                                        ("nearest", "border", True),
                                                        ("bicubic", "reflection", False)])
def test_grid_sample(mode, padding, align_corners):
    # Rewritten before AOTAutograd into torch's reference math (2-D) or ours (3-D, in
    # ort_dynamo/lower.py): the backward is derived by autograd.
    x = torch.randn(2, 3, 5, 6, requires_grad=True)
    grid = (torch.rand(2, 4, 3, 2) * 2.4 - 1.2).requires_grad_()  # some points outside
    check(lambda t, g: F.grid_sample(t, g, mode, padding, align_corners), x, grid, atol=1e-4)
    if mode != "bicubic":  # 3-D: trilinear or nearest
        volume = torch.randn(2, 2, 3, 4, 5, requires_grad=True)
        points = (torch.rand(2, 2, 3, 4, 3) * 2.4 - 1.2).requires_grad_()
        padding_3d = "reflection" if mode == "nearest" else padding
        check(lambda t, g: F.grid_sample(t, g, mode, padding_3d, not align_corners), volume, points,
              atol=1e-4)


def test_antialiased_bilinear_resize():
    # Downsampling widens the filter; align_corners and explicit scales change the weights
    # (torchlib's forward lowering ignores both: decomposed instead).
    x = torch.randn(2, 3, 10, 13, requires_grad=True)
    check(lambda t: F.interpolate(t, size=(4, 6), mode="bilinear", antialias=True), x)
    check(lambda t: F.interpolate(t, scale_factor=(1.7, 0.45), mode="bilinear", antialias=True,
                                  align_corners=True), x)
    check(lambda t: torch.ops.aten._upsample_bilinear2d_aa(t, [3, 3], False, 1.7, 0.9), x)


def test_histogram():
    # Values on the right edge count in the last bin; outside values and NaN are dropped.
    x = torch.tensor([0.0, 1.0, 2.0, NAN, 5.0, 3.0, -1.0])
    check(lambda t: torch.histogram(t, torch.tensor([0.0, 1.0, 1.0, 3.0])), x)
    check(lambda t, w: torch.histogram(t, 3, range=(0.0, 3.0), weight=w, density=True), x, torch.rand(7))
    check(lambda t: torch.histogram(t, 4), torch.tensor([[2.0, 0.5], [2.0, 1.5]]))
    check(lambda t: torch.histogram(t, 4), torch.full((3,), 1.0))  # one value: widened by 0.5


@pytest.mark.parametrize("reduce", ["max", "min", "mean", "sum", "prod"])
def test_segment_reduce(reduce):
    # Ties share the gradient, a NaN wins max/min, a zero takes the exclusive product.
    data = torch.tensor([[1.0, 2.0], [1.0, 0.0], [3.0, NAN], [-1.0, 4.0], [3.0, 4.0], [2.0, 0.5]])
    data.requires_grad_()
    lengths = torch.tensor([2, 0, 3, 1])
    for initial in (None, 2.0):
        check(lambda d: torch.segment_reduce(d, reduce, lengths=lengths, initial=initial), data)
    check(lambda d: torch.segment_reduce(d, reduce, offsets=torch.tensor([0, 2, 2, 5, 6])), data)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_linear_cross_entropy_chunked(reduction):
    options = pytest.importorskip("torch.nn.modules.linear_cross_entropy_options")
    # allow_retain_graph=True: otherwise torch warns under compile (a Dynamo graph break)
    chunked = options.LinearCrossEntropyOptions(batch_chunk_size=2, allow_retain_graph=True)
    x = torch.randn(5, 3, requires_grad=True)
    w = torch.randn(4, 3, requires_grad=True)
    target = torch.tensor([0, 3, 1, 1, 2])
    check(lambda a, b: F.linear_cross_entropy(a, b, target, reduction=reduction, ignore_index=1,
                                              options=chunked), x, w)


def test_nonzero_static():
    x = torch.tensor([[0.0, 1.0, 0.0], [2.0, 0.0, 3.0]])
    for size in (2, 5):
        check(lambda t: torch.nonzero_static(t, size=size, fill_value=-7), x)


def test_rrelu_draws_slopes_in_range():
    x = torch.cat([-torch.rand(20000) - 0.5, torch.rand(100)]).requires_grad_()
    lower, upper = 0.1, 0.3
    outs, grads = run_on_ort(lambda t: F.rrelu(t, lower, upper, training=True), x)
    out, grad = outs[0].detach(), grads[0]
    slope = out[:20000] / x[:20000].detach()
    assert slope.min() >= lower and slope.max() <= upper
    assert abs(slope.mean().item() - (lower + upper) / 2) < 0.005
    assert slope.std().item() > 0.05  # drawn per element, not one slope
    assert torch.equal(out[20000:], x[20000:].detach())
    # d out / d x is the slope that was drawn (the noise tensor the forward saved).
    weights = torch.rand(out.shape, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(grad[:20000], weights[:20000] * slope)
    check(lambda t: F.rrelu(t, lower, upper, training=False), x)


def test_uniform_range_and_mean():
    outs, _ = run_on_ort(lambda t: torch.empty_like(t).uniform_(-2.0, 4.0) + t, torch.zeros(20000))
    sample = outs[0]
    assert sample.min() >= -2.0 and sample.max() <= 4.0
    assert abs(sample.mean().item() - 1.0) < 0.05
    assert abs(sample.var().item() - 3.0) < 0.15  # (4 - -2)^2 / 12


def onnx_ops_of(fn, *inputs, folder, models: str = "*", dynamic: bool | None = None, **options) -> set:
    """Op types in the ONNX models ``fn`` compiles to on ORT (those whose file names match
    ``models``: ``"*backward*"`` for the backward's), after one training step on the sum of its
    outputs and the generated kernels' build; ``options`` go to the backend."""
    import glob

    import onnx

    ort_dynamo.reset()
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="ort", dynamic=dynamic,
                             options={"save_onnx": True, "save_path": str(folder), **options})
    out = compiled(*inputs)
    sum(o.sum() for o in (out if isinstance(out, tuple) else (out,))).backward()
    ort_dynamo.wait_for_kernels()
    return {node.op_type for path in glob.glob(str(folder / f"{models}.onnx")) for node in onnx.load(path).graph.node}


def test_slice_backward_and_slice_scatter_without_scatter_nd(tmp_path):
    """Slicing's backward is a Pad and slice_scatter a Concat (torchlib: Transpose, ScatterND,
    Transpose); negative and out-of-range bounds clamp as Python slices do; steps other than 1
    keep torchlib's lowering."""
    x = torch.randn(2, 3, 8, requires_grad=True)
    check(lambda t: torch.cat((-t[..., 4:], t[..., :4]), dim=-1) * 2, x)  # RoPE's rotate_half
    check(lambda t: t[:, -2:, 1:100].exp() + t[:, :1, :-3].sum(), x)
    check(lambda t: t[..., ::3].square(), x)
    src = torch.randn(2, 3, 3)
    check(lambda t, s: torch.slice_scatter(t, s, dim=2, start=2, end=5), x, src)
    check(lambda t, s: torch.slice_scatter(t, s, dim=-1, start=-3), x, src)
    check(lambda t, s: torch.slice_scatter(t, s[:, :2], dim=1, end=2), x, src[:, :, :1].expand(2, 3, 8))
    ops = onnx_ops_of(lambda t: torch.cat((-t[..., 4:], t[..., :4]), dim=-1), x, folder=tmp_path,
                      models="*backward*", pointwise_kernels=False)  # kernels read rotations in place
    assert "ScatterND" not in ops and "Pad" in ops, ops


@pytest.mark.parametrize("pointwise_kernels", [True, False])
def test_slices_and_rows_of_a_dynamic_length_have_gradients_on_ort_without_scatters(tmp_path, pointwise_kernels):
    """Under ``dynamic=True`` the sequence length is symbolic. A pooled first or last token
    (BERT's pooler, a reward model's ``h[:, -1]``) and a shifted slice (``logits[:, :-1]``) have
    gradients of zeros around them: Pads or a Where, as with static sizes. BERT's pooler fell
    back to PyTorch here, and slices went through ScatterND."""
    import glob

    import onnx

    def pooled_and_shifted(h):
        return h[:, 0] * 2 + h[:, -1], h[:, 1:] * h[:, :-1], h[:, 2:5].exp()

    ort_dynamo.reset()
    torch._dynamo.reset()
    options = {"save_onnx": True, "save_path": str(tmp_path), "pointwise_kernels": pointwise_kernels}
    compiled = torch.compile(pooled_and_shifted, backend="ort", dynamic=True, options=options)
    for length in (7, 9, 12):
        h = torch.randn(3, length, 4, requires_grad=True)
        got, got_grads = _outputs_and_grads(compiled, (h,))
        want, want_grads = _outputs_and_grads(pooled_and_shifted, (h,))
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(got_grads, want_grads)
    report = ort_dynamo.report()
    assert report.fallback_nodes == 0 and report.exports == 2, report  # one forward, one backward
    ops = {node.op_type for path in glob.glob(str(tmp_path / "*backward*.onnx")) for node in onnx.load(path).graph.node}
    assert not ops & {"ScatterND", "ScatterElements"}, ops


@pytest.mark.parametrize("mode", ["reflect", "replicate"])
def test_reflection_and_replication_padding_of_dynamic_sizes_have_gradients_without_scatters(tmp_path, mode):
    """CycleGAN's and vocoders' padding under ``dynamic=True``: the backward took torch's
    decomposition, an index scatter per padded dim (ReflectionPad2d's step 41 times eager's in
    ``layer_ops.py --dynamic reflect2d``). Sizes known to exceed the padding (an input's sizes
    are at least 2) keep the sums and Concats of static sizes. Reflection's borders, where
    their targets do not meet (guarded: a size that small recompiles), are slices bounded
    from the end, with no full-size Pad per border (1.45 of eager's step before, 1.05 after)."""
    import glob

    import onnx

    def padded(x):
        return F.pad(x, (3, 2, 1, 3), mode=mode) * x.sum()

    def check(size):
        x = torch.randn(2, 3, size, size + 1, requires_grad=True)
        got, got_grads = _outputs_and_grads(compiled, (x,))
        want, want_grads = _outputs_and_grads(padded, (x,))
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(got_grads, want_grads, rtol=1e-4, atol=1e-5)

    ort_dynamo.reset()
    torch._dynamo.reset()
    compiled = torch.compile(padded, backend="ort", dynamic=True, options={"save_onnx": True, "save_path": str(tmp_path)})
    for size in (9, 12, 17):
        check(size)
    report = ort_dynamo.report()
    assert report.fallback_nodes == 0 and report.exports == 2, report  # one forward, one backward
    ops = {node.op_type for path in glob.glob(str(tmp_path / "*backward*.onnx")) for node in onnx.load(path).graph.node}
    assert not ops & {"ScatterND", "ScatterElements"}, ops
    if mode == "reflect":
        assert "Pad" not in ops, ops
    check(4)  # the left and right borders' targets overlap
    assert ort_dynamo.report().exports == (4 if mode == "reflect" else 2), ort_dynamo.report()


@pytest.mark.parametrize("layers", [
    (torch.nn.Conv2d(3, 8, 7, stride=2, padding=3), torch.nn.MaxPool2d(3, 2, 1)),  # ResNet's stem
    (torch.nn.Conv2d(3, 8, 3, stride=2), torch.nn.AvgPool2d(2)),
    (torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.AvgPool2d(3, 2, 1, ceil_mode=True, count_include_pad=False)),
    (torch.nn.Conv2d(3, 8, 3, stride=3, padding=1, dilation=2), torch.nn.Conv2d(8, 8, 3, 2, 1, groups=4)),
    (torch.nn.Conv2d(3, 8, 2, stride=2), torch.nn.Conv2d(8, 8, (2, 3), stride=(2, 3))),  # ConvNeXt's downsampling
    (torch.nn.Conv2d(3, 8, 1, stride=2), torch.nn.Conv2d(8, 8, 1, stride=(3, 2))),  # ResNet's shortcuts
], ids=["resnet_stem", "avg_pool", "avg_pool_ceil", "dilated_grouped", "patches", "strided_1x1"])
def test_strided_convolutions_and_pooling_of_dynamic_sizes_train_on_ort_like_eager(layers):
    """Under ``dynamic=True`` the rows a strided window never reads (fewer than the stride) are
    a symbolic count. The input's gradient ran wrong where the convolution was padded (ResNet's
    stem: a gradient 70% off), average pooling's backward failed to export (fell back), and the
    weight's gradient, cut to the window as a view, recompiled for each remainder: ort_dynamo's
    decompositions now add no recompile to those Dynamo makes itself (``aot_eager``'s; torch
    2.11's pooling shapes make one)."""
    import copy

    from torch._dynamo.utils import counters

    def new_graphs(backend, check=None) -> int:
        """Dynamo graphs compiled after the first size, training at each remainder of the
        strides (no size leaves a 1 x 1 output, which Dynamo specializes)."""
        torch.manual_seed(0)
        eager = torch.nn.Sequential(*copy.deepcopy(layers))
        model = copy.deepcopy(eager)
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(model, backend=backend, dynamic=True)
        for size in (16, 15, 17):
            x = torch.randn(3, 3, size, size)
            inputs = []
            for fn in (compiled, eager):
                inputs.append(x.clone().requires_grad_())
                out = fn(inputs[-1])
                (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
            if check:
                check(inputs, model, eager)
            first = counters["stats"]["unique_graphs"] if size == 16 else first
        return counters["stats"]["unique_graphs"] - first

    def like_eager(inputs, model, eager):
        torch.testing.assert_close(inputs[0].grad, inputs[1].grad, rtol=1e-4, atol=1e-5)
        for got, want in zip(model.parameters(), eager.parameters()):
            torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-4)
            got.grad = want.grad = None

    ort_dynamo.reset()
    assert new_graphs("ort", like_eager) == new_graphs("aot_eager")
    assert ort_dynamo.report().fallback_nodes == 0


def test_strided_slices_backward_without_scatter_nd_where_kernels_build(tmp_path):
    """GPT-J's interleaved rotary reads ``x[..., ::2]`` and ``x[..., 1::2]``. Where the pointwise
    kernels apply, each slice's gradient is a Where the kernels fuse, not torchlib's Transpose,
    ScatterND, Transpose (2.5x eager's time in benchmarks/rope.py); slices that do not take one
    element of every run of ``step`` along the whole dim keep the old lowering."""
    from ort_dynamo import _kernels

    x = torch.randn(2, 3, 8, requires_grad=True)

    def strided_rope(t):
        return t * 2 + torch.stack((-t[..., 1::2], t[..., ::2]), dim=-1).flatten(-2) * 3

    check(strided_rope, x)
    check(lambda t: t[:, ::3].exp() + t[:, 1:, -5::4].square().sum(), x)  # partial: the old way
    if not _kernels.available():
        pytest.skip("no C compiler: the strided slices keep torchlib's lowering")
    ops = onnx_ops_of(strided_rope, x, folder=tmp_path, models="*backward*")
    assert "ScatterND" not in ops, ops


def test_padding_backward_and_unfold_without_index_driven_ops(tmp_path):
    """Reflection and replication padding's backward and ``Tensor.unfold`` (forward and
    backward) are slices, flips, sums and Concats: their indices are fixed by the shapes.
    torch's decompositions and torchlib gathered or scattered with an int64 index per element
    (GatherND, ScatterElements, Gather): 2-40x eager's time (benchmarks/layer_ops.py).
    Borders up to the dim's size less one, every dim of 3-D padding, windows that overlap,
    touch or leave gaps, and a tail no window reads."""
    x = torch.randn(2, 3, 6, 5, requires_grad=True)
    check(lambda t: F.pad(t, (1, 2, 3, 0), mode="reflect").sin(), x)
    check(lambda t: F.pad(t, (4, 4, 5, 5), mode="reflect").sin(), x)  # the borders' targets meet
    check(lambda t: F.pad(t, (2, 0, 1, 3), mode="replicate").sin(), x)
    check(lambda t: F.pad(t, (1, 1, 2, 0, 1, 2), mode="replicate").sin(), x)
    check(lambda t: F.pad(t, (1, 2, 0, 1, 2, 1), mode="reflect").cos(), x)
    check(lambda t: F.pad(t[:, :, 0, :1], (2, 3), mode="replicate").cos(), x)  # a dim of one
    s = torch.randn(2, 3, 23, requires_grad=True)
    for size, step in ((4, 2), (5, 5), (3, 4), (7, 3), (23, 1)):
        check(lambda t: (t.unfold(-1, size, step) * 2).sin(), s)
    check(lambda t: t.unfold(1, 2, 1).exp(), s)  # the windows' elements move last

    ops = onnx_ops_of(lambda t: F.pad(t, (2, 1, 1, 2), mode="reflect").sum()
                      + F.pad(t, (1, 1, 1, 1), mode="replicate").square().sum()
                      + t.flatten(-2).unfold(-1, 4, 2).sin().sum(), x, folder=tmp_path)
    assert not {op for op in ops if op.startswith(("Gather", "Scatter"))}, ops


def test_adaptive_average_pooling_whose_windows_tile_the_input_is_a_mean_and_a_spread(tmp_path):
    """Where the input is a multiple of the output (ResNet's 56 -> 7, any pooling to 1), every
    window is a plain mean: the backward spreads each gradient over its window with one Expand,
    and 3-D pooling is one ReduceMean, not products against an (out, in) averaging matrix (the
    backward 5x eager's time, benchmarks/layer_ops.py). Other sizes keep the matrix."""
    x = torch.randn(2, 3, 12, 8, requires_grad=True)
    check(lambda t: F.adaptive_avg_pool2d(t, (3, 4)).sin(), x)
    check(lambda t: F.adaptive_avg_pool2d(t, (6, 3)).sin(), x)  # 8 -> 3 does not tile
    check(lambda t: F.adaptive_avg_pool2d(t, (3, 4)).sin(), x.double().requires_grad_())  # no float64 AveragePool
    v = torch.randn(2, 3, 4, 6, 8, requires_grad=True)
    check(lambda t: F.adaptive_avg_pool3d(t, (2, 3, 4)).sin(), v)
    check(lambda t: F.adaptive_avg_pool3d(t[0], (1, 2, 1)).sin(), v)  # unbatched
    check(lambda t: F.adaptive_avg_pool3d(t, (3, 4, 5)).sin(), v)

    ops = onnx_ops_of(lambda a, b: (F.adaptive_avg_pool2d(a, (3, 4)), F.adaptive_avg_pool3d(b, (2, 3, 4))),
                      x, v, folder=tmp_path)
    assert "Expand" in ops and "ReduceMean" in ops and not {"ReduceSum", "MatMul"} & ops, ops


def test_adaptive_average_pooling_of_dynamic_sizes_compiles_once_for_every_multiple_of_the_output():
    """Under ``dynamic=True`` torch's decomposition of 2-D adaptive pooling made the window a
    constant (a guard ``size // 7 == 8``): each new image size recompiled and re-exported. The
    window is now the symbolic ``size // 7``, and the backward a spread, not the (out, in)
    matrix's products (layer_ops --dynamic adaptive_avg: 4.5x eager before). A size that is
    not a multiple recompiles once, onto the matrix. 3-D pooling alike."""
    ort_dynamo.reset()
    torch._dynamo.reset()
    pooled = {2: lambda t: F.adaptive_avg_pool2d(t, 7).sin(), 3: lambda t: F.adaptive_avg_pool3d(t, (7, 1, 7)).sin()}
    for spatial, pool in pooled.items():
        compiled = torch.compile(pool, backend="ort", dynamic=True)
        exports = []
        for size in (14, 21, 42, 23, 25):  # multiples of 7, then not
            x = torch.randn(2, 3, *[size] * spatial, requires_grad=True)
            got, got_grads = _outputs_and_grads(compiled, (x,))
            want, want_grads = _outputs_and_grads(pool, (x,))
            torch.testing.assert_close(got, want)
            torch.testing.assert_close(got_grads, want_grads)
            exports.append(ort_dynamo.report().exports)
        assert exports[0] == exports[1] == exports[2] < exports[3] == exports[4], (spatial, exports)
    assert ort_dynamo.report().fallback_nodes == 0, ort_dynamo.report()


def test_adaptive_max_pooling_over_windows_of_dynamic_size_picks_eagers_indices():
    """Windows that tile the input but whose size is symbolic are not ONNX's MaxPool (its
    kernel is an attribute): each window's first maximum, or its last NaN, as torch's CPU
    kernel picks, at every size from one export."""
    ort_dynamo.reset()
    torch._dynamo.reset()
    pool = lambda t: F.adaptive_max_pool2d(t, (2, 3), return_indices=True)  # noqa: E731
    compiled = torch.compile(pool, backend="ort", dynamic=True)
    for size in (4, 6, 8):
        x = torch.randint(0, 3, (2, 3, size, size * 3 // 2)).float()  # ties
        x[0, 0, 0, 1] = x[0, 0, 1, 0] = float("nan")
        x[1, 1, :size // 2, :size // 2] = float("-inf")
        (values, indices), (want_values, want_indices) = compiled(x), pool(x)
        torch.testing.assert_close(values, want_values, equal_nan=True)
        assert torch.equal(indices, want_indices), size
    assert ort_dynamo.report().exports == 1 and ort_dynamo.report().fallback_nodes == 0, ort_dynamo.report()


#: Layers of convolutional and audio models, each at three sizes of its batch and spatial or
#: time dims (channels fixed by the weights): (op, channels or None, sizes).
_LAYERS_AT_THREE_SIZES = {
    "reflect_pad": (lambda x: F.pad(x, (1, 2, 2, 1), mode="reflect"), 3, (9, 12, 17)),
    "replicate_pad": (lambda x: F.pad(x, (1, 1, 1, 1), mode="replicate"), 3, (9, 12, 17)),
    "frames": (lambda x: x.unfold(-1, 8, 4), None, (40, 64, 100)),
    "frames_uneven": (lambda x: x.unfold(-1, 7, 3), None, (40, 64, 101)),
    "frames_with_gaps": (lambda x: x.unfold(-1, 3, 5), None, (40, 64, 102)),
    "patches": (lambda x: x.unfold(-1, 4, 4), None, (41, 65, 103)),  # torch guards on a multiple of 4 (contiguity)
    "rows_of_windows": (lambda x: x.unfold(2, 4, 3), 3, (9, 12, 17)),
    "nearest_up": (lambda x: F.interpolate(x, scale_factor=2, mode="nearest"), 3, (9, 12, 17)),
    "bilinear_up": (lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"), 3, (9, 40, 70)),
    "bilinear_corners": (lambda x: F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=True), 3,
                         (9, 12, 17)),
    "bicubic_up": (lambda x: F.interpolate(x, scale_factor=2, mode="bicubic"), 3, (9, 12, 17)),
    "max_pool": (lambda x: F.max_pool2d(x, 3, 2, 1), 3, (9, 12, 17)),
    "avg_pool": (lambda x: F.avg_pool2d(x, 2), 3, (8, 12, 18)),
    "adaptive_avg": (lambda x: F.adaptive_avg_pool2d(x, 4), 3, (8, 12, 20)),
    "global_avg": (lambda x: F.adaptive_avg_pool2d(x, 1), 3, (9, 12, 17)),
    "adaptive_max": (lambda x: F.adaptive_max_pool2d(x[..., 1:], 4), 3, (8, 12, 20)),  # windows that tile
    "pixel_shuffle": (lambda x: F.pixel_shuffle(x, 2), 8, (5, 8, 11)),
    "group_norm": (lambda x: F.group_norm(x, 2), 4, (9, 12, 17)),
    "instance_norm": (lambda x: F.instance_norm(x), 3, (9, 12, 17)),
    "im2col": (lambda x: F.unfold(x, 3, padding=1), 3, (9, 12, 17)),
    "channel_softmax": (lambda x: F.softmax(x, dim=1), 3, (9, 12, 17)),
    "conv_transpose": (lambda x, w=torch.randn(3, 2, 2, 2): F.conv_transpose2d(x, w, stride=2), 3, (9, 12, 17)),
    "strided_conv": (lambda x, w=torch.randn(4, 3, 3, 3): F.conv2d(x, w, stride=2, padding=1), 3, (9, 12, 17)),
    "depthwise_conv": (lambda x, w=torch.randn(3, 1, 5, 5): F.conv2d(x, w, padding=2, groups=3), 3, (9, 12, 17)),
}


@pytest.mark.parametrize("layer", list(_LAYERS_AT_THREE_SIZES))
def test_layers_of_dynamic_sizes_export_once_for_every_size(layer):
    """``dynamic=True``: a new batch and image (or signal) size reuses the graphs exported for
    the first, with eager's gradients. Before, bilinear upsampling's backward picked its path
    with a guard on the size (a recompile past 64), and 2-D adaptive pooling made its window a
    constant (a recompile at every size). Adaptive max pooling over windows that do not tile
    the input still recompiles at each size (docs/performance-log.md). ``Tensor.unfold`` along a
    symbolic dim was torchlib's Gather and its backward torch's index scatter."""
    op, channels, sizes = _LAYERS_AT_THREE_SIZES[layer]
    ort_dynamo.reset()
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: op(t).square(), backend="ort", dynamic=True)
    exports = []
    for batch, size in zip((2, 3, 5), sizes):
        x = torch.randn(batch, *([channels, size, size + 1] if channels else [size]), requires_grad=True)
        with torch.fx.experimental._config.patch(use_duck_shape=False):  # a batch of 2 is not the weight's 2
            got, got_grads = _outputs_and_grads(compiled, (x,))
        want, want_grads = _outputs_and_grads(lambda t: op(t).square(), (x,))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got_grads, want_grads, rtol=1e-4, atol=1e-4)
        exports.append(ort_dynamo.report().exports)
    report = ort_dynamo.report()
    assert report.fallback_nodes == 0, report
    # torch 2.11's max pooling shape function guards on the size's parity (aot_eager's too)
    assert exports[0] == exports[-1] or (layer == "max_pool" and torch.__version__ < "2.13"), (exports, report)


def test_nearest_upsampling_by_whole_numbers_is_a_resize_and_a_sum(tmp_path):
    """Nearest upsampling (U-Net and diffusion decoders) reached the trace as torch's index
    gather, whose backward is a ScatterElements with an int64 index per element. Where each
    input element repeats a whole number of times, it is ONNX Resize, and its backward a sum
    over the repeats. Other scales, float64 (ORT's CPU Resize has none) and nearest-exact keep
    torch's gather, and torch's tracing kernels are back in place after the compile."""
    x = torch.randn(2, 3, 5, 7, requires_grad=True)
    check(lambda t: F.interpolate(t, scale_factor=2, mode="nearest").sin(), x)
    check(lambda t: F.interpolate(t, size=(15, 7), mode="nearest").sin(), x)
    check(lambda t: F.interpolate(t[:, :, 0], scale_factor=4, mode="nearest").sin(), x)  # 1-D
    check(lambda t: F.interpolate(t.unsqueeze(2), scale_factor=(2, 1, 3), mode="nearest").sin(), x)  # 3-D
    check(lambda t: F.interpolate(t, scale_factor=1.5, mode="nearest").sin(), x)
    check(lambda t: F.interpolate(t, size=(7, 9), mode="nearest").sin(), x)
    check(lambda t: F.interpolate(t, scale_factor=0.5, mode="nearest").sin(), x)
    check(lambda t: F.interpolate(t.double(), scale_factor=2, mode="nearest").sin(), x)
    check(lambda t: F.interpolate(t, scale_factor=2, mode="nearest-exact").sin(), x)

    ops = onnx_ops_of(lambda t: F.interpolate(t, scale_factor=2, mode="nearest").square(), x, folder=tmp_path)
    assert "Resize" in ops and not {op for op in ops if op.startswith(("Gather", "Scatter"))}, ops
    for op in (torch.ops.aten.upsample_nearest2d.vec, torch.ops.aten.upsample_nearest2d.default):
        assert torch._C.DispatchKey.Autograd in op.py_kernels


def test_linear_upsampling_is_a_resize_and_by_whole_numbers_a_backward_without_scatters(tmp_path):
    """Bilinear (and 1-D, 3-D) upsampling reached the trace as torch's gather of the corners,
    its backward as ScatterElements. Now the forward is ONNX Resize where ORT computes what torch
    does (whole-number scales, align_corners), and a whole-number scale's backward is sums and
    shifts of the gradient's phases. Other scales, align_corners' backward (an index_add with
    torch's weights), one-element inputs and float64 on CPU all still match eager."""
    x = torch.randn(2, 3, 5, 7, requires_grad=True)
    for align_corners in (False, True):
        for size in (dict(scale_factor=2), dict(scale_factor=(3, 1)), dict(size=(10, 21)),
                     dict(scale_factor=1.5), dict(size=(7, 9)), dict(scale_factor=0.5), dict(size=(1, 1))):
            check(lambda t: F.interpolate(t, mode="bilinear", align_corners=align_corners, **size).sin(), x)
        check(lambda t: F.interpolate(t[:, :, 0], scale_factor=2, mode="linear", align_corners=align_corners).sin(), x)
        check(lambda t: F.interpolate(t.unsqueeze(2), scale_factor=(2, 2, 3), mode="trilinear",
                                      align_corners=align_corners).sin(), x)
        check(lambda t: F.interpolate(t[:, :, :1, :1], scale_factor=2, mode="bilinear",
                                      align_corners=align_corners).sin(), x)
    check(lambda t: F.interpolate(t.double(), scale_factor=2, mode="bilinear").sin(), x)

    ops = onnx_ops_of(lambda t: F.interpolate(t, scale_factor=2, mode="bilinear").square(), x, folder=tmp_path)
    assert "Resize" in ops and not {op for op in ops if op.startswith(("Gather", "Scatter"))}, ops


def test_max_pooling_numbers_its_indices_per_plane_and_takes_nan_as_torch(tmp_path):
    """ONNX MaxPool numbers indices across the whole tensor, torch within each (n, c) plane.
    torchlib found each plane's first number with a second MaxPool over the whole input; it is
    p times the plane's size. And ORT's MaxPool skips NaN where torch's takes it: a window with
    a NaN pools to NaN, at its last NaN (before, ORT returned the largest other value: a NaN
    in the input vanished silently). Indices as torch's for 1-, 2- and 3-D pooling, padding,
    dilation, ceil mode, unbatched; +inf before a NaN, and windows with several NaNs."""
    import onnx

    x = torch.randn(2, 3, 9, 8, requires_grad=True)
    cube = torch.randn(2, 3, 4, 9, 8, requires_grad=True)
    for pool in (lambda t: F.max_pool2d(t, 3, 2, 1, return_indices=True),
                 lambda t: F.max_pool2d(t, 2, dilation=2, ceil_mode=True, return_indices=True),
                 lambda t: F.max_pool2d(t[0], 2, return_indices=True),
                 lambda t: F.max_pool1d(t[:, :, 0], 3, 2, return_indices=True)):
        check(lambda t: (pool(t)[0].sin(), pool(t)[1].float()), x)
    check(lambda t: (F.max_pool3d(t, 2, return_indices=True)[0].sin(), F.max_pool3d(t, 2, return_indices=True)[1].float()), cube)
    nans = x.detach().clone()
    nans[0, 0, 0, 1] = nans[0, 0, 1, 0] = nans[1, 2, 4, 4] = nans[0, 1, 5, 2] = float("nan")
    nans[0, 1, 4, 2], nans[1, 1, 8, 7] = float("inf"), float("-inf")
    for pool in (lambda t: F.max_pool2d(t, 2, return_indices=True), lambda t: F.max_pool2d(t, 3, 2, 1, return_indices=True),
                 lambda t: F.max_pool1d(t.flatten(2), 4, return_indices=True)):
        outs, _ = run_on_ort(pool, nans)
        torch.testing.assert_close(outs[0], pool(nans)[0], equal_nan=True)
        assert torch.equal(outs[1], pool(nans)[1])

    # The portable graph (the pointwise kernels replace it with one TorchMaxPool: test_pointwise).
    ops = onnx_ops_of(lambda t: F.max_pool2d(t, 3, 2, 1).square(), x, folder=tmp_path, pointwise_kernels=False)
    assert "MaxPool" in ops
    pools = [node for path in tmp_path.glob("*forward*.onnx") for node in onnx.load(path).graph.node
             if node.op_type == "MaxPool"]
    kernels = [list(next(a.ints for a in node.attribute if a.name == "kernel_shape")) for node in pools]
    assert [1, 1] not in kernels, kernels  # no second pooling to number the planes
    assert sorted(len(node.output) for node in pools) == [1, 2], pools  # the NaN lookup reads no indices


def test_select_backward_and_select_scatter_without_scatter_elements(tmp_path):
    """Indexing's backward is a Pad, or a Where the pointwise kernels fuse, and select_scatter a
    Concat (torchlib: ScatterElements with an int64 index per element; nanoGPT-style attention's
    ``q, k, v = qkv`` after a permute spent 43 ms of a 190 ms step there). Negative indices count
    from the end."""
    from ort_dynamo import _kernels

    x = torch.randn(3, 2, 4, 5, requires_grad=True)
    check(lambda t: t[0] * t[1] + t[2].exp(), x)  # q, k, v = t
    check(lambda t: t[:, -1].square() + t.select(2, 1).sum(), x)
    src = torch.randn(3, 2, 5, requires_grad=True)
    check(lambda t, s: torch.select_scatter(t, s, 2, -2) * 3, x, src)
    check(lambda t, s: torch.select_scatter(t, s, -2, 0).cos(), x, src)
    pairs = torch.randn(2, 3, 8, requires_grad=True)  # torchtune's interleaved RoPE: pairs on the last dim
    check(lambda t: torch.stack([t.unflatten(-1, (-1, 2))[..., 0] * 2 - t.unflatten(-1, (-1, 2))[..., 1],
                                 t.unflatten(-1, (-1, 2))[..., 1] * 3], -1).flatten(-2), pairs)
    ort_dynamo.reset()
    torch._dynamo.reset()
    qkv = torch.randn(2, 8, 3, 2, 4).permute(2, 0, 3, 1, 4).detach().requires_grad_()

    def attention_inputs(t):
        q, k, v = t
        return (q @ k.transpose(-1, -2)).softmax(-1) @ v

    def backward_ops(pointwise_kernels: bool) -> set:
        return onnx_ops_of(attention_inputs, qkv, folder=tmp_path / str(pointwise_kernels), models="*backward*",
                           pointwise_kernels=pointwise_kernels)

    ops = backward_ops(pointwise_kernels=False)
    assert "ScatterElements" not in ops and "Pad" in ops, ops
    if _kernels.available():  # a Where, which the kernels fuse with the sum of the three
        ops = backward_ops(pointwise_kernels=True)
        assert not {"ScatterElements", "Pad"} & ops and ("Where" in ops or any(op.startswith("pw_") for op in ops)), ops


# -- accumulating writes with repeated indices (ORT's ScatterND add races) ----------------------

@pytest.mark.parametrize("write", ["embedding", "index_put", "index_add"])
def test_accumulating_writes_to_repeated_rows_sum_exactly(write):
    """Many writes land on few rows, as an embedding's gradient does for repeated tokens. Run
    several times: the race this avoids gave different wrong sums from run to run."""
    torch.manual_seed(0)
    rows = torch.randint(0, 8, (4096,))
    table = torch.randn(1024, 64, requires_grad=True)
    values = torch.randn(4096, 64)

    def fn(table, values):
        if write == "embedding":
            return F.embedding(rows, table) * values
        if write == "index_put":
            return table.index_put((rows,), values, accumulate=True)
        return table.index_add(0, rows, values, alpha=0.5)

    want = _outputs_and_grads(fn, (table, values))
    for _ in range(3):
        got = run_on_ort(fn, table, values)
        for g, w in zip([*got[0], *got[1]], [*want[0], *want[1]]):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-4)


def test_accumulating_write_through_several_index_tensors_sums_exactly():
    """Adjacent index tensors address one flattened dim (interpolate's and grid_sample's
    backward write this way)."""
    torch.manual_seed(0)
    i, j, values = torch.randint(-4, 4, (2048,)), torch.randint(0, 4, (2048,)), torch.randn(3, 2048, 5)
    fn = lambda v: torch.ops.aten.index_put(torch.zeros(3, 4, 4, 5), [None, i, j], v, True)  # noqa: E731
    for _ in range(3):
        got = run_on_ort(fn, values)
        torch.testing.assert_close(got[0][0], fn(values), rtol=1e-5, atol=1e-4)


def test_accumulating_write_through_index_tensors_apart_stays_in_pytorch():
    """Index tensors with a sliced dim between them move the indexed dims first (numpy's rule);
    that case stays in PyTorch, with the reason, rather than on ORT's racing ScatterND."""
    torch.manual_seed(0)
    i, j, values = torch.randint(0, 4, (2048,)), torch.randint(0, 4, (2048,)), torch.randn(2048, 3)
    fn = lambda v: torch.ops.aten.index_put(torch.zeros(4, 3, 4), [i, None, j], v, True)  # noqa: E731
    ort_dynamo.reset()
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match="ScatterND"):
        got = torch.compile(fn, backend="ort")(values)
    torch.testing.assert_close(got, fn(values), rtol=0, atol=0)
    assert [f.op for f in ort_dynamo.report().fallbacks] == ["aten.index_put.default"]


def test_max_and_min_of_values_holding_nan_are_nan_as_in_eager():
    """ORT's ReduceMax/ReduceMin pass over NaN; torch's reductions return it."""
    x = torch.randn(16, 64)
    x[3, 7] = NAN
    x[5, :] = NAN

    def fn(x):
        return x.amax(-1), x.amin(0, keepdim=True), torch.max(x, 1).values, torch.min(x, 0).values, x.max()

    for got, want in zip(run_on_ort(fn, x)[0], fn(x)):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_composite_ops_decompose_without_torch_exports_table(monkeypatch):
    """CompositeImplicitAutograd ops (cosine_similarity, square, hstack, one_hot here) break into
    ops torchlib lowers as AOTAutograd traces, so the decomposition table need not list them:
    building it never collects torch.export's table of them (0.08 s of a first step)."""
    from torch.export import decomp_utils

    from ort_dynamo import lower

    def collecting(*args, **kwargs):
        raise AssertionError("the decomposition table collected torch.export's composite ops")

    monkeypatch.setattr(decomp_utils.CustomDecompTable, "__init__", collecting)
    lower.decomposition_table.cache_clear()

    def composite(a, b, labels):
        similar = F.cosine_similarity(a, b, dim=-1)
        stacked = torch.hstack([a.square(), b])
        return similar, stacked * F.one_hot(labels, 4).sum(-1, keepdim=True)

    try:
        check(composite, torch.randn(5, 4, requires_grad=True), torch.randn(5, 4, requires_grad=True),
              torch.tensor([0, 3, 1, 2, 3]))
    finally:
        lower.decomposition_table.cache_clear()  # the next test builds it without the patch


def test_group_norm_is_a_layer_norm_over_the_groups(tmp_path):
    """torchlib lowers group norm to InstanceNormalization and then computes the mean and rstd
    backward needs in three more passes; each group is a row of one LayerNormalization, which
    returns them too (group_norm in benchmarks/layer_ops.py: ort/eager 1.39 -> 1.00). The
    gradients, through the saved mean and rstd, are eager's; with or without the affine."""
    x = torch.randn(4, 6, 5, 7, requires_grad=True) * 3 + 1
    norm = torch.nn.GroupNorm(3, 6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 2.0)
        norm.bias.normal_()
    check(lambda t: norm(t), x, atol=1e-5)
    check(lambda t: F.group_norm(t, 2), x[:, :, 0])
    ops = onnx_ops_of(norm, x, folder=tmp_path, models="*forward*", pointwise_kernels=False)
    assert "LayerNormalization" in ops and "InstanceNormalization" not in ops, ops


def test_group_norm_of_dynamic_sizes_is_a_layer_norm_too(tmp_path):
    """Under dynamic=True (a U-Net at any image size) group norm was torchlib's
    InstanceNormalization and three more passes (1.6 times eager's step with a static layer's
    channels); it is the LayerNormalization of the static case, its row length from the op's
    own sizes. Eager's gradients at two image sizes, nothing exported for the second."""
    import copy
    import glob

    import onnx

    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 1), torch.nn.GroupNorm(4, 8))
    model = copy.deepcopy(eager)
    ort_dynamo.reset()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="ort", dynamic=True,
                             options={"save_onnx": True, "save_path": str(tmp_path), "pointwise_kernels": False})
    exports = []
    for size in (6, 9):
        x = torch.randn(2, 3, size, size + 1, requires_grad=True)
        got, got_grads = _outputs_and_grads(compiled, (x,))
        want, want_grads = _outputs_and_grads(eager, (x,))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got_grads, want_grads, rtol=1e-4, atol=1e-4)
        exports.append(ort_dynamo.report().exports)
    assert exports[0] == exports[1] and ort_dynamo.report().fallback_nodes == 0, ort_dynamo.report()
    forward = [n.op_type for p in glob.glob(str(tmp_path / "*forward*.onnx")) for n in onnx.load(p).graph.node]
    assert "LayerNormalization" in forward and "InstanceNormalization" not in forward, forward


def test_weight_gradient_of_a_patch_convolution_is_one_product(tmp_path):
    """A convolution whose windows tile its input (stride = kernel: patch embeddings, 2x2
    downsampling; transposed, U-Net's up-convolution) has as weight gradient the output
    gradient times the input's patches. As a grouped convolution its kernel was the whole
    input (most of an up-convolution's step on ORT). Remainders no window reads,
    output_padding, 1-, 2- and 3-D; eager's gradients for input and weight."""
    x, x3 = torch.randn(2, 6, 9, 10, requires_grad=True), torch.randn(1, 2, 5, 6, 4, requires_grad=True)
    check(lambda t, w: F.conv2d(t, w, stride=(2, 3)), x, torch.randn(4, 6, 2, 3, requires_grad=True))
    check(lambda t, w: F.conv1d(t, w, stride=3), x[0], torch.randn(5, 9, 3, requires_grad=True))
    check(lambda t, w: F.conv3d(t, w, stride=2), x3, torch.randn(3, 2, 2, 2, 2, requires_grad=True))
    w = torch.randn(6, 4, 2, 2, requires_grad=True)
    check(lambda t, w: F.conv_transpose2d(t, w, stride=2), x, w)
    check(lambda t, w: F.conv_transpose2d(t, w, stride=2, output_padding=1), x, w)
    ops = onnx_ops_of(lambda t, w: F.conv2d(t, w, stride=2).square(), x, torch.randn(4, 6, 2, 2, requires_grad=True),
                      folder=tmp_path, models="*backward*", pointwise_kernels=False)
    assert "MatMul" in ops and "Conv" not in ops, ops  # the input's gradient is a ConvTranspose


def test_a_1x1_convolutions_gradients_are_products_with_no_transposed_activation(tmp_path):
    """A 1x1 convolution (MobileNet's, ResNet's bottlenecks) has as weight gradient each image's
    output gradient times its input, summed; as patches that was a 6-axis Transpose of the input
    and one of the gradient (layer_ops pointwise_conv: 1.01 times eager). Where the per-image
    products would outgrow the operands, one product of the two with batch and channels swapped.
    Its input gradient is the 1x1 convolution by the transposed weight, not ORT's ConvTranspose.
    Eager's gradients, 1-, 2- and 3-D, with and without bias, and a 1x1 ConvTranspose2d's."""
    torch.manual_seed(0)
    x = torch.randn(3, 6, 5, 7, requires_grad=True)
    check(lambda t, w, b: F.conv2d(t, w, b), x, torch.randn(4, 6, 1, 1, requires_grad=True),
          torch.randn(4, requires_grad=True))
    check(lambda t, w: F.conv2d(t, w), x[:, :, :1, :2], torch.randn(40, 6, 1, 1, requires_grad=True))  # 2 pixels
    check(lambda t, w: F.conv1d(t, w), x[:, :, 0], torch.randn(5, 6, 1, requires_grad=True))
    check(lambda t, w: F.conv3d(t, w), x.unsqueeze(2), torch.randn(2, 6, 1, 1, 1, requires_grad=True))
    check(lambda t, w: F.conv_transpose2d(t, w), x, torch.randn(6, 3, 1, 1, requires_grad=True))
    ops = onnx_ops_of(lambda t, w: F.conv2d(t, w).square(), x, torch.randn(4, 6, 1, 1, requires_grad=True),
                      folder=tmp_path, models="*backward*", pointwise_kernels=False)
    assert "ConvTranspose" not in ops and "Conv" in ops and "MatMul" in ops, ops
    import glob

    import onnx

    backward = onnx.load(glob.glob(str(tmp_path / "*backward*.onnx"))[0]).graph
    read_by = {name: node.op_type for node in backward.node for name in node.input}
    for node in backward.node:  # the weight's (for the input gradient) and one ORT folds into its MatMul
        if node.op_type == "Transpose":
            perm = list(node.attribute[0].ints)
            assert perm == [1, 0, 2, 3] or (perm == [0, 2, 1] and read_by[node.output[0]] == "MatMul"), perm


@pytest.mark.parametrize("stride", [1, 2])
def test_a_1x1_convolutions_weight_gradient_is_a_product_with_dynamic_sizes_too(tmp_path, stride):
    # SegFormer's fuse and classifier layers, and ResNet's strided shortcuts, under
    # dynamic=True: the weight gradient was ORT's Conv with the whole output gradient as its
    # kernel (SegFormer: 3.9 ms of a 27 ms step; layer_ops --dynamic shortcut_conv 2.3x eager).
    import copy
    import glob

    import onnx

    torch.manual_seed(0)
    eager = torch.nn.Conv2d(6, 4, 1, stride=stride, bias=False)  # a layer's weight: static sizes
    layer = copy.deepcopy(eager)
    ort_dynamo.reset()
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: layer(t).square(), backend="ort", dynamic=True,
                             options={"save_onnx": True, "save_path": str(tmp_path), "pointwise_kernels": False})
    for size in (9, 12):
        x = torch.randn(3, 6, size, size, requires_grad=True)
        got, got_grads = _outputs_and_grads(compiled, (x,))
        want, want_grads = _outputs_and_grads(lambda t: eager(t).square(), (x,))
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(got_grads, want_grads, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(layer.weight.grad, eager.weight.grad, rtol=1e-4, atol=1e-4)
        layer.weight.grad = eager.weight.grad = None
    assert ort_dynamo.report().exports == 2 and ort_dynamo.report().fallback_nodes == 0, ort_dynamo.report()
    backward = [n.op_type for n in onnx.load(glob.glob(str(tmp_path / "*backward*.onnx"))[0]).graph.node]
    convolutions = backward.count("Conv") + backward.count("ConvTranspose")
    assert convolutions == 1 and "MatMul" in backward, backward  # the input's gradient


def test_a_strided_1x1_convolutions_weight_gradient_is_a_product_over_the_pixels_it_reads(tmp_path):
    """A 1x1 convolution with stride (ResNet's shortcuts) reads every stride-th pixel. As the
    correlation of the input with the output's gradient its weight gradient computed stride²
    taps and kept one (layer_ops shortcut_conv: 2.0-2.3 times eager); now it is the 1x1
    convolution's product over those pixels. Eager's gradients, strides per axis, 1-D."""
    torch.manual_seed(0)
    x = torch.randn(2, 6, 9, 8, requires_grad=True)
    check(lambda t, w: F.conv2d(t, w, stride=2), x, torch.randn(4, 6, 1, 1, requires_grad=True))
    check(lambda t, w, b: F.conv2d(t, w, b, stride=(3, 2)), x, torch.randn(40, 6, 1, 1, requires_grad=True),
          torch.randn(40, requires_grad=True))
    check(lambda t, w: F.conv1d(t, w, stride=4), x[:, :, 0], torch.randn(5, 6, 1, requires_grad=True))
    ops = onnx_ops_of(lambda t, w: F.conv2d(t, w, stride=2), x, torch.randn(4, 6, 1, 1, requires_grad=True),
                      folder=tmp_path, models="*backward*", pointwise_kernels=False)
    assert "Conv" not in ops and "MatMul" in ops, ops  # the input's gradient is a ConvTranspose


@pytest.mark.parametrize("turns", [1, 3])
def test_a_convolutions_weight_gradient_is_one_product_of_its_input_columns(tmp_path, monkeypatch, turns):
    """The weight gradient of a one-group convolution with fewer than 32 taps (3x3, 5x5, 1-D
    kernels) is the output gradient times the input's columns, one column per tap: as the
    input's convolution by the gradient its kernel was the whole output, which ORT ran as a
    product 9 columns wide (layer_ops conv3x3: 2.3 -> 1.4 times eager). Padding, stride,
    dilation, 1-, 2- and 3-D, a 3x3 ConvTranspose2d's; ``turns``: the input channels taken in
    turns (``_COLUMN_BYTES``), each turn its own product. Eager's gradients; the backward has
    no convolution but the input gradient's."""
    from ort_dynamo import decompositions

    if turns > 1:  # a budget of one channel's columns: one product per channel
        monkeypatch.setattr(decompositions, "_COLUMN_BYTES", 2 * 9 * 9 * 10 * 4)
    torch.manual_seed(0)
    x = torch.randn(2, 6, 9, 10, requires_grad=True)
    check(lambda t, w, b: F.conv2d(t, w, b, padding=1), x, torch.randn(4, 6, 3, 3, requires_grad=True),
          torch.randn(4, requires_grad=True))
    check(lambda t, w: F.conv2d(t, w, stride=2, padding=(2, 1), dilation=(2, 1)), x,
          torch.randn(5, 6, 3, 2, requires_grad=True))
    check(lambda t, w: F.conv1d(t, w, stride=3, padding=2), x[:, :, 0], torch.randn(5, 6, 5, requires_grad=True))
    check(lambda t, w: F.conv3d(t, w, padding=1), x[:, :3].unsqueeze(2).expand(2, 3, 3, 9, 10),
          torch.randn(4, 3, 3, 3, 3, requires_grad=True))
    check(lambda t, w: F.conv_transpose2d(t, w, stride=2, padding=1, output_padding=1), x,
          torch.randn(6, 4, 3, 3, requires_grad=True))
    ops = onnx_ops_of(lambda t, w: F.conv2d(t, w, padding=1).square(), x, torch.randn(4, 6, 3, 3, requires_grad=True),
                      folder=tmp_path, models="*backward*", pointwise_kernels=False)
    assert "Conv" not in ops and "ConvTranspose" in ops and "MatMul" in ops, ops


def test_a_stems_weight_gradient_with_many_taps_stays_a_convolution(tmp_path):
    """A 7x7 stem (49 taps, 3 input channels): as a convolution of the input by the gradient
    its product is already 49 columns wide and needs no Concat of columns (layer_ops stem_conv:
    0.73 times eager that way, 0.95 as columns)."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 20, 20, requires_grad=True)
    check(lambda t, w: F.conv2d(t, w, stride=2, padding=3), x, torch.randn(4, 3, 7, 7, requires_grad=True))
    ops = onnx_ops_of(lambda t, w: F.conv2d(t, w, stride=2, padding=3).square(), x,
                      torch.randn(4, 3, 7, 7, requires_grad=True), folder=tmp_path, models="*backward*",
                      pointwise_kernels=False)
    assert "Conv" in ops and "Concat" not in ops, ops


class _LayerNorm2d(torch.nn.LayerNorm):
    """timm's LayerNorm2d: a LayerNorm over the channels of an NCHW tensor."""

    def forward(self, x):
        return F.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias, self.eps).permute(0, 3, 1, 2)


def test_layer_norm_over_channels_between_permutes_is_computed_in_place(tmp_path):
    """timm's LayerNorm2d (ConvNeXt's stem and downsampling norms) permutes NCHW to NHWC, normalizes
    the channels and permutes back: two Transposes forward, and kernels that read the gradient
    through transposes backward (layer_ops channels_last_norm: 1.34 times eager). It is computed in
    x's layout, the channels a reduction over dim 1 (0.77). Eager's values and gradients for
    input, weight and bias; other permutes keep the LayerNorm."""
    torch.manual_seed(0)
    norm = _LayerNorm2d(6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 2.0)
        norm.bias.normal_()
    x = torch.randn(2, 6, 5, 7, requires_grad=True) * 3 + 1
    check(lambda t, w, b: F.layer_norm(t.permute(0, 2, 3, 1), (6,), w, b, 1e-6).permute(0, 3, 1, 2), x,
          norm.weight.detach().clone().requires_grad_(True), norm.bias.detach().clone().requires_grad_(True))
    check(lambda t: F.layer_norm(t.permute(0, 2, 1), (6,)).permute(0, 2, 1), x[:, :, 0])  # 1-D, no affine
    check(lambda t: F.layer_norm(t.permute(0, 3, 2, 1), (6,)).permute(0, 3, 2, 1), x)  # W and H swap too: kept
    ops = onnx_ops_of(norm, x, folder=tmp_path, pointwise_kernels=False)
    assert "Transpose" not in ops and "LayerNormalization" not in ops, ops


def test_linear_upsampling_backward_of_any_scale_is_a_product_with_its_weights(tmp_path):
    """Linear upsampling whose backward is no whole-number pattern (align_corners, other
    scales) took an index_add per dim: ScatterElements, on one thread (layer_ops
    upsample_bilinear_ac: 2.06 times eager). Up to 256 inputs along a dim, it is one MatMul with
    the (out, in) weights instead (0.46); longer dims keep the scatter. Whole-number scales take
    the product up to 64 inputs (faster there than their phases). Eager's gradients, float32
    and float64, 1-, 2- and 3-D."""
    x = torch.randn(2, 3, 7, 9, requires_grad=True)
    check(lambda t: F.interpolate(t, scale_factor=2, mode="bilinear", align_corners=True), x)
    check(lambda t: F.interpolate(t, size=(10, 5), mode="bilinear"), x)
    check(lambda t: F.interpolate(t, size=(13,), mode="linear", align_corners=True), x[0])
    check(lambda t: F.interpolate(t, scale_factor=1.7, mode="trilinear"), x[:1].unsqueeze(1))
    check(lambda t: F.interpolate(t, size=(11, 6), mode="bilinear", align_corners=True), x.double())
    small = onnx_ops_of(lambda t: F.interpolate(t, scale_factor=2, mode="bilinear", align_corners=True), x,
                        folder=tmp_path / "small", models="*backward*", pointwise_kernels=False)
    assert "MatMul" in small and "ScatterElements" not in small, small
    wide = torch.randn(1, 2, 2, 300, requires_grad=True)
    # (ORT's Resize computes align_corners' positions in another float32 order: 1.5e-5 apart here)
    check(lambda t: F.interpolate(t, size=(3, 310), mode="bilinear", align_corners=True), wide, atol=1e-4)
    ops = onnx_ops_of(lambda t: F.interpolate(t, size=(3, 310), mode="bilinear", align_corners=True), wide,
                      folder=tmp_path / "wide", models="*backward*", pointwise_kernels=False)
    assert "ScatterElements" in ops and "MatMul" in ops, ops  # the width's scatter, the height's product
    # Whole-number scales: the product up to 64 inputs, the phases' sums (one Split) beyond.
    tall = torch.randn(1, 2, 70, 3, requires_grad=True)
    check(lambda t: F.interpolate(t, scale_factor=2, mode="bilinear"), tall)
    ops = onnx_ops_of(lambda t: F.interpolate(t, scale_factor=2, mode="bilinear"), tall, folder=tmp_path / "tall",
                      models="*backward*", pointwise_kernels=False)
    assert "Split" in ops and "MatMul" in ops and "ScatterElements" not in ops, ops


def test_unfold_into_patches_is_strided_slices_stacked(tmp_path):
    """F.unfold (im2col): torchlib gathers each window's elements with an int64 index, along the
    innermost axis too (layer_ops im2col: 1.63 times eager, 17.7 ms of 26 in one Gather). The
    patches are kernel-many strided slices of the padded input, stacked (0.51). Eager's values
    and gradients (F.fold, ORT's Col2Im) for kernels, dilation, padding, stride, unbatched
    (unbatched F.fold and F.unfold's gradient used to fall back: Col2Im needs a batch)."""
    x = torch.randn(2, 3, 9, 11, requires_grad=True)
    check(lambda t: F.unfold(t, 3, padding=1), x)
    check(lambda t: F.unfold(t, (2, 3), dilation=(2, 1), padding=(1, 0), stride=(2, 3)), x)
    check(lambda t: F.unfold(t, 2, stride=2), x[0])  # its gradient an unbatched Col2Im, which ONNX's is not
    check(lambda t: F.fold(t, (6, 7), 3, padding=1, stride=(1, 2)), torch.randn(27, 24, requires_grad=True))
    for dynamic in (False, True):  # symbolic sizes too, where a window is sure to fit (layer_ops --dynamic: 1.19)
        ops = onnx_ops_of(lambda t: F.unfold(t, 3, padding=1), x, folder=tmp_path / str(dynamic),
                          models="*forward*", dynamic=dynamic, pointwise_kernels=False)
        assert not {op for op in ops if op.startswith(("Gather", "Scatter"))}, (dynamic, ops)


@pytest.mark.parametrize("dynamic", [False, True])
def test_bfloat16_windows_that_read_past_the_end_run_on_ort(dynamic):
    """``Tensor.unfold`` pads the input where its windows' blocks read past the end. On CPU a
    bfloat16 Pad computes in float32, and its result, inlined from the lowering without a type,
    was never rounded back: ORT refused the model ("Type (tensor(bfloat16)) of output arg
    (unfold) ... does not match") and the partition fell back."""
    ort_dynamo.reset()
    torch._dynamo.reset()
    unfold = lambda t: t.unfold(-1, 3, 2).float().square()  # noqa: E731
    compiled = torch.compile(unfold, backend="ort", dynamic=dynamic)
    for length in (13, 17):  # 13: 6 windows, and rows of 2 up to 14
        x = torch.randn(2, 3, length, dtype=torch.bfloat16, requires_grad=True)
        got, got_grads = _outputs_and_grads(compiled, (x,))
        want, want_grads = _outputs_and_grads(unfold, (x,))
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(got_grads, want_grads)
    assert ort_dynamo.report().fallback_nodes == 0, ort_dynamo.report().fallbacks


def test_a_spectrograms_magnitude_runs_on_ort_in_real_arithmetic(tmp_path):
    """ORT has no complex tensors, so torch.stft and its abs stayed in PyTorch (14 nodes for a
    power spectrogram). When every use of a complex STFT is ``.abs()`` (a magnitude or power
    spectrogram, torchaudio's Spectrogram), it is frames times the DFT's cosine and sine bases.
    Eager's values and gradients, a silent stretch included (magnitude zero: gradient zero, not
    NaN); windows shorter than n_fft, no centring, two-sided, normalized. An STFT used otherwise
    stays in PyTorch, with eager's result."""
    x = torch.randn(2, 1000, requires_grad=True)
    with torch.no_grad():
        x[:, 100:300] = 0.0
    window = torch.hann_window(48)
    check(lambda t: torch.stft(t, 64, 16, win_length=48, window=window, return_complex=True).abs().pow(2), x, atol=1e-4)
    check(lambda t: torch.stft(t, 32, return_complex=True, center=False, normalized=True).abs(), x[0], atol=1e-4)
    check(lambda t: torch.stft(t, 32, 8, return_complex=True, onesided=False, pad_mode="constant").abs(), x, atol=1e-4)
    def magnitude_twice(t):  # two uses of one STFT's abs
        spectrum = torch.stft(t, 64, 16, return_complex=True)
        return spectrum.abs() + spectrum.abs().square()

    check(magnitude_twice, x, atol=1e-4)
    grads = run_on_ort(lambda t: torch.stft(t, 64, 16, return_complex=True).abs(), x)[1]
    assert not grads[0].isnan().any()
    ort_dynamo.reset()
    torch._dynamo.reset()
    phase = lambda t: torch.stft(t, 64, 16, return_complex=True).angle()  # noqa: E731
    torch.testing.assert_close(torch.compile(phase, backend="ort")(x), phase(x))
    assert ort_dynamo.report().fallback_nodes > 0


def test_convolution_parameters_given_once_for_every_dim_train_like_eager():
    """``padding="valid"`` reaches the graph as ``padding=[0]``, one value for every spatial dim
    (EfficientNet's strided depthwise convolutions); the gradients' decomposition read one
    value per dim and failed to compile."""
    x = torch.randn(2, 4, 9, 10, requires_grad=True)
    check(lambda t, w: F.conv2d(t, w, stride=2, padding="valid", groups=4), x, torch.randn(4, 1, 3, 3, requires_grad=True))
    check(lambda t, w: F.conv2d(t, w, stride=(2, 3), padding="valid"), x, torch.randn(5, 4, 3, 2, requires_grad=True))
    check(lambda t, w: F.conv1d(t, w, padding="same", dilation=2), x[0], torch.randn(3, 9, 3, requires_grad=True))


def test_average_pooling_with_one_window_larger_than_its_input_stays_input_sized(tmp_path):
    """HF EfficientNet pools with a kernel of its hidden size (320) over a 2 x 2 map in ceil mode:
    one window, clipped to the input. The gradient spread the window's kernel-sized ones over every
    plane (a 320 x 320 ConvTranspose per channel, nine times eager's whole step); it needs no more
    than the padded input, and a window over all of it spreads its gradient by a broadcast. Eager's
    values and gradients, with and without padding counted."""
    import glob

    import onnx

    x = torch.randn(2, 3, 2, 3, requires_grad=True)
    check(lambda t: F.avg_pool2d(t, 40, ceil_mode=True).sin(), x)
    check(lambda t: F.avg_pool2d(t, (40, 2), padding=(1, 1), ceil_mode=True).sin(), x)
    check(lambda t: F.avg_pool2d(t, 6, padding=3, ceil_mode=True, count_include_pad=False).sin(), x)
    check(lambda t: F.avg_pool2d(t, (3, 50), ceil_mode=True, divisor_override=7).sin(), x)
    check(lambda t: F.avg_pool1d(t[0], 50, ceil_mode=True).sin(), x)
    ops = onnx_ops_of(lambda t: F.avg_pool2d(t, 320, ceil_mode=True), x, folder=tmp_path, models="*backward*",
                      pointwise_kernels=False)
    assert "ConvTranspose" not in ops, ops  # one window over everything: its gradient is a broadcast
    for path in glob.glob(str(tmp_path / "*backward*.onnx")):
        inferred = onnx.shape_inference.infer_shapes(onnx.load(path), data_prop=True)
        for value in inferred.graph.value_info:
            dims = [d.dim_value for d in value.type.tensor_type.shape.dim]
            assert all(dims) and math.prod(dims) <= x.numel(), (value.name, dims)


@pytest.mark.parametrize("dim", [0, 2])
def test_weight_norm_trains_on_ort_like_eager(dim):
    """torch.nn.utils weight_norm (wav2vec2's positional convolution normalizes over dim 2):
    torchlib lowers its forward but not ``_weight_norm_interface_backward``, which fell back."""
    conv = torch.nn.Conv1d(4, 6, 3)
    v = conv.weight.detach().clone().requires_grad_()
    g = torch.linalg.vector_norm(v, dim=[d for d in range(3) if d != dim], keepdim=True).detach().mul(1.5).requires_grad_()
    x = torch.randn(2, 4, 9, requires_grad=True)
    check(lambda t, v, g: F.conv1d(t, torch._weight_norm(v, g, dim)).sin(), x, v, g)


def test_transformers_grouped_expert_products_run_on_ort():
    """transformers' mixture-of-experts layers (Mixtral, Qwen-MoE) multiply each expert's rows by
    its weight through ``transformers::grouped_mm_fallback`` on CPU: a Python loop behind a custom
    op, which stayed in PyTorch with its backward (8 fallback nodes in Mixtral). Each expert is
    now a Slice and a MatMul. An expert without rows, and rows past the last offset (zeros):
    eager's values and gradients."""
    pytest.importorskip("transformers.integrations.moe")
    grouped_mm = torch.ops.transformers.grouped_mm_fallback
    x = torch.randn(10, 6, requires_grad=True)
    w = torch.randn(4, 6, 5, requires_grad=True)
    for offs in ([3, 3, 7, 9], [0, 10, 10, 10], [2, 4, 6, 10]):
        check(lambda t, v, ends: grouped_mm(t, v, ends).sin(), x, w, torch.tensor(offs, dtype=torch.int32))


def test_a_library_imported_after_the_first_compile_still_gets_its_lowerings():
    """Other libraries' ops exist only once the library is imported; the registry is built at
    the first compile. A process that compiles before importing transformers' MoE code must
    still lower its grouped products."""
    import subprocess
    import sys

    pytest.importorskip("transformers.integrations.moe")
    script = """
import torch, ort_dynamo
torch.compile(lambda t: t.sin(), backend="ort")(torch.randn(4))
import transformers.integrations.moe
x, w = torch.randn(6, 3), torch.randn(2, 3, 4)
got = torch.compile(lambda a, b, c: torch.ops.transformers.grouped_mm_fallback(a, b, c), backend="ort")(
    x, w, torch.tensor([2, 6], dtype=torch.int32))
torch.testing.assert_close(got, torch.cat([x[:2] @ w[0], x[2:] @ w[1]]))
print(ort_dynamo.report().fallback_nodes)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-1] == "0", result.stdout


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fake_quantization_for_quantization_aware_training_is_eagers_to_the_bit(dtype):
    # Values on rounding ties and outside the range: round half to even on x * (1 / scale),
    # as ATen does (QuantizeLinear divides, and rounds some of these the other way), and a
    # gradient that passes only where no clamp was needed.
    scale, zero_point = torch.tensor([0.05]), torch.tensor([3], dtype=torch.int32)
    channel_scale = torch.linspace(0.01, 0.1, 16)
    int_zeros, float_zeros = torch.arange(-8, 8, dtype=torch.int32), torch.linspace(-4.3, 3.9, 16)
    on, off = torch.tensor([1]), torch.tensor([0])
    fake_quantizers = [
        lambda x: torch.fake_quantize_per_tensor_affine(x, 0.05, 3, -20, 20),
        lambda x: torch.fake_quantize_per_tensor_affine(x, scale, zero_point, 0, 15),
        lambda x: torch._fake_quantize_per_tensor_affine_cachemask_tensor_qparams(x, scale, zero_point, on,
                                                                                  -8, 7)[0],
        lambda x: torch._fake_quantize_per_tensor_affine_cachemask_tensor_qparams(x, scale, zero_point, off,
                                                                                  -8, 7)[0],
        lambda x: torch.fake_quantize_per_channel_affine(x, channel_scale, int_zeros, 1, -128, 127),
        lambda x: torch.fake_quantize_per_channel_affine(x, channel_scale, float_zeros, 1, -10, 10),
    ]
    x = torch.randn(64, 16) * 0.7
    x[:16] = (torch.arange(-128, 128).reshape(16, 16) + 0.5) * 0.05  # ties at scale 0.05
    x = x.to(dtype).requires_grad_()
    for fake_quantized in fake_quantizers:
        (out,), (grad,) = run_on_ort(fake_quantized, x)
        (expected_out,), (expected_grad,) = _outputs_and_grads(fake_quantized, (x,))
        assert torch.equal(out, expected_out)
        assert torch.equal(grad, expected_grad)


def test_embedding_gradient_scaled_by_frequency_runs_on_ort():
    weight = torch.randn(10, 4, requires_grad=True)
    ids = torch.tensor([[1, 1, 1, 2], [0, 2, 5, 1]])  # repeats, and the padding id
    check(lambda w, i: F.embedding(i, w, padding_idx=0, scale_grad_by_freq=True) * 2.0, weight, ids)


def test_an_index_put_over_every_dim_exports_without_onnx_irs_empty_attribute_warning(caplog):
    # torchlib builds it with Constant(value_ints=[]), on which onnx_ir warned in every run.
    x, index, values = torch.zeros(6), torch.tensor([4, 1]), torch.tensor([2.0, 3.0], requires_grad=True)
    with caplog.at_level(logging.WARNING):
        check(lambda v: x.index_put((index,), v) * 2, values)
    assert not [r for r in caplog.records if "ambiguous" in r.getMessage()]


@pytest.mark.parametrize("mode", ["nearest", "bilinear"])
def test_upsampling_to_a_size_read_off_a_tensor_compiles_with_dynamic_sizes(mode, tmp_path):
    # SegFormer's decoder: F.interpolate(x, size=skip.shape[2:]). With dynamic=True that size
    # is symbolic, and ATen's C++ kernel of the .vec overload, which AOTAutograd traced while
    # torch's Python one was set aside, raised "expected to contain only concrete integers".
    # A ratio of two (a guard keeps it) is a Resize, and its backward sums: no index-driven ops.
    import glob

    import onnx

    def upsampled(x, skip):
        kwargs = {} if mode == "nearest" else {"align_corners": False}
        return torch.nn.functional.interpolate(x, size=skip.shape[2:], mode=mode, **kwargs) * skip

    ort_dynamo.reset()
    torch._dynamo.reset()
    options = {"save_onnx": True, "save_path": str(tmp_path)}
    compiled = torch.compile(upsampled, backend="ort", dynamic=True, options=options)
    for size in (4, 5):
        x, skip = torch.randn(2, 3, size, size, requires_grad=True), torch.randn(2, 3, 2 * size, 2 * size)
        got, got_grads = _outputs_and_grads(compiled, (x, skip))
        want, want_grads = _outputs_and_grads(upsampled, (x, skip))
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(got_grads, want_grads)
    report = ort_dynamo.report()
    assert report.fallback_nodes == 0 and len(report.graphs) == 2, report  # both sizes: one forward, one backward
    ops = {node.op_type for path in glob.glob(str(tmp_path / "*.onnx")) for node in onnx.load(path).graph.node}
    assert "Resize" in ops and not ops & {"GatherElements", "ScatterElements", "GatherND", "ScatterND"}, ops


def test_upsampling_back_to_the_size_a_strided_convolution_came_from_trains_with_dynamic_sizes():
    # SegFormer's head: logits of the stride-4 stage upsampled to the image. The ratio is
    # s // ((s - 1) // 4 + 1), which no guard simplifies to 4: the backward's per-phase split
    # had a last part of size "ratio - 3", whose squeeze torch did and the ONNX graph did not.
    def segmented(conv, image):
        return torch.nn.functional.interpolate(conv(image), size=image.shape[2:], mode="bilinear",
                                               align_corners=False)

    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 5, 7, stride=4, padding=3)
    ort_dynamo.reset()
    torch._dynamo.reset()
    compiled = torch.compile(segmented, backend="ort", dynamic=True)
    for size in (32, 48):
        image = torch.randn(2, 3, size, size, requires_grad=True)
        got, got_grads = _outputs_and_grads(lambda x: compiled(conv, x), (image,))
        want, want_grads = _outputs_and_grads(lambda x: segmented(conv, x), (image,))
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(got_grads, want_grads, rtol=1e-4, atol=1e-5)
    report = ort_dynamo.report()
    assert report.fallback_nodes == 0 and len(report.graphs) == 2, report


def test_a_squeeze_of_a_size_that_is_one_only_by_a_guard_takes_the_dim_out_on_ort():
    # x.shape[-1] // 8 is symbolic under dynamic=True; torch squeezes it where it is 1 (and
    # guards that it stays 1). The ONNX graph must drop the dim too, or ranks disagree.
    def squeezed(x):
        return x.narrow(-1, 0, x.shape[-1] // 8).squeeze(-1) * x.sum(-1)

    ort_dynamo.reset()
    torch._dynamo.reset()
    compiled = torch.compile(squeezed, backend="ort", dynamic=True)
    for size in (12, 13):
        x = torch.randn(3, size, requires_grad=True)
        got, got_grads = _outputs_and_grads(compiled, (x,))
        want, want_grads = _outputs_and_grads(squeezed, (x,))
        assert got[0].shape == want[0].shape == (3,)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(got_grads, want_grads)
    report = ort_dynamo.report()
    assert report.fallback_nodes == 0 and report.ort_nodes > 0 and len(report.graphs) == 2, report


@pytest.mark.parametrize("pool", [
    torch.nn.AvgPool2d(320, ceil_mode=True),  # HF EfficientNet's pooler: a kernel of its width
    torch.nn.AvgPool2d(5, padding=2, ceil_mode=True, count_include_pad=False),  # one window up to 3 x 3
    torch.nn.AvgPool2d(7, ceil_mode=True, divisor_override=3),
], ids=["wider_than_the_map", "padding_not_counted", "divisor_override"])
def test_one_pooling_window_per_plane_of_dynamic_size_has_a_gradient_without_convolutions(tmp_path, pool):
    """With a static size the kernel shrinks to the input; a symbolic one cannot, and the
    backward counted the window with a 320 x 320 convolution over padded ones, or spread the
    gradient with a ConvTranspose of that kernel (EfficientNet under dynamic=True: 2.5x eager's
    step). Now a mask over the window and its count."""
    import glob

    import onnx

    ort_dynamo.reset()
    torch._dynamo.reset()
    options = {"save_onnx": True, "save_path": str(tmp_path)}
    compiled = torch.compile(pool, backend="ort", dynamic=True, options=options)
    for size in (2, 3):
        x = torch.randn(2, 3, size, size, requires_grad=True)
        got, got_grads = _outputs_and_grads(compiled, (x,))
        want, want_grads = _outputs_and_grads(pool, (x,))
        assert want[0].shape[-2:] == (1, 1)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(got_grads, want_grads)
    assert ort_dynamo.report().fallback_nodes == 0
    ops = {node.op_type for path in glob.glob(str(tmp_path / "*backward*.onnx")) for node in onnx.load(path).graph.node}
    assert ops and not ops & {"Conv", "ConvTranspose"}, ops  # no convolution over a padded window
