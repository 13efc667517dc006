"""Corner cases of the FX -> ONNX -> ORT path: each runs fully on ORT with eager's values and
gradients (empty tensors, squeezes of non-1 dims, -0.0, negative padding, large output_padding)."""

import pytest
import torch
import torch.nn.functional as F

import ort_dynamo


def _check(fn, *inputs, grad=True):
    """``fn`` compiled (no fallback allowed) against eager: outputs and input gradients."""
    def run(f):
        args = [x.detach().clone().requires_grad_(grad and x.is_floating_point()) for x in inputs]
        out = f(*args)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        wrt = [a for a in args if a.requires_grad]
        grads = []
        if wrt:
            gen = torch.Generator().manual_seed(0)
            loss = sum((o * torch.rand(o.shape, generator=gen)).sum() for o in outs
                       if o.is_floating_point() and o.requires_grad)
            grads = torch.autograd.grad(loss, wrt, allow_unused=True) if torch.is_tensor(loss) else []
        return outs, grads

    ort_dynamo.reset()
    compiled = torch.compile(fn, backend="ort", dynamic=False, options={"fallback_policy": "DISABLE"})
    expected, expected_grads = run(fn)
    actual, actual_grads = run(compiled)
    for e, a in zip(expected, actual):
        assert a.shape == e.shape and a.dtype == e.dtype
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5, equal_nan=True)
        if e.is_floating_point():  # the sign of zeros too (a NaN's sign is the CPU's choice)
            numbers = ~torch.isnan(e)
            assert torch.equal(torch.signbit(a[numbers]), torch.signbit(e[numbers]))
    for e, a in zip(expected_grads, actual_grads):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)
    assert ort_dynamo.report().fallback_nodes == 0


def test_block_diag_of_vectors_squeezes_only_size_one_dims():
    # Its backward squeezes dim -1 of (1, 3) slices: a no-op in torch, an error in ONNX Squeeze.
    _check(torch.block_diag, torch.randn(1), torch.randn(2), torch.randn(3))


def test_squeeze_dims_mixed_sizes():
    _check(lambda x: torch.squeeze(x * 2, (0, 1, 3)), torch.randn(1, 4, 1, 3))


def test_copysign_and_signbit_see_negative_zero():
    x = torch.tensor([1.5, -2.0, 3.0, -4.0, 0.0, -0.0])
    y = torch.tensor([-0.0, 0.0, -1.0, 2.0, -0.0, 1.0])
    _check(torch.copysign, x, y)
    _check(lambda a: torch.copysign(a, -0.0), x)
    _check(lambda a: torch.signbit(a * 1.0), y, grad=False)


@pytest.mark.parametrize("padding, output_padding", [((1, 2), (2, 3)), (0, 2)])
def test_conv_transpose_output_padding_not_below_stride(padding, output_padding):
    # torch allows output_padding < max(stride, dilation); ORT's ConvTranspose only < stride.
    x, w, b = torch.randn(2, 2, 4, 4), torch.randn(2, 2, 4, 5), torch.randn(4)
    _check(lambda x, w, b: F.conv_transpose2d(x, w, b, stride=(3, 2), padding=padding,
                                              output_padding=output_padding, groups=2, dilation=4),
           x, w, b)


def test_conv_transpose3d_output_padding_not_below_stride():
    x, w = torch.randn(1, 2, 3, 3, 3), torch.randn(2, 1, 2, 2, 2)
    _check(lambda x, w: F.conv_transpose3d(x, w, stride=2, padding=1, output_padding=2, dilation=3),
           x, w)


def test_amin_amax_over_all_dims():
    # FX drops ``dim=[]`` (its default); torchlib's amin/amax require it.
    _check(torch.aminmax, torch.randn(3, 4, 5))
    _check(lambda x: torch.amax(x) - torch.amin(x), torch.randn(3, 4))


def test_empty_tensors():
    _check(lambda x: F.adaptive_avg_pool3d(x, (5, 7, 4)), torch.randn(0, 2, 8, 8, 8))
    _check(lambda x: F.pixel_shuffle(x, 1), torch.randn(1, 0, 1, 1))
    _check(lambda x: F.pixel_unshuffle(x, 1), torch.randn(1, 0, 1, 1))  # eager's backward fails for 2
    _check(lambda x: F.unfold(x, 2, dilation=2), torch.randn(0, 1, 5, 5))


def test_reduction_over_an_empty_dim():
    # ORT keeps the (empty) axis of ReduceSum(axes=[-1]) on an empty input: axes made non-negative.
    _check(lambda x: (x.sum(-1) + 1, x.mean(0) * 2, x.sum((-2, -1), keepdim=True)), torch.randn(3, 0))
    # Reductions of nothing: torch's values, not ORT's (ReduceMean of nothing is 0 there).
    _check(lambda x: (x.mean(-1), x.var(1), x.std(), (x > 0).any(-1), (x > 0).all(1)), torch.randn(3, 0))


def test_replicate_pad_with_negative_padding():
    _check(lambda x: F.pad(x, (-4, 5, 0, 0), mode="replicate"), torch.randn(2, 3, 4, 4))
    _check(lambda x: F.pad(x, (5, -4, -4, 3), mode="replicate"), torch.randn(2, 3, 4, 4))
    _check(lambda x: F.pad(x, (-1, 2), mode="replicate"), torch.randn(2, 3, 4))


def test_batch_norm_inference_saves_empty_statistics():
    mean, var = torch.randn(2), torch.rand(2)
    _check(lambda x, w, b: torch.native_batch_norm(x, w, b, mean, var, False, 0.1, 1e-5),
           torch.randn(3, 2, 4), torch.randn(2), torch.randn(2))


NAN = float("nan")
_WITH_NANS = torch.tensor([[1.0, NAN, 3.0, -2.0], [4.0, 2.0, 9.0, 1.0], [NAN, NAN, 0.5, NAN], [-1.0, -2.0, float("inf"), NAN]])


def test_argmax_and_argmin_point_at_the_first_nan():
    # ORT's ArgMax/ArgMin skip NaN; torch treats NaN as the extreme, as max/min do.
    _check(lambda x: (x.argmax(-1), x.argmin(-1), x.argmax(0), x.argmin(), x.max(-1).indices, x.min(0).indices),
           _WITH_NANS, grad=False)


def test_sorts_order_nan_above_infinity():
    # ORT's TopK misplaces NaN; torch sorts it as the largest value (ties keep their order).
    _check(lambda x: (*x.sort(dim=-1, stable=True), *x.sort(dim=-1, descending=True, stable=True),
                      x.argsort(dim=-1, stable=True), torch.msort(x)), _WITH_NANS, grad=False)
    _check(lambda x: (*x.topk(1, -1), *x.topk(2, 0, largest=False)), torch.tensor([[NAN, 2.0, 3.0], [1.0, 0.0, -1.0]]),
           grad=False)


def test_cumulative_max_and_min_index_the_last_nan():
    _check(lambda x: (*x.cummax(-1), *x.cummin(0)), _WITH_NANS, grad=False)


def test_sign_and_heaviside_of_nan_and_negative_zero():
    x = torch.tensor([NAN, -0.0, 0.0, 2.0, -3.0, float("-inf")])
    _check(lambda x: (x.sign(), x.sgn(), torch.heaviside(x, torch.full_like(x, 0.5))), x, grad=False)
