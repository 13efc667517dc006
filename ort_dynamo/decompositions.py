"""Our decompositions: ops torch has no (ONNX-friendly) decomposition for, written in ops
torchlib lowers. Used by ``lower.decomposition_table``; one function per op, each small."""

from __future__ import annotations

import functools
import itertools
import math
import operator
import struct

import torch
from torch._decomp import decomposition_table as _torch_decompositions

aten = torch.ops.aten

__all__ = ["own_decompositions", "pointwise_decompositions", "product_decompositions", "size_hint"]


# ---- decompositions torch lacks -------------------------------------------------------------


def _conv_weight_grad(inp, grad_out, weight_shape, stride, padding, dilation, groups, own_product=False):
    """dL/dW of a (non-transposed) convolution, as one grouped convolution. ``own_product``
    (CPU, kernels with products of their own): a one-group one stays that Conv, which
    csrc/conv_weight_grad.h computes as one product reading its columns from the input."""
    kernel = list(weight_shape[2:])
    if groups == 1 and list(stride) == kernel and not any(padding) and all(d == 1 for d in dilation):
        return _patch_weight_grad(inp, grad_out, weight_shape)
    if groups == 1 and all(k == 1 for k in kernel) and not any(padding):
        # A strided 1x1 convolution (ResNet's shortcuts) reads every stride-th pixel: those, as
        # a 1x1 convolution's. As a correlation it would compute stride² taps for its one.
        read = inp
        for d, (o, s) in enumerate(zip(grad_out.shape[2:], stride)):
            read = _rows_from(read, 2 + d, 0, o, s)
        return _patch_weight_grad(read, grad_out, weight_shape)
    # The kernel packs the columns a row of output positions at a time: rows shorter than 8
    # cost more to pack than to multiply (ResNet's 4x4 and 2x2 maps: 0.36 ms against 0.1).
    own_product = own_product and size_hint(grad_out.shape[-1]) >= 8
    if groups == 1 and math.prod(kernel) < 32 and inp.device.type == "cpu" and not own_product:  # measured on CPU only
        return _columns_weight_grad(inp, grad_out, weight_shape, stride, padding, dilation)
    spatial = len(weight_shape) - 2
    if groups == 1:  # the pattern _op_kernels.conv_weight_grads_as_kernels takes
        grad = aten.convolution(inp.transpose(0, 1), grad_out.transpose(0, 1), None, dilation, padding, stride,
                                False, [0] * spatial, 1).transpose(0, 1)
        for dim, size in enumerate(kernel):
            # Taps past the window (a stride-2 layer over an even size has 4 x 4 for its 3 x 3)
            # are cut by a copy the kernel takes in (it then computes only the window's), not by
            # a view PyTorch takes outside the graph.
            if own_product and not (_static(grad.shape[dim + 2]) and grad.shape[dim + 2] == size):
                grad = aten.slice_copy.Tensor(grad, dim + 2, 0, size)
            else:
                grad = _first_rows(grad, dim + 2, size)
        return grad
    n = inp.shape[0]
    cin_g = inp.shape[1] // groups
    # Input channels become the batch, batch x groups the channels.
    x = inp.transpose(0, 1).reshape(groups, cin_g, n, *inp.shape[2:]).transpose(0, 1)
    x = x.reshape(cin_g, groups * n, *inp.shape[2:])
    gy = grad_out.transpose(0, 1)  # (groups * cout_g, n, ...)
    grad = aten.convolution(x, gy, None, dilation, padding, stride, False, [0] * spatial, groups)
    grad = grad.transpose(0, 1)  # (cout, cin_g, k...)
    for dim, size in enumerate(weight_shape[2:]):
        grad = _first_rows(grad, dim + 2, size)
    return grad


#: Bytes of input columns one product of ``_columns_weight_grad`` reads at most: more input
#: channels are taken in turns, each its own product (a 64x64 latent of 64 channels: two).
_COLUMN_BYTES = 32 << 20


def _columns_weight_grad(inp, grad_out, weight_shape, stride, padding, dilation):
    """dL/dW of a one-group convolution as one matrix product: the gradient [cout, pixels]
    times the input's columns [pixels, cin x taps], where a tap's column is the (padded) input
    read at that tap's offset, every stride-th row. As a convolution of the input by the
    gradient (``_conv_weight_grad``'s grouped form) its kernel is the whole output, which ORT
    runs as an im2col and a product as wide as the taps: 16 ms of a 3x3 convolution's 25 ms step
    at 8x64x32x32 (``benchmarks/layer_ops.py --profile conv3x3``). Both write the same columns;
    from about 32 taps (a 7x7 stem) that product is wide enough and needs no Concat. Where the
    kernels have products of their own, csrc/conv_weight_grad.h computes this product without
    storing the columns (``own_product``)."""
    spatial = len(weight_shape) - 2
    kernel, outs = list(weight_shape[2:]), list(grad_out.shape[2:])
    cin, cout = inp.shape[1], grad_out.shape[1]
    x = inp
    if any(padding):
        x = aten.constant_pad_nd(x, [p for d in reversed(range(spatial)) for p in (padding[d], padding[d])], 0.0)
    x = x.transpose(0, 1)  # [cin, n, ...]: each tap's rows, channel by channel
    gy = grad_out.transpose(0, 1).reshape(cout, -1)
    taps = math.prod(kernel)
    pixels = math.prod(size_hint(size) for size in (inp.shape[0], *outs))  # of this example: no guard
    per_turn = max(1, _COLUMN_BYTES // max(1, taps * pixels * inp.element_size()))
    parts = []
    for first in range(0, cin, per_turn):
        channels = x.narrow(0, first, min(per_turn, cin - first)) if per_turn < cin else x
        columns = []
        for offsets in itertools.product(*[range(k) for k in kernel]):
            tap = channels
            for d, (k, o, s, dl) in enumerate(zip(offsets, outs, stride, dilation)):
                tap = _rows_from(tap, 2 + d, k * dl, o, s)
            columns.append(tap)
        columns = torch.stack(columns, 1).reshape(channels.shape[0] * taps, -1)  # [cin x taps, pixels]
        parts.append(gy @ columns.t())
    grad = parts[0] if len(parts) == 1 else torch.cat(parts, 1)
    return grad.reshape(weight_shape)


def _rows_from(x, dim: int, start: int, count, step: int):
    """``count`` rows of ``x`` along ``dim`` from ``start``, every ``step``-th; a copy where the
    sizes are symbolic, for the reason ``_first_rows`` gives."""
    end = start + (count - 1) * step + 1
    if not _static(x.shape[dim], count):
        return aten.slice_copy.Tensor(x, dim, start, end, step)
    return aten.slice.Tensor(x, dim, start, end, step)


def _first_rows(x, dim: int, length):
    """``x``'s first ``length`` rows along ``dim``. Where the rows past them are a symbolic
    count (``dynamic=True``: what strided windows leave over at the input's end), a copy: a
    view would be laid out by that count, and Dynamo would guard on it (a recompile per
    remainder of the image size by the stride)."""
    if not _static(x.shape[dim], length):
        return aten.slice_copy.Tensor(x, dim, 0, length)
    return x if x.shape[dim] == length else x.narrow(dim, 0, length)


def _spread_back(grad, weight, stride, dilation, groups, rows_after):
    """The transposed convolution of ``grad`` (no padding), with ``rows_after`` more rows of
    zeros along each spatial dim: rows past every window's last tap. ONNX's ConvTranspose takes
    them as ``output_padding``, an attribute. Where a count is symbolic (``dynamic=True``) the
    result has ``stride`` rows of zeros after instead, more than the count: the caller narrows
    to the input. (Padding by the symbolic count would make Dynamo guard on whether it is 0,
    and with ``stride - 1`` rows the cut would be the whole result for some input sizes: its
    layout, a view or not, would be guarded on. Either way a recompile as the input's size
    changes parity.)"""
    spatial = weight.dim() - 2
    if all(isinstance(rows, int) for rows in rows_after):
        return aten.convolution(grad, weight, None, stride, [0] * spatial, dilation, True, rows_after, groups)
    spread = aten.convolution(grad, weight, None, stride, [0] * spatial, dilation, True, [0] * spatial, groups)
    for dim in range(spatial):
        if stride[dim] > 1:
            spread = _with_zeros(spread, dim + 2, 0, stride[dim])
    return spread


def _per_spatial_dim(values, spatial: int) -> list:
    """A convolution parameter with one entry per spatial dim (ATen broadcasts a single one)."""
    values = list(values)
    return values * spatial if len(values) == 1 else values


def _patch_weight_grad(inp, grad_out, weight_shape):
    """dL/dW of a convolution whose windows tile its input (stride = kernel, no padding or
    dilation, one group: patch embeddings, 2x2 downsampling, and as the transposed one,
    up-convolutions): the gradient times the input's patches, one product. As a convolution
    its kernel would be the whole input: most of a U-Net up-convolution's step on ORT
    (``benchmarks/layer_ops.py --profile conv_transpose``)."""
    spatial = len(weight_shape) - 2
    n, cin, cout = inp.shape[0], inp.shape[1], grad_out.shape[1]
    kernel, outs = list(weight_shape[2:]), list(grad_out.shape[2:])
    if all(k == 1 for k in kernel):  # 1x1: the patches are the input itself, [cin, pixels] per image
        x, gy = inp.reshape(n, cin, -1), grad_out.reshape(n, cout, -1)
        # Each image's product, summed (nothing transposed), unless it outgrows the operands.
        # Either is right at every size: a symbolic pixel count picks by its value now, without
        # a guard (which would recompile where the choice flips).
        if size_hint(cout) * size_hint(cin) <= size_hint(x.shape[-1]) * (size_hint(cin) + size_hint(cout)):
            return torch.bmm(gy, x.transpose(1, 2)).sum(0).reshape(weight_shape)
        return (gy.transpose(0, 1).reshape(cout, -1) @ x.transpose(0, 1).reshape(cin, -1).t()).reshape(weight_shape)
    x = inp
    for d in range(spatial):  # what no window reads (the input's remainder, output_padding)
        x = _first_rows(x, 2 + d, outs[d] * kernel[d])
    x = x.reshape(n, cin, *[size for pair in zip(outs, kernel) for size in pair])
    order = [0, *[2 + 2 * d for d in range(spatial)], 1, *[3 + 2 * d for d in range(spatial)]]
    patches = x.permute(order).reshape(-1, cin * math.prod(kernel))  # (n, o..) x (cin, k..)
    return (grad_out.transpose(0, 1).reshape(cout, -1) @ patches).reshape(weight_shape)


def _pool_geometry(size: int, k: int, s: int, p: int, ceil_mode: bool) -> tuple[int, int]:
    """PyTorch's pooling output length, and the zeros ceil mode adds past the right padding."""
    out = (size + 2 * p - k + (s - 1 if ceil_mode else 0)) // s + 1
    if ceil_mode and (out - 1) * s >= size + p:
        out -= 1
    past = (out - 1) * s + k - (size + 2 * p)
    # sym_max: a symbolic Max, where max() would make Dynamo guard on the sign (by parity)
    return out, max(0, past) if _static(past) else torch.sym_max(0, past)


def _avg_pool_parts(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    """Average pooling as a ones-kernel convolution over an explicitly padded input.

    Returns ``(x_padded, kernel, stride, divisor, pads)`` with ``x`` reshaped to (N*C, 1, *S):
    the pooled sum is ``conv(x_padded, kernel, stride)`` and the average that over ``divisor``
    (a per-window count, or the override). Used where torchlib has nothing: the backward,
    and ``divisor_override`` (which torchlib's lowering ignores).
    """
    spatial = len(kernel_size) if len(kernel_size) > 1 else x.dim() - 2
    ks = _per_spatial_dim(kernel_size, spatial)
    st = _per_spatial_dim(stride or ks, spatial)
    pd = _per_spatial_dim(padding, spatial)
    sizes = list(x.shape[-spatial:])
    # A single window larger than the padded input (ceil mode; HF EfficientNet's pooler has a
    # kernel of 320 over 2 x 2) sums and counts no more than the padded input: kernel-sized
    # ones would make the backward's transposed convolution kernel x kernel per plane.
    ks = [min(k, n + 2 * p) if _static(n) and _pool_geometry(n, k, s, p, ceil_mode)[0] == 1 else k
          for n, k, s, p in zip(sizes, ks, st, pd)]
    extra = [_pool_geometry(n, k, s, p, ceil_mode)[1] for n, k, s, p in zip(sizes, ks, st, pd)]
    flat = x.reshape(-1, 1, *sizes)
    # constant_pad_nd takes (left, right) pairs from the last dim backwards.
    pads = [v for i in reversed(range(spatial)) for v in (pd[i], pd[i] + extra[i])]
    x_padded = aten.constant_pad_nd(flat, pads, 0.0)
    kernel = torch.ones([1, 1, *ks], dtype=x.dtype, device=x.device)
    if divisor_override:
        divisor = float(divisor_override)
    else:
        ones = torch.ones([1, 1, *sizes], dtype=x.dtype, device=x.device)
        if count_include_pad:  # padding counts, ceil mode's extra zeros do not
            counted = aten.constant_pad_nd(ones, [v for i in reversed(range(spatial)) for v in (pd[i], pd[i])], 1.0)
            counted = aten.constant_pad_nd(counted, [v for i in reversed(range(spatial)) for v in (0, extra[i])], 0.0)
        else:
            counted = aten.constant_pad_nd(ones, pads, 0.0)
        divisor = aten.convolution(counted, kernel, None, st, [0] * spatial, [1] * spatial, False,
                                   [0] * spatial, 1)
    return x_padded, kernel, st, divisor, (pd, sizes, spatial)


def _avg_pool_forward(x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
                      divisor_override=None):
    if divisor_override is None:
        return NotImplemented  # torchlib's lowering is right without the override
    padding = [padding] if isinstance(padding, int) else padding
    x_padded, kernel, st, divisor, (pd, sizes, spatial) = _avg_pool_parts(
        x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)
    summed = aten.convolution(x_padded, kernel, None, st, [0] * spatial, [1] * spatial, False,
                              [0] * spatial, 1)
    out = summed / divisor
    return out.reshape(*x.shape[:-spatial], *out.shape[2:])


def _avg_pool_backward(grad_out, x, kernel_size, stride, padding, ceil_mode, count_include_pad,
                       divisor_override):
    one_window = _one_window_backward(grad_out, x, kernel_size, padding, count_include_pad, divisor_override)
    if one_window is not None:
        return one_window
    x_padded, kernel, st, divisor, (pd, sizes, spatial) = _avg_pool_parts(
        x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)
    g = grad_out.reshape(-1, 1, *grad_out.shape[-spatial:]) / divisor
    # The transposed conv spreads each window's gradient back; the rows past the last window
    # (always fewer than the stride) get zeros.
    out_pad = [x_padded.shape[2 + i] - ((g.shape[2 + i] - 1) * st[i] + kernel.shape[2 + i])
               for i in range(spatial)]
    if all(g.shape[2 + i] == 1 and kernel.shape[2 + i] == x_padded.shape[2 + i] for i in range(spatial)):
        grad_padded = g.expand(x_padded.shape)  # one window over everything: a broadcast
    else:
        grad_padded = _spread_back(g, kernel, st, [1] * spatial, 1, out_pad)
    grad = grad_padded
    for i in range(spatial):
        grad = grad.narrow(2 + i, pd[i], sizes[i])
    return grad.reshape(x.shape)


def _one_window_backward(grad_out, x, kernel_size, padding, count_include_pad, divisor_override):
    """Average pooling's backward where each plane has one window and an input size is
    symbolic (``dynamic=True``, where ``_avg_pool_parts`` cannot shrink the kernel to the
    input): the window's gradient over the inputs it covers, over its count, from masks of
    positions. Not a transposed convolution whose kernel is the window (HF EfficientNet's
    pooler: 320 x 320 on every plane of a 2 x 2 map). None where that does not apply."""
    spatial = len(kernel_size) if len(kernel_size) > 1 else x.dim() - 2
    sizes = list(x.shape[-spatial:])
    if _static(*sizes) or any(o != 1 for o in grad_out.shape[-spatial:]):  # a guard: one window
        return None
    kernel, pads = _per_spatial_dim(kernel_size, spatial), _per_spatial_dim(padding, spatial)
    grad, count = grad_out, None
    for d, (n, k, p) in enumerate(zip(sizes, kernel, pads)):
        inside = torch.arange(n, device=x.device) < k - p  # the window spans [-p, k - p)
        counted = (torch.arange(n + 2 * p, device=x.device) < k) if count_include_pad else inside
        grad = grad * inside.to(grad.dtype).reshape([n] + [1] * (spatial - 1 - d))
        count = counted.sum() if count is None else count * counted.sum()
    return grad / (float(divisor_override) if divisor_override else count.to(grad.dtype))


def _adaptive_matrix(in_size: int, out_size: int, like):
    """(out, in) averaging matrix of adaptive pooling along one dim, built from traced ops."""
    i = torch.arange(out_size, device=like.device)
    start = (i * in_size) // out_size
    end = ((i + 1) * in_size + out_size - 1) // out_size
    j = torch.arange(in_size, device=like.device)
    inside = (j[None, :] >= start[:, None]) & (j[None, :] < end[:, None])
    return inside.to(like.dtype) / (end - start).to(like.dtype)[:, None]


def _static(*sizes) -> bool:
    return all(isinstance(size, int) for size in sizes)


def _known(condition) -> bool:
    """Whether a condition on sizes holds at every size the graph serves, decided without a
    guard: a symbolic size's range (an input's is at least 2), else False."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true(condition)


def _holds(condition) -> bool:
    """Whether a condition on sizes holds for the example being traced, with a guard where a
    size is symbolic (a recompile if a later size decides otherwise). For conditions that only
    tiny sizes fail, so that the common sizes share one graph on the faster path."""
    if _known(condition):
        return True
    try:
        return bool(condition)
    except Exception:  # noqa: BLE001 - an unbacked size (no value to guard on): the general path
        return False


def size_hint(size, unbacked: int | None = 0) -> int | None:
    """A size's value in the example being traced, read without a guard (an unbacked size,
    which has none: ``unbacked``)."""
    if isinstance(size, int):
        return size
    hint = size.node.hint
    return int(hint) if hint is not None else unbacked


def _pool_window(in_size, out_size):
    """The window of adaptive pooling along a dim whose windows tile it (``in`` a multiple of
    ``out``): then each is a plain mean, without the (out, in) matrix. None otherwise.

    A symbolic ``in`` gets a guard on being a multiple (torch's own decomposition of 2-D
    adaptive pooling takes the same): a size that is not recompiles once, onto the matrix."""
    if out_size > 0 and in_size % out_size == 0:
        return in_size // out_size
    return None


def _adaptive_avg_pool(x, output_size):
    spatial = len(output_size)
    lead = x.dim() - spatial
    windows = [_pool_window(x.shape[lead + d], output_size[d]) for d in range(spatial)]
    if None not in windows:  # windows that tile the input: one mean over them all
        if spatial == 2 and _static(*windows) and x.dtype != torch.float64:  # ORT's has no float64
            return aten.avg_pool2d.default(x, windows, windows)  # ORT's AveragePool
        tiles = x.reshape(*x.shape[:lead], *[n for pair in zip(output_size, windows) for n in pair])
        if spatial == 3:  # ORT's ReduceMean over 3 strided axes is 2x slower than over the last, then 2
            tiles = tiles.mean(-1, keepdim=True)
        return tiles.mean([lead + 2 * d + 1 for d in range(spatial)])
    out = x
    for d in range(spatial):
        axis = lead + d
        m = _adaptive_matrix(x.shape[axis], output_size[d], x)
        # (.., in) x (out, in) -> (.., out) as multiply + sum: ORT's MatMul+Transpose fusion
        # mis-shapes some of these products (see docs/ops.md).
        out = (out.movedim(axis, -1).unsqueeze(-2) * m).sum(-1).movedim(-1, axis)
    return out


def _adaptive_avg_pool_backward(grad_out, x, spatial: int):
    lead = grad_out.dim() - spatial
    windows = [_pool_window(x.shape[lead + d], grad_out.shape[lead + d]) for d in range(spatial)]
    if None not in windows:
        # Windows that tile the input: each output's gradient spread evenly over its window, one
        # Expand of [.., out, 1, ..] to [.., out, window, ..] for all dims at once (not the
        # (out, in) matrix's products, nor one Expand per dim: ORT's Expand is slow on short rows).
        rows = (grad_out / math.prod(windows)).reshape(
            *grad_out.shape[:lead], *[n for n in grad_out.shape[lead:] for n in (n, 1)])
        spread = [*grad_out.shape[:lead], *[n for pair in zip(grad_out.shape[lead:], windows) for n in pair]]
        return rows.expand(spread).reshape(x.shape)
    grad = grad_out
    for d in range(spatial):
        axis = lead + d
        m = _adaptive_matrix(x.shape[axis], grad_out.shape[axis], x)
        grad = (grad.movedim(axis, -1).unsqueeze(-1) * m).sum(-2).movedim(-1, axis)
    return grad


def _strided_indices(size, stride, offset, device):
    """Flat storage index of every element of ``as_strided(size, stride, offset)``."""
    index = torch.full([1] * len(size), offset, dtype=torch.int64, device=device)
    for d, (n, st) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[d] = n
        index = index + (torch.arange(n, device=device) * st).reshape(shape)
    return index.expand(list(size))


def _binary_search(boundaries, values, right: bool):
    """torch's searchsorted loop, unrolled: ``start`` moves past every probe with
    ``!(b >= v)`` (left) or ``!(b > v)`` (right), so NaNs land exactly where eager puts them."""
    m = boundaries.shape[-1]
    start = torch.zeros(values.shape, dtype=torch.int64, device=values.device)
    end = torch.full(values.shape, m, dtype=torch.int64, device=values.device)
    for _ in range(int(m).bit_length()):  # enough halvings to empty any [start, end)
        mid = start + (end - start) // 2
        probe = mid.clamp(max=m - 1)
        b = boundaries[probe] if boundaries.dim() == 1 else boundaries.gather(-1, probe)
        go_right = ~(b > values) if right else ~(b >= values)
        active = start < end
        start = torch.where(active & go_right, mid + 1, start)
        end = torch.where(active & ~go_right, mid, end)
    return start


def _pnorm(diff, p: float, dim: int = -1):
    """The p-"norm" torch's cdist/pdist kernels use (p = 0 counts non-zeros)."""
    if diff.shape[dim] == 0:
        return diff.abs().sum(dim)
    if p == 0:
        return (diff != 0).to(diff.dtype).sum(dim)
    if p == 1:
        return diff.abs().sum(dim)
    if p == 2:
        return (diff * diff).sum(dim).sqrt()
    if p == float("inf"):
        return diff.abs().amax(dim)
    return diff.abs().pow(p).sum(dim).pow(1.0 / p)


def _pnorm_backward(diff, grad, dist, p: float):
    """d dist / d diff times grad, element-wise, with torch's zero-distance conventions
    (aten/src/ATen/native/cpu/DistanceOpsKernel.cpp)."""
    zero = torch.zeros((), dtype=diff.dtype, device=diff.device)
    if p == 0:
        return torch.zeros_like(diff)
    if p == 1:
        return grad * diff.sign()
    if p == float("inf"):
        return grad * diff.sign() * (diff.abs() == dist).to(diff.dtype)
    if p == 2:
        return torch.where(dist == 0, zero, grad * diff / dist)
    if p < 2:
        skip = (dist == 0) | ((diff == 0) & (p < 1))
        return torch.where(skip, zero, diff.sign() * diff.abs().pow(p - 1) * grad / dist.pow(p - 1))
    return torch.where(dist == 0, zero, diff * diff.abs().pow(p - 2) * grad / dist.pow(p - 1))


def _adaptive_max_pool(x, output_size):
    """Adaptive max pooling with torch's CPU choice of index: the first maximum in row-major
    order, or the last NaN if the window has one. Windows that tile the input are a max pooling
    with the window as stride, which picks the same. Other windows are gathered at their
    largest size, tile by tile (shorter windows repeat their last element, which changes
    neither choice), and max-pooled by tiles; a table of the plane's positions maps each tile's
    index back. Rows are gathered along the axes before the last; the last axis, whose gather
    moves single elements, is gathered as rows of the transposed input."""
    spatial = len(output_size)
    windows = [_pool_window(x.shape[x.dim() - spatial + d], output_size[d]) for d in range(spatial)]
    pool = aten.max_pool2d_with_indices if spatial == 2 else aten.max_pool3d_with_indices
    if None not in windows:
        return pool(x, windows, windows) if _static(*windows) else _tiled_max(x, output_size, windows)
    sizes = list(x.shape[-spatial:])
    tiles, positions, ks = x, torch.zeros((), dtype=torch.int64, device=x.device), []
    for d, (n, o) in enumerate(zip(sizes, output_size)):
        k = max(((i + 1) * n + o - 1) // o - (i * n) // o for i in range(o))
        ks.append(k)
        i = torch.arange(o, device=x.device)
        start, end = (i * n) // o, ((i + 1) * n + o - 1) // o
        idx = torch.minimum(start[:, None] + torch.arange(k, device=x.device)[None, :], end[:, None] - 1).reshape(-1)
        axis = x.dim() - spatial + d
        if d < spatial - 1:
            tiles = tiles.index_select(axis, idx)
        else:
            tiles = tiles.transpose(-1, -2).index_select(-2, idx).transpose(-1, -2)
        positions = positions.unsqueeze(-1) * n + idx  # (o1*k1, .., od*kd): the plane's flat positions
    values, tile_index = pool(tiles, ks, ks)
    # A Gather of the table (not advanced indexing's GatherND): _op_kernels reads the table there.
    return values, positions.reshape(-1).index_select(0, tile_index.reshape(-1)).reshape(tile_index.shape)


def _tiled_max(x, output_size, windows):
    """Adaptive max pooling over windows that tile the input and whose size is symbolic (ONNX's
    MaxPool takes its kernel as an attribute): each window's elements flattened last, the
    first maximum or the last NaN picked as torch's CPU kernel does, and its position mapped
    back to the plane. Reductions over the last axis only (ORT's GatherElements is slow)."""
    spatial = len(output_size)
    lead = x.dim() - spatial
    tiles = x.reshape(*x.shape[:lead], *[n for pair in zip(output_size, windows) for n in pair])
    order = [*range(lead), *range(lead, lead + 2 * spatial, 2), *range(lead + 1, lead + 2 * spatial, 2)]
    flat = tiles.permute(order).flatten(-spatial)  # (.., o1, .., od, w1 * .. * wd)
    nan = flat.isnan()
    position = torch.arange(flat.shape[-1], device=x.device, dtype=torch.float32)
    last_nan = torch.where(nan, position, -1.0).amax(-1)
    numbers = torch.where(nan, float("-inf"), flat)
    has_nan = last_nan >= 0
    values = torch.where(has_nan, float("nan"), numbers.amax(-1))
    rest = torch.where(has_nan, last_nan.long(), numbers.argmax(-1))
    index, stride = 0, 1
    for d in reversed(range(spatial)):
        tile = torch.arange(output_size[d], device=x.device).reshape([-1] + [1] * (spatial - 1 - d))
        index = index + (tile * windows[d] + rest % windows[d]) * stride
        rest, stride = rest // windows[d], stride * x.shape[lead + d]
    return values, index


def _max_pool_indices_backward(grad, x, indices, spatial: int):
    """Scatter each output's gradient to the flat position its index names in the plane."""
    lead = x.shape[:-spatial]
    plane = 1
    for s in x.shape[-spatial:]:
        plane *= s
    zeros = torch.zeros(*lead, plane, dtype=grad.dtype, device=grad.device)
    return zeros.scatter_add(-1, indices.reshape(*lead, -1), grad.reshape(*lead, -1)).reshape(x.shape)


def _offset2bag(indices, offsets):
    """Bag of each index (offsets are the starts of the bags; offsets[0] is 0)."""
    i = torch.arange(indices.shape[0], device=indices.device)
    return (offsets[None, :] <= i[:, None]).sum(-1) - 1


def _embedding_bag_dense_backward(grad, indices, offset2bag, bag_size, maximum_indices, num_weights,
                                  scale_grad_by_freq, mode, per_sample_weights, padding_idx):
    if scale_grad_by_freq and mode != 2:
        # Eager's CPU kernel divides by the count of another index than the row's own (it
        # indexes the sorted indices by unique-group number): left to PyTorch.
        return NotImplemented
    d = grad.shape[1]
    zeros = torch.zeros(num_weights, d, dtype=grad.dtype, device=grad.device)
    if mode == 2:  # max: each (bag, feature) gradient goes to the row that was the max
        nonempty = (bag_size != 0)[:, None]
        rows = torch.where(nonempty, maximum_indices, 0)
        return zeros.scatter_add(0, rows, torch.where(nonempty, grad, torch.zeros_like(grad)))
    scale = torch.ones(indices.shape, dtype=grad.dtype, device=grad.device)
    if per_sample_weights is not None:
        scale = scale * per_sample_weights
    if mode == 1:
        size = bag_size[offset2bag]
        scale = torch.where(size != 0, scale / size.clamp(min=1).to(grad.dtype), scale)
    contribution = grad[offset2bag] * scale[:, None]
    if padding_idx >= 0:
        contribution = torch.where((indices == padding_idx)[:, None], torch.zeros_like(contribution),
                                   contribution)
    return zeros.index_add(0, indices, contribution)


def _antialias_matrix(in_size: int, out_size: int, align_corners: bool, scale_arg, like):
    """(out, in) weights of antialiased bilinear resampling along one dim, as eager's CPU
    kernel computes them (UpSampleKernel.cpp, _compute_weights_aa; triangle filter widened
    by the scale when downsampling, each row normalized)."""
    if align_corners:
        scale = (in_size - 1) / (out_size - 1) if out_size > 1 else 0.0
    else:
        scale = 1.0 / scale_arg if scale_arg else in_size / out_size
    support = scale if scale >= 1.0 else 1.0
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    center = (torch.arange(out_size, device=like.device).to(like.dtype) + 0.5) * scale
    low = (center - support + 0.5).to(torch.int64).clamp(min=0)  # C++ casts truncate
    high = (center + support + 0.5).to(torch.int64).clamp(max=in_size)
    j = torch.arange(in_size, device=like.device)
    inside = (j[None, :] >= low[:, None]) & (j[None, :] < high[:, None])
    weight = (1 - ((j[None, :] - center[:, None] + 0.5) * invscale).abs()).clamp(min=0)
    weight = torch.where(inside, weight, torch.zeros((), dtype=like.dtype, device=like.device))
    total = weight.sum(-1, keepdim=True)
    return torch.where(total != 0, weight / total, weight)


def _row(sizes, dim, index):
    """(dim, size, index) of ``select(dim, index)``, the index made non-negative; the size, and
    so a negative index made non-negative, may be symbolic (a sequence length under
    ``dynamic=True``). None where the index itself is symbolic."""
    if not isinstance(index, int):
        return None
    dim = dim % len(sizes)
    size = sizes[dim]
    return dim, size, index + size if index < 0 else index


def _slice_pads(sizes, dim, start, end, step, length):
    """(dim, zeros before, zeros after) that make a step-1 slice's ``length`` elements the
    whole dim again; either count may be symbolic. None for other steps or symbolic bounds.
    The bounds were clamped when the forward sliced, under guards on the sizes: the count
    after is what the size leaves."""
    if step != 1 or not isinstance(start or 0, int):
        return None
    dim = dim % len(sizes)
    size = sizes[dim]
    if start is None or start >= 0:
        before = start or 0
        if isinstance(size, int):
            before = min(before, size)
    elif isinstance(size, int):
        before = max(start + size, 0)
    else:
        before = start + size
    return dim, before, size - before - length


def _with_zeros(x, dim, before, after):
    """``x`` with ``before`` zeros ahead of it and ``after`` behind, along ``dim``."""
    return aten.constant_pad_nd(x, [0, 0] * (x.dim() - 1 - dim) + [before, after], 0.0)


def _cat_nonempty(pieces, dim):
    return aten.cat([piece for piece in pieces if piece.shape[dim] > 0], dim)


def _summed_into(source, dim, size, index):
    """Zeros of ``size`` along ``dim``, each ``source`` row added at its ``index``: a gather's
    backward, where the indices are torch's own."""
    shape = list(source.shape)
    shape[dim] = size
    return torch.zeros(shape, dtype=source.dtype, device=source.device).index_add(dim, index, source)


# Padding's and unfold's backward: torch's decompositions gather or scatter with an index per
# element (reflection: GatherND, replication and unfold: ScatterElements), 3-40x eager's time
# on ORT (benchmarks/layer_ops.py). Their indices are fixed by the shapes, so slices, flips,
# sums and a Concat do the same.


def _reflection_pad_backward(op, grad, x, padding):
    """Per padded dim: the middle, plus each border flipped onto the positions it mirrors
    (1..left and size-1-right..size-2), added only there."""
    spatial = len(padding) // 2
    if min(padding) < 0 or not all(_known(x.shape[x.dim() - 1 - i] > max(padding[2 * i:2 * i + 2]))
                                   for i in range(spatial)):
        return _torch_decompositions[op](grad, x, padding)  # (a pad this wide is torch's error)
    out = grad
    for i in range(spatial):
        dim, left, right = x.dim() - 1 - i, padding[2 * i], padding[2 * i + 1]
        size = x.shape[dim]
        middle = out.narrow(dim, left, size)
        mirrored_left = out.narrow(dim, 0, left).flip(dim)
        mirrored_right = out.narrow(dim, left + size, right).flip(dim)
        if _static(size) and left + right <= size - 2:  # the borders' targets do not meet: touch only them
            pieces = [middle.narrow(dim, 0, 1), middle.narrow(dim, 1, left) + mirrored_left,
                      middle.narrow(dim, 1 + left, size - 2 - left - right),
                      middle.narrow(dim, size - 1 - right, right) + mirrored_right,
                      middle.narrow(dim, size - 1, 1)]
            out = _cat_nonempty(pieces, dim)
        elif not _static(size) and _holds(left + right + 4 <= size):
            # The same pieces with the size symbolic, bounded from the end (negative bounds):
            # constants, no shape arithmetic between the copies. The piece between the borders'
            # targets at least 2 long: an empty one or one of 1 would be guarded on, a
            # recompile at every size.
            def part(start, stop=None):
                return aten.slice.Tensor(out, dim, start, stop)

            pieces = [part(left, left + 1)]
            if left:
                pieces.append(part(left + 1, 2 * left + 1) + part(0, left).flip(dim))
            pieces.append(part(2 * left + 1, -2 * right - 1))
            if right:
                pieces.append(part(-2 * right - 1, -right - 1) + part(-right).flip(dim))
            pieces.append(part(-right - 1, -right if right else None))
            out = aten.cat(pieces, dim)
        else:
            out = (middle + _with_zeros(mirrored_left, dim, 1, size - 1 - left)
                   + _with_zeros(mirrored_right, dim, size - 1 - right, 1))
    return out


def _replication_pad_backward(op, grad, x, padding):
    """Per padded dim: each edge element gets its own gradient and its border's, summed."""
    spatial = len(padding) // 2
    padded_sizes = x.shape[x.dim() - spatial:]
    if min(padding) < 0 or not all(_known(size >= 2) or _known(size == 1) for size in padded_sizes):
        return _replication_pad_backward_scattered(grad, x, padding)
    out = grad
    for i in range(spatial):
        dim, left, right = x.dim() - 1 - i, padding[2 * i], padding[2 * i + 1]
        size = x.shape[dim]
        if _known(size == 1):
            out = out.sum(dim, keepdim=True)
            continue
        first = out.narrow(dim, 0, left + 1).sum(dim, keepdim=True)
        last = out.narrow(dim, left + size - 1, right + 1).sum(dim, keepdim=True)
        out = _cat_nonempty([first, out.narrow(dim, left + 1, size - 2), last], dim)
    return out


def _replication_pad_backward_scattered(grad, x, padding):
    # Each padded position copies its nearest edge element: send its gradient back there.
    spatial = len(padding) // 2
    out = grad
    for i in range(spatial):
        dim = x.dim() - 1 - i  # padding pairs run from the last dim backwards
        left = padding[2 * i]
        size = x.shape[dim]
        source = (torch.arange(out.shape[dim], device=x.device) - left).clamp(0, size - 1)
        out = _summed_into(out, dim, size, source)
    return out


def _unfold_backward(grad, input_size, dimension, size, step):
    """Window ``w``'s element ``j`` came from position ``w * step + j``. Cut each window into
    blocks of ``step`` (the last padded with zeros): block ``b`` of every window, laid end to
    end, is a run of positions starting at ``b * step``. The sum of those runs, each shifted by
    its zeros, is the gradient."""
    if not input_size:
        return _torch_decompositions[aten.unfold_backward.default](grad, input_size, dimension, size, step)
    dim = dimension % len(input_size)
    length, windows = input_size[dim], grad.shape[dim]
    if step <= 0:
        return _torch_decompositions[aten.unfold_backward.default](grad, input_size, dimension, size, step)
    blocks = -(-size // step)
    rows = grad.movedim(-1, dim + 1)  # [..., windows, size, ...]
    if blocks * step > size:
        rows = _with_zeros(rows, dim + 1, 0, blocks * step - size)
    rows = rows.reshape(*rows.shape[:dim + 1], blocks, step, *rows.shape[dim + 2:])
    total = None
    for b in range(blocks):
        run = rows.narrow(dim + 1, b, 1).flatten(dim, dim + 2)  # [..., windows * step, ...]: a Slice, not a Gather
        run = _with_zeros(run, dim, b * step, (blocks - 1 - b) * step) if blocks > 1 else run
        total = run if total is None else total + run
    if not _static(length, windows):  # which is the longer depends on the length's remainder by the step
        # the windows reach (windows + blocks - 1) * step, at most this short of the length
        short = size + step - 1 - blocks * step
        return aten.slice_copy.Tensor(_with_zeros(total, dim, 0, short) if short > 0 else total, dim, 0, length)
    span = (windows + blocks - 1) * step  # past position length - 1 there are only zeros
    return total.narrow(dim, 0, length) if span >= length else _with_zeros(total, dim, 0, length - span)


def _nearest_ratio(input_size: int, output_size: int, scale):
    """What torch multiplies an output position by to get nearest upsampling's input position."""
    return input_size / (input_size * scale) if scale is not None and scale > 0 else input_size / output_size


def _whole_repeat(in_size, out_size, scale):
    """How many times upsampling repeats each input element along a dim, where that is a whole
    number and a scale given is that number; None otherwise. Symbolic sizes (``dynamic=True``:
    SegFormer upsamples each stage to the first one's size): the power of two their values have
    now, with a guard that they keep it, so another ratio compiles anew; powers of two only, as
    torch's float ratio is then exact at every size."""
    if not _static(in_size, out_size):
        n, m = size_hint(in_size), size_hint(out_size)
        repeat = m // n if n > 0 and m % n == 0 else 0
        if repeat < 1 or repeat & (repeat - 1) or (scale is not None and scale > 0 and scale != repeat):
            return None
        return repeat if out_size == repeat * in_size else None  # the guard
    if in_size <= 0 or out_size % in_size:
        return None
    repeat = out_size // in_size
    return None if scale is not None and scale > 0 and scale != repeat else repeat


def _nearest_blocks(input_sizes, output_size, scales):
    """Per upsampled dim, the whole number of times each input element repeats, where torch's
    index (``floor(o * ratio)`` in float32, as ATen's kernel) is ``o // s`` at every output ``o``
    and a scale given is that number, so that ONNX Resize picks the same elements; else None."""
    import numpy as np

    spatial = len(output_size)
    blocks = []
    for d in range(spatial):
        isize, osize = input_sizes[len(input_sizes) - spatial + d], output_size[d]
        scale = scales[d] if d < len(scales) else None
        repeat = _whole_repeat(isize, osize, scale)
        if repeat is None:
            return None
        if not _static(isize, osize):  # a power of two: the float ratio is exact
            blocks.append(repeat)
            continue
        index = (np.arange(osize, dtype=np.float32) * np.float32(_nearest_ratio(isize, osize, scale))).astype(np.int64)
        if not np.array_equal(index, np.arange(osize) // repeat):
            return None
        blocks.append(repeat)
    return blocks


# Nearest upsampling (U-Nets, FPNs, diffusion models' decoders), kept whole while tracing by
# lower.whole_upsampling: torch's gather made the backward a ScatterElements with an int64
# index per element. Where each input element repeats a whole number of times, the forward is
# torchlib's Resize and the backward a sum over the repeats.


def _upsample_nearest(op, x, output_size, *scales):
    if (_nearest_blocks(x.shape, output_size, scales) is not None
            and x.dtype in _RESIZE_DTYPES.get(x.device.type, ())):
        return NotImplemented  # torchlib: Resize
    return _torch_decompositions[op](x, output_size, *scales)


#: What ORT 1.31's Resize takes, per device (a float64 Resize has no CPU kernel).
_RESIZE_DTYPES = {"cpu": (torch.float32,), "cuda": (torch.float32, torch.float16)}


def _upsample_nearest_backward(grad, output_size, input_size, *scales):
    spatial = len(output_size)
    lead = len(input_size) - spatial
    blocks = _nearest_blocks(input_size, output_size, scales)
    if blocks is not None:
        tiles = [n for pair in zip(input_size[lead:], blocks) for n in pair]
        return grad.reshape(*grad.shape[:lead], *tiles).sum([lead + 2 * d + 1 for d in range(spatial)])
    out = grad  # the gather's indices, as torch computes them, summed back one dim at a time
    for d in range(spatial):
        axis, isize, osize = lead + d, input_size[lead + d], output_size[d]
        ratio = _nearest_ratio(isize, osize, scales[d] if d < len(scales) else None)
        index = (torch.arange(osize, dtype=torch.float32, device=grad.device) * ratio).to(torch.int64)
        out = _summed_into(out, axis, isize, index)
    return out


# Linear upsampling (bilinear decoders, FPNs), kept whole the same way: torch's gather of the
# 2^n corners made the backward 2^n ScatterElements. Resize forward where ORT computes what torch
# does (whole-number scales, or align_corners); the backward as sums and shifts for whole-number
# scales, else an index_add per dim with torch's own indices and weights.


def _linear_index(in_size, out_size, align_corners, scale, like):
    """Per output position: torch's lower input index, the upper one and the upper's weight,
    computed as torch does, in float32 at least (a half-precision gradient's indices must not
    come from half-precision positions)."""
    dtype = torch.promote_types(like.dtype, torch.float32)
    if align_corners:
        ratio = (in_size - 1.0) / (out_size - 1.0) if out_size > 1 else 0.0
        source = torch.arange(out_size, device=like.device).to(dtype) * ratio
    else:
        ratio = 1.0 / scale if scale is not None and scale > 0 else in_size / out_size
        source = (ratio * (torch.arange(out_size, device=like.device).to(dtype) + 0.5) - 0.5).clamp(min=0.0)
    lower = source.to(torch.int64)
    return lower, (lower + 1).clamp(max=in_size - 1), (source - lower).clamp(0.0, 1.0)


def _linear_phases(in_size, out_size, align_corners, scale):
    """For a whole-number scale ``s`` without align_corners: output ``s * i + r`` reads input
    ``i`` and its neighbour on the side of ``delta_r = (2r + 1 - s) / 2s`` with weight
    ``|delta_r|`` (the edges clamp). The deltas, or None where that is not what torch computes."""
    import numpy as np

    repeat = None if align_corners else _whole_repeat(in_size, out_size, scale)
    if repeat is None:
        return None
    deltas = [(2 * r + 1 - repeat) / (2 * repeat) for r in range(repeat)]
    if not _static(in_size, out_size):  # a power of two: torch's positions are these exactly
        return deltas
    ratio = np.float32(1.0 / scale if scale is not None and scale > 0 else in_size / out_size)
    source = np.maximum(ratio * (np.arange(out_size, dtype=np.float32) + np.float32(0.5)) - np.float32(0.5), 0)
    expected = np.array([max(i + d, 0.0) for i in range(in_size) for d in deltas])
    if not np.allclose(source, expected, rtol=0, atol=1e-5):
        return None
    return deltas


def _upsample_linear(op, x, output_size, align_corners, *scales):
    spatial = len(output_size)
    whole = all(_linear_phases(x.shape[x.dim() - spatial + d], output_size[d], align_corners,
                               scales[d] if d < len(scales) else None) is not None for d in range(spatial))
    static = _static(*x.shape[x.dim() - spatial:], *output_size)
    if (whole or (align_corners and static)) and x.dtype in _RESIZE_DTYPES.get(x.device.type, ()):
        return NotImplemented  # torchlib: Resize
    return _torch_decompositions[op](x, output_size, align_corners, *scales)


def _upsample_linear_backward(grad, output_size, input_size, align_corners, *scales):
    spatial = len(output_size)
    lead = len(input_size) - spatial
    out = grad
    for d in range(spatial):
        axis, size = lead + d, input_size[lead + d]
        scale = scales[d] if d < len(scales) else None
        deltas = _linear_phases(size, output_size[d], align_corners, scale)
        as_product = grad.dtype in (torch.float32, torch.float64) and _as_product(
            size, _MATRIX_MAX if deltas is None else _MATRIX_OVER_PHASES_MAX, guarded=deltas is None)
        if deltas is not None and not as_product:
            out = _linear_phases_backward(out, axis, size, deltas)
            continue
        lower, upper, weight = _linear_index(size, output_size[d], align_corners, scale, grad)
        if as_product:
            out = _along(out, axis, _linear_matrix(lower, upper, weight.to(grad.dtype), size))
            continue
        weight = weight.reshape([-1] + [1] * (out.dim() - 1 - axis)).to(grad.dtype)
        out = _summed_into(out * (1 - weight), axis, size, lower).index_add(axis, upper, out * weight)
    return out


#: Inputs up to this long take a linear upsampling's backward as a product with its (out, in)
#: weights: 2 * in FLOPs per element at ~150 GFLOP/s, about 3.4 ns at 256, against ORT's
#: one-thread ScatterElements' ~4 ns (layer_ops.py --profile upsample_bilinear_ac, before).
_MATRIX_MAX = 256
#: ... and up to this long where a whole-number scale has its phases' backward (the product is
#: faster for 32 and 64 inputs, slower for 128: benchmarks/layer_ops.py upsample_bilinear*).
_MATRIX_OVER_PHASES_MAX = 64


def _as_product(size, limit: int, guarded: bool) -> bool:
    """Whether a linear upsampling's backward along an input axis of ``size`` is a product with
    its weights. A symbolic size: where the other path is the index scatter (align_corners, or
    a ratio not whole), as its value now says, with a guard that it stays within ``limit`` (one
    recompile if it grows past); where it is the phases' sums, no: they serve any size."""
    if _static(size):
        return size <= limit
    return guarded and size_hint(size) <= limit and size <= limit


def _linear_matrix(lower, upper, weight, size):
    """(out, in): each output's weights on its two input elements (the same one at an edge)."""
    j = torch.arange(size, device=lower.device)
    return ((j == lower[:, None]).to(weight.dtype) * (1 - weight)[:, None]
            + (j == upper[:, None]).to(weight.dtype) * weight[:, None])


def _along(x, axis, matrix):
    """``x``'s ``axis`` (of length out) mapped through ``matrix`` (out, in), as one MatMul: the
    last axis on the right, another with the matrix transposed on the left (no Transposes of x)."""
    if axis == x.dim() - 1:
        return x @ matrix
    before, after = list(x.shape[:axis]), list(x.shape[axis + 1:])
    rows = x.reshape(-1, x.shape[axis], math.prod(after))
    return (matrix.t() @ rows).reshape(*before, matrix.shape[1], *after)


def _linear_phases_backward(grad, axis, size, deltas):
    """The gradient of one whole-number linear upsampling along ``axis``: per input element the
    sum of its outputs' own weights, plus what the neighbours' outputs gave it."""
    phases = grad.unflatten(axis, (size, len(deltas)))
    if _static(*grad.shape):
        rows = [row.squeeze(axis + 1) for row in phases.split(1, axis + 1)]  # output s * i + r, per i: one Split
    else:  # the phases' axis is out // in, which no guard makes a number: a split's last part
        # would be "out // in - (s - 1)" long; each phase is taken directly instead
        rows = [phases.select(axis + 1, r) for r in range(len(deltas))]

    def weighted(weights):  # elementwise, which the pointwise kernels fuse
        terms = [row * w for row, w in zip(rows, weights) if w]
        return functools.reduce(operator.add, terms) if terms else torch.zeros_like(rows[0])

    own = weighted([1 - abs(d) for d in deltas])
    if size == 1:
        return own + weighted([abs(d) for d in deltas])
    to_next = weighted([max(d, 0.0) for d in deltas])  # reaches size + 1, the last one itself
    to_previous = weighted([max(-d, 0.0) for d in deltas])  # reaches size - 1, the first one itself
    narrow = functools.partial(torch.narrow, dim=axis)
    from_previous = aten.cat([torch.zeros_like(narrow(to_next, start=0, length=1)),
                              narrow(to_next, start=0, length=size - 2),
                              narrow(to_next, start=size - 2, length=1) + narrow(to_next, start=size - 1, length=1)], axis)
    from_next = aten.cat([narrow(to_previous, start=0, length=1) + narrow(to_previous, start=1, length=1),
                          narrow(to_previous, start=2, length=size - 2),
                          torch.zeros_like(narrow(to_previous, start=0, length=1))], axis)
    return own + from_previous + from_next


# -- attention: what flash attention keeps (each row's logsumexp), in ops ONNX has -------------

def masked_scores(scores, mask, is_causal: bool):
    """``scores`` with the causal mask and ``mask`` (bool: keep; float: added) applied, and the
    rows ``mask`` hides whole (None without a mask). Torch's attention gives such a row zeros,
    not softmax's NaN (its ``_safe_softmax``): here the row is scored 0, so its probabilities
    and gradients stay finite, and ``zero_rows`` zeroes them. Torch decides on the masked
    scores, this on the mask; they differ only where q·k itself is infinite."""
    q_len, kv_len = scores.size(-2), scores.size(-1)
    if is_causal:  # top-left aligned: every row keeps its first column
        keep = torch.ones(q_len, kv_len, dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if mask is None:
        return scores, None
    if mask.dtype == torch.bool:
        scores, empty = scores.masked_fill(~mask, float("-inf")), ~mask.any(dim=-1, keepdim=True)
    else:  # in the scores' dtype, as torch's math attention adds it (half queries take a float mask)
        mask = mask.to(scores.dtype)
        scores, empty = scores + mask, (mask == float("-inf")).all(dim=-1, keepdim=True)
    return scores.masked_fill(empty, 0.0), empty


def zero_rows(values, empty):
    return values if empty is None else values.masked_fill(empty, 0.0)


def attention_inputs(query, key, value, scale, grouped: bool):
    """Key and value with their heads repeated to the query's (``grouped``: grouped-query
    attention), the scale (1/√dim unless given), and the repeat count."""
    scale = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
    repeat = query.size(-3) // key.size(-3) if grouped and key.size(-3) != query.size(-3) else 1
    if repeat > 1:
        key, value = (t.repeat_interleave(repeat, dim=-3) for t in (key, value))
    return key, value, scale, repeat


def attention_operands(query, key, value):
    """q, kᵀ and v as [batch·heads, rows, dim], as matmul's decomposition makes them (so that
    backward reads the forward's copies, and its transposes fold into ORT's FusedMatMul), and
    the batch dims."""
    q_len, kv_len = query.size(-2), key.size(-2)
    return (query.reshape(-1, q_len, query.size(-1)), key.transpose(-2, -1).reshape(-1, key.size(-1), kv_len),
            value.reshape(-1, kv_len, value.size(-1)), query.shape[:-2])


def _widened(dtype):
    """float32 for half types (what attention's softmax, or the CPU flash kernel, computes in)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _dropped(probs, keep, dropout_p: float):
    return probs if keep is None else torch.where(keep, probs * (1.0 / (1.0 - dropout_p)), 0.0)


def attention_forward(q, k_t, v, mask, scale, is_causal: bool, batch, dropout_p: float = 0.0):
    """softmax(q kᵀ·scale + mask) v from ``attention_operands``, each row's logsumexp ([*batch,
    rows, 1]), and with dropout the bool mask of the probabilities kept. The softmax is written
    out so that its max and sum give the logsumexp in the same kernel on ORT
    (``_fusions.softmax_written_out``). A row the mask hides whole gives zeros and a logsumexp
    of 0, as torch's flash attention does. Half types multiply in their own dtype and take the
    softmax and logsumexp in float32, as flash attention does. Dropout's mask is drawn as eager's
    CPU attention draws it (``bernoulli_(1 - p)`` over the probabilities' shape): with option
    ``torch_random`` it is eager's mask (``lower.random_draws_in_pytorch``)."""
    q_len, kv_len = q.size(-2), k_t.size(-1)
    wide = _widened(q.dtype)
    scores, empty = masked_scores((torch.bmm(q, k_t).to(wide) * scale).view(*batch, q_len, kv_len), mask, is_causal)
    peak = scores.amax(dim=-1, keepdim=True)
    exp = torch.exp(scores - peak)
    total = exp.sum(dim=-1, keepdim=True)
    probs = zero_rows(exp / total, empty)
    keep = torch.bernoulli(torch.empty_like(probs, dtype=torch.bool), 1.0 - dropout_p) if dropout_p > 0.0 else None
    out = torch.bmm(_dropped(probs, keep, dropout_p).to(q.dtype).reshape(-1, q_len, kv_len), v)
    return out.view(*batch, q_len, v.size(-1)), zero_rows(peak + torch.log(total), empty), keep


def attention_backward(grad_out, q, k_t, v, mask, logsumexp, scale, is_causal: bool, batch, keep=None,
                       dropout_p: float = 0.0):
    """The gradients of ``attention_forward`` for query, key and value (their shapes), the
    probabilities recomputed from the logsumexp (and dropped where ``keep`` is False). The
    scores are q·scale against kᵀ where forward has (q kᵀ)·scale: the same values (exactly, for
    a power-of-two scale), but not the same expression, so no CSE joins them with the forward's
    product, which would then be saved and undo the point."""
    q_len, kv_len = q.size(-2), k_t.size(-1)
    wide = _widened(q.dtype)
    if wide == q.dtype:
        product = torch.bmm(q * scale, k_t)
    else:  # a half q·scale rounds; -q does not, so these are exactly the forward's scores
        product = torch.bmm(-q, k_t).to(wide) * -scale
    scores, empty = masked_scores(product.view(*batch, q_len, kv_len), mask, is_causal)
    probs = zero_rows(torch.exp(scores - logsumexp), empty)
    dropped = _dropped(probs, keep, dropout_p).reshape(-1, q_len, kv_len)
    probs = probs.reshape(-1, q_len, kv_len)
    grad = grad_out.reshape(-1, q_len, v.size(-1))
    grad_probs = torch.bmm(grad, v.transpose(1, 2)).to(wide)
    if keep is not None:
        grad_probs = _dropped(grad_probs, keep.reshape(-1, q_len, kv_len), dropout_p)
    grad_scores = (probs * (grad_probs - (grad_probs * probs).sum(dim=-1, keepdim=True)) * scale).to(q.dtype)
    return (torch.bmm(grad_scores, k_t.transpose(1, 2)).view(*batch, q_len, q.size(-1)),
            torch.bmm(grad_scores.transpose(1, 2), q).view(*batch, kv_len, q.size(-1)),
            torch.bmm(dropped.to(q.dtype).transpose(1, 2), grad).view(*batch, kv_len, v.size(-1)))


def _flash_for_cpu_operands(query, key, value, scale):
    """The CPU flash op's operands for ``attention_forward``/``backward``: float32 compute for
    half types (the kernel's), key and value heads repeated for grouped queries."""
    compute = _widened(query.dtype)
    key, value, scale, repeat = attention_inputs(query, key.to(compute), value.to(compute), scale, grouped=True)
    return (*attention_operands(query.to(compute), key, value), scale, repeat)


def _f32(value: float) -> float:
    """``value`` rounded to the nearest float32."""
    return struct.unpack("f", struct.pack("f", value))[0]


def _fake_quantized(x, scale, inv_scale, zero_point, quant_min: int, quant_max: int):
    """(fake-quantized x, mask of the values within the range) as ATen's CPU kernels compute them."""
    float_zero = isinstance(zero_point, torch.Tensor) and zero_point.is_floating_point()
    zero = zero_point.to(torch.float32) if isinstance(zero_point, torch.Tensor) else zero_point
    scaled = x.to(torch.float32) * inv_scale
    q = torch.round(scaled + zero) if float_zero else torch.round(scaled) + zero
    mask = (q >= quant_min) & (q <= quant_max)
    levels = q.clamp(quant_min, quant_max)
    if float_zero or x.dtype != torch.float32:  # rounded once, from float64, as the kernels do
        wide = scale.double() if isinstance(scale, torch.Tensor) else scale
        out = (levels.double() - (zero.double() if float_zero else zero)) * wide
    else:
        out = (levels - zero) * scale
    return out.to(x.dtype), mask


@functools.lru_cache(None)
def _convolution_backward(own_product: bool):
    """aten.convolution_backward. ``own_product``: a one-group convolution's weight gradient
    stays one Conv for csrc/conv_weight_grad.h (``_conv_weight_grad``)."""

    def convolution_backward(grad_out, inp, weight, bias_sizes, stride, padding, dilation,
                             transposed, output_padding, groups, output_mask):
        spatial = weight.dim() - 2
        # ATen lets one value stand for every spatial dim (``padding="valid"`` gives [0]).
        stride, padding, dilation, output_padding = (
            _per_spatial_dim(values, spatial) for values in (stride, padding, dilation, output_padding))
        grad_input = grad_weight = grad_bias = None
        if output_mask[0]:
            if transposed:
                grad_input = aten.convolution(grad_out, weight, None, stride, padding, dilation,
                                              False, [0] * spatial, groups)
                # output_padding rows of the forward get no window: crop to the input size.
                for dim in range(spatial):
                    grad_input = grad_input.narrow(dim + 2, 0, inp.shape[dim + 2])
            elif groups == 1 and all(k == 1 for k in weight.shape[2:]) and all(s == 1 for s in stride) \
                    and not any(padding):
                # A 1x1 convolution's: the 1x1 convolution by the transposed weight (a GEMM per
                # image for ORT, where its ConvTranspose adds a col2im pass).
                grad_input = aten.convolution(grad_out, weight.transpose(0, 1), None, [1] * spatial, [0] * spatial,
                                              [1] * spatial, False, [0] * spatial, 1)
            else:
                # output_padding makes the transposed conv land exactly on the input size.
                extra = []
                for i in range(spatial):
                    full = ((grad_out.shape[i + 2] - 1) * stride[i] - 2 * padding[i]
                            + dilation[i] * (weight.shape[i + 2] - 1) + 1)
                    extra.append(inp.shape[i + 2] - full)
                if all(isinstance(e, int) for e in extra):
                    grad_input = aten.convolution(grad_out, weight, None, stride, padding, dilation,
                                                  True, extra, groups)
                else:  # a symbolic size (dynamic=True): spread over the padded input, then cut
                    grad_input = _spread_back(grad_out, weight, stride, dilation, groups, extra)
                    for dim in range(spatial):
                        grad_input = grad_input.narrow(dim + 2, padding[dim], inp.shape[dim + 2])
        if output_mask[1]:
            if transposed:
                grad_weight = _conv_weight_grad(grad_out, inp, weight.shape, stride, padding,
                                                dilation, groups, own_product)
            else:
                grad_weight = _conv_weight_grad(inp, grad_out, weight.shape, stride, padding,
                                                dilation, groups, own_product)
        if output_mask[2]:
            grad_bias = grad_out.sum([0] + list(range(2, grad_out.dim())))
        return grad_input, grad_weight, grad_bias

    return convolution_backward


@functools.lru_cache(None)
def own_decompositions() -> dict:
    table = {}

    def register(op):
        def wrap(fn):
            table[op] = fn
            return fn
        return wrap

    @register(aten._scaled_dot_product_flash_attention_for_cpu.default)
    def flash_attention_for_cpu(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
        # What SDPA runs on CPU where Dynamo keeps the caller whole (nn.MultiheadAttention).
        # torchlib lowers it with a logsumexp of zeros, which its backward reads.
        if dropout_p != 0.0 or query.dim() != 4:
            return NotImplemented  # TORCHLIB_WRONG: the op runs in PyTorch
        q, k_t, v, batch, scale, _ = _flash_for_cpu_operands(query, key, value, scale)
        out, logsumexp, _ = attention_forward(q, k_t, v, attn_mask, scale, is_causal, batch)
        return out.to(query.dtype), logsumexp.squeeze(-1)

    @register(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    def flash_attention_for_cpu_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *,
                                         attn_mask=None, scale=None):
        if dropout_p != 0.0 or query.dim() != 4:
            return NotImplemented
        q, k_t, v, batch, scale, repeat = _flash_for_cpu_operands(query, key, value, scale)
        grad_q, grad_k, grad_v = attention_backward(grad_out.to(q.dtype), q, k_t, v, attn_mask,
                                                    logsumexp.unsqueeze(-1), scale, is_causal, batch)
        if repeat > 1:  # each key/value head served ``repeat`` query heads
            grad_k, grad_v = (g.unflatten(1, (-1, repeat)).sum(2) for g in (grad_k, grad_v))
        return grad_q.to(query.dtype), grad_k.to(key.dtype), grad_v.to(value.dtype)

    @register(aten.im2col.default)
    def im2col(x, kernel_size, dilation, padding, stride):
        # F.unfold. torchlib gathers each window's elements with an int64 index, along the
        # innermost axis too (ORT's Gather: 17.7 ms of a 26 ms step at (8, 64, 32, 32)). The
        # patches are kernel-many strided slices of the padded input, stacked.
        if x.dim() not in (3, 4):
            return NotImplemented
        batched = x.dim() == 4
        x = x if batched else x.unsqueeze(0)
        (kh, kw), (dh, dw), (ph, pw), (sh, sw) = kernel_size, dilation, padding, stride
        n, c, h, w = x.shape
        oh, ow = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1, (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
        if not (_known(oh >= 1) and _known(ow >= 1)):
            return NotImplemented  # torch's own error, or a symbolic size that may leave no window
        padded = aten.constant_pad_nd(x, [pw, pw, ph, ph], 0.0) if ph or pw else x
        blocks = [padded[:, :, i * dh:i * dh + (oh - 1) * sh + 1:sh, j * dw:j * dw + (ow - 1) * sw + 1:sw]
                  for i in range(kh) for j in range(kw)]
        patches = torch.stack(blocks, 2).reshape(n, c * kh * kw, oh * ow)
        return patches if batched else patches.squeeze(0)

    @register(aten.col2im.default)
    def col2im(x, output_size, kernel_size, dilation, padding, stride):
        # An unbatched F.fold (and unbatched F.unfold's gradient): ONNX Col2Im wants a batch.
        if x.dim() != 2:
            return NotImplemented
        return aten.col2im(x.unsqueeze(0), output_size, kernel_size, dilation, padding, stride).squeeze(0)

    @register(aten.pixel_shuffle.default)
    def pixel_shuffle(x, r):
        # A Reshape, a Transpose that moves the innermost axis, a Reshape, which the pointwise
        # stage runs as one multi-threaded kernel (ORT's DepthToSpace, and torchlib's
        # pixel_unshuffle through shape arithmetic, move each element on one thread).
        if x.device.type != "cpu" or x.dim() < 3:
            return NotImplemented
        *lead, c, h, w = x.shape
        blocks = x.reshape(*lead, c // (r * r), r, r, h, w)
        k = len(lead)
        return blocks.permute(*range(k), k, k + 3, k + 1, k + 4, k + 2).reshape(*lead, c // (r * r), h * r, w * r)

    @register(aten.pixel_unshuffle.default)
    def pixel_unshuffle(x, r):
        if x.device.type != "cpu" or x.dim() < 3:
            return NotImplemented
        *lead, c, h, w = x.shape
        k = len(lead)
        rows = x.reshape(*lead, c, h // r, r, w // r, r)
        return rows.permute(*range(k), k, k + 2, k + 4, k + 1, k + 3).reshape(*lead, c * r * r, h // r, w // r)

    @register(aten.native_layer_norm.default)
    def native_layer_norm(x, normalized_shape, weight, bias, eps):
        # ORT's CPU LayerNormalization has no float64 kernel, and torchlib's asks for float32
        # statistics (ORT refused the model; the partition ran in PyTorch): in float64, torch's
        # decomposition, means and variances ORT computes in float64, as eager does.
        if x.dtype != torch.float64 or x.device.type != "cpu":
            return NotImplemented
        return _torch_decompositions[aten.native_layer_norm.default](x, normalized_shape, weight, bias, eps)

    @register(aten.native_group_norm.default)
    def native_group_norm(x, weight, bias, n, channels, hxw, groups, eps):
        # torchlib: InstanceNormalization, then mean and rstd again in three more passes. Each
        # group is a row of a LayerNormalization, which also returns mean and rstd; the affine
        # is one pointwise kernel with what follows. Sizes from the op's own arguments, not
        # inferred (-1), which under dynamic=True cost a third more symbolic algebra.
        if x.device.type == "cpu" and x.dtype == torch.float64:  # no float64 InstanceNormalization on CPU
            return _torch_decompositions[aten.native_group_norm.default](x, weight, bias, n, channels, hxw, groups, eps)
        if x.device.type != "cpu" or x.dtype != torch.float32 or (_static(*x.shape) and x.numel() == 0) \
                or any(p is not None and p.dtype != torch.float32 for p in (weight, bias)):
            return NotImplemented
        rows = x.reshape(n, groups, channels // groups * hxw)
        y, mean, rstd = aten.native_layer_norm(rows, [channels // groups * hxw], None, None, eps)
        y = y.reshape(n, channels, hxw)
        if weight is not None:
            y = y * weight.reshape(channels, 1)
        if bias is not None:
            y = y + bias.reshape(channels, 1)
        return y.reshape(x.shape), mean.reshape(n, groups), rstd.reshape(n, groups)

    register(aten.convolution_backward.default)(_convolution_backward(own_product=False))

    @register(aten._weight_norm_interface_backward.default)
    def weight_norm_interface_backward(grad_w, v, g, norms, dim):
        # torch.nn.utils weight_norm (wav2vec2's and HiFi-GAN's convolutions); torchlib lowers
        # the forward but has no backward. ATen's formula, in the norms' dtype (float for bf16).
        others = [d for d in range(v.dim()) if d != dim]
        wide = norms.dtype
        gw, vw = grad_w.to(wide), v.to(wide)
        along = (gw * vw).sum(others, keepdim=True)
        grad_v = (g.to(wide) / norms) * (gw - vw * (along / (norms * norms)))
        return grad_v.to(v.dtype), (along / norms).to(g.dtype)

    @register(aten.avg_pool2d.default)
    def avg_pool2d(x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
                   divisor_override=None):
        return _avg_pool_forward(x, kernel_size, stride, padding, ceil_mode, count_include_pad,
                                 divisor_override)

    @register(aten.avg_pool3d.default)
    def avg_pool3d(x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
                   divisor_override=None):
        return _avg_pool_forward(x, kernel_size, stride, padding, ceil_mode, count_include_pad,
                                 divisor_override)

    table[aten.avg_pool2d_backward.default] = _avg_pool_backward
    table[aten.avg_pool3d_backward.default] = _avg_pool_backward

    @register(aten._adaptive_avg_pool2d_backward.default)
    def adaptive_avg_pool2d_backward(grad_out, x):
        return _adaptive_avg_pool_backward(grad_out, x, 2)

    @register(aten._adaptive_avg_pool3d_backward.default)
    def adaptive_avg_pool3d_backward(grad_out, x):
        return _adaptive_avg_pool_backward(grad_out, x, 3)

    # torch's own decomposition makes the windows' size a constant: a recompile per input size.
    @register(aten._adaptive_avg_pool2d.default)
    def adaptive_avg_pool2d(x, output_size):
        return _adaptive_avg_pool(x, output_size)

    @register(aten._adaptive_avg_pool3d.default)
    def adaptive_avg_pool3d(x, output_size):
        return _adaptive_avg_pool(x, output_size)

    # Slicing's backward (RoPE's rotate_half, chunked projections): torchlib writes a slice
    # into a tensor as Transpose + ScatterND + Transpose, three full copies. A contiguous
    # slice (step 1) is a Pad of zeros, or a Concat around the slice.
    @register(aten.slice_backward.default)
    def slice_backward(grad, input_sizes, dim, start, end, step):
        span = _slice_pads(input_sizes, dim, start, end, step, grad.shape[dim])
        if span is None:  # torch's: zeros + slice_scatter
            return _torch_decompositions[aten.slice_backward.default](grad, input_sizes, dim, start, end, step)
        dim, before, after = span
        if _known(before == 0) and _known(after == 0):  # x[:, t] under dynamic=True slices all rows
            return grad.clone()  # an Identity, which ORT drops; a Pad of nothing would copy
        return _with_zeros(grad, dim, before, after)

    @register(aten.slice_scatter.default)
    def slice_scatter(x, src, dim=0, start=None, end=None, step=1):
        span = _slice_pads(x.shape, dim, start, end, step, src.shape[dim % x.dim()])
        if span is None or not _static(*span[1:]):
            return NotImplemented
        dim, before, after = span
        pieces = [x.narrow(dim, 0, before)] if before > 0 else []
        pieces.append(src.to(x.dtype))
        if after > 0:
            pieces.append(x.narrow(dim, x.shape[dim] - after, after))
        return aten.cat(pieces, dim) if len(pieces) > 1 else pieces[0].clone()

    # Indexing's backward (``q, k, v = qkv`` after a permute, as nanoGPT-style attention
    # splits its heads): torchlib writes the gradient into zeros with ScatterElements and an
    # int64 index per element, 3.6 ms for one [3, 8, 4, 128, 64] gradient, 43 ms of a 190 ms
    # step. A Pad of zeros around it, or a Concat around the row, is a copy.
    @register(aten.select_backward.default)
    def select_backward(grad, input_sizes, dim, index):
        row = _row(input_sizes, dim, index)
        if row is None:  # torch's: zeros + select_scatter
            return _torch_decompositions[aten.select_backward.default](grad, input_sizes, dim, index)
        dim, size, index = row
        pads = [0, 0] * (len(input_sizes) - 1 - dim) + [index, size - 1 - index]
        return aten.constant_pad_nd(grad.unsqueeze(dim), pads, 0.0)

    @register(aten.select_scatter.default)
    def select_scatter(x, src, dim, index):
        row = _row(x.shape, dim, index)
        if row is None:
            return NotImplemented
        dim, _, index = row
        return slice_scatter(x, src.unsqueeze(dim), dim, index, index + 1)

    # Reductions of a 0-d tensor: torchlib's lowerings emit Reduce*/ArgMax with an axis,
    # which ONNX rejects on rank 0. Reducing a scalar over its only "dim" is the identity.
    def scalar_identity(x, *args, **kwargs):
        return x.clone() if x.dim() == 0 else NotImplemented

    def scalar_truth(x, *args, **kwargs):
        return x != 0 if x.dim() == 0 else NotImplemented

    def scalar_with_index(x, *args, **kwargs):
        if x.dim() != 0:
            return NotImplemented
        return x.clone(), torch.zeros((), dtype=torch.int64, device=x.device)

    for op in (aten.amax.default, aten.amin.default):
        table[op] = scalar_identity
    for op in (aten.all.dim, aten.any.dim, aten.all.dims, aten.any.dims):
        table[op] = scalar_truth
    for op in (aten.max.dim, aten.min.dim, aten.median.dim, aten.nanmedian.dim):
        table[op] = scalar_with_index

    # Scatter/gather on 0-d tensors (the backward of a 0-d max/min/median): ORT's
    # ScatterElements/GatherElements reject rank 0. With one element the index must be 0.
    @register(aten.scatter.src)
    def scatter_src_scalar(x, dim, index, src):
        return src.reshape([]).to(x.dtype).clone() if x.dim() == 0 else NotImplemented

    @register(aten.scatter.value)
    def scatter_value_scalar(x, dim, index, value):
        return torch.full_like(x, value) if x.dim() == 0 else NotImplemented

    @register(aten.scatter_add.default)
    def scatter_add_scalar(x, dim, index, src):
        return x + src.reshape([]).to(x.dtype) if x.dim() == 0 else NotImplemented

    # Accumulating writes: torchlib lowers them to ScatterND(reduction="add"), whose ORT CPU
    # kernel sums repeated indices from several threads without synchronization (measured on
    # onnxruntime 1.31: an embedding gradient off by 7%, differing run to run). ScatterElements
    # sums them correctly, so these become scatter_add (tests/test_op_gaps.py).
    @register(aten.index_put.default)
    @register(aten._unsafe_index_put.default)
    def index_put_accumulate(x, indices, values, accumulate=False):
        # Index tensors on adjacent dims p..p+k-1 (an embedding's rows; interpolate's and
        # grid_sample's backward) address one flattened dim: scatter_add along it.
        at = [d for d, i in enumerate(indices) if i is not None]
        if (not accumulate or not at or at != list(range(at[0], at[0] + len(at)))
                or any(indices[d].dtype in (torch.bool, torch.uint8) for d in at)):
            return NotImplemented
        p, k = at[0], len(at)
        lead, sizes, rest = x.shape[:p], x.shape[p:p + k], x.shape[p + k:]
        linear = 0
        for index, size in zip(torch.broadcast_tensors(*[indices[d] for d in at]), sizes):
            linear = linear * size + torch.where(index < 0, index + size, index)
        count = linear.numel()
        rows = values.expand(*lead, *linear.shape, *rest).reshape(*lead, count, *rest)
        spread = linear.reshape([1] * p + [count] + [1] * len(rest)).expand(rows.shape)
        flat = x.reshape(*lead, -1, *rest)
        return aten.scatter_add(flat, p, spread, rows.to(x.dtype)).reshape(x.shape)

    # An embedding's gradient as its rows added into zeros: one scatter_add, which the rewrite
    # makes one ScatterAddRowsToZeros kernel. torch's decomposition also bounds-checks, clamps
    # and wraps each index, 21 traced nodes per embedding (BERT's three: 6% of its joint graph,
    # traced at every first step); the forward's lookup has already refused an index out of range.
    @register(aten.embedding_dense_backward.default)
    def embedding_dense_backward(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq):
        compute = torch.float32 if grad_output.dtype in (torch.float16, torch.bfloat16) else grad_output.dtype
        rows = grad_output.to(compute).reshape(-1, grad_output.shape[-1])
        index = indices.reshape(-1, 1).to(torch.int64)
        if scale_grad_by_freq:  # each row times 1 / (how often its id occurs in the batch), as eager
            counts = rows.new_zeros(num_weights).scatter_add(0, index.reshape(-1), rows.new_ones(index.shape[0]))
            rows = rows * (1.0 / counts.gather(0, index.reshape(-1))).unsqueeze(-1)
        if padding_idx >= 0:
            rows = rows.masked_fill(index == padding_idx, 0)
        added = rows.new_zeros((num_weights, rows.shape[-1])).scatter_add(0, index.expand(rows.shape), rows)
        return added.to(grad_output.dtype)

    # Fake quantization (quantization-aware training) as eager's kernels compute it:
    # q = round_half_even(x * f32(1 / scale)) + zero_point, then (clamp(q) - zero_point) * scale
    # (float zero points and half inputs: that product in float64, as the kernels do), and the
    # mask of the q that needed no clamp, which the backward multiplies the gradient by.
    # torchlib lowers these through QuantizeLinear, which divides by the scale: other roundings.
    @register(aten.fake_quantize_per_tensor_affine_cachemask.default)
    def fake_quantize_per_tensor(x, scale, zero_point, quant_min, quant_max):
        scale = _f32(scale)  # the kernel's float scale, and its float reciprocal
        return _fake_quantized(x, scale, _f32(1.0 / scale), zero_point, quant_min, quant_max)

    @register(aten._fake_quantize_per_tensor_affine_cachemask_tensor_qparams.default)
    def fake_quantize_per_tensor_tensor_qparams(x, scale, zero_point, fake_quant_enabled, quant_min, quant_max):
        if zero_point.is_floating_point():
            return NotImplemented
        one = [1] * x.dim()  # broadcast over x (a 0-d view makes torchlib an empty shape attribute)
        scale = scale.reshape(one).to(torch.float32)
        out, mask = _fake_quantized(x, scale, 1.0 / scale, zero_point.reshape(one), quant_min, quant_max)
        disabled = fake_quant_enabled.reshape(one) == 0
        return torch.where(disabled, x, out), mask | disabled

    @register(aten.fake_quantize_per_channel_affine_cachemask.default)
    def fake_quantize_per_channel(x, scale, zero_point, axis, quant_min, quant_max):
        along = [1] * x.dim()
        along[axis] = -1
        scale = scale.to(torch.float32).reshape(along)
        return _fake_quantized(x, scale, 1.0 / scale, zero_point.reshape(along), quant_min, quant_max)

    # torch's decompositions of take and bucketize index a tensor with an index tensor as
    # Python does, and a 0-d index is then read on the host (``.item()``), which tracing with
    # fake tensors cannot follow: the whole graph ran in PyTorch. Index with a 1-d one instead.
    @register(aten.take.default)
    def take(x, index):
        return aten.index.Tensor(x.reshape(-1), [index.reshape(-1)]).reshape(index.shape)

    @register(aten.bucketize.Tensor)
    def bucketize(x, boundaries, *, out_int32=False, right=False):
        found = _torch_decompositions[aten.bucketize.Tensor](x.reshape(-1), boundaries, out_int32=out_int32,
                                                             right=right)
        return found.reshape(x.shape)

    # The target's one-hot as a comparison with the class numbers, not a scatter into zeros
    # (torch's decomposition): ORT folds those zeros into an initializer, [tokens, vocab]
    # floats kept for the life of the session, and the scatter writes a second copy. The
    # comparison's result fuses into the kernel that reads it. (The forward checked shapes.)
    @register(aten.nll_loss_backward.default)
    @register(aten.nll_loss2d_backward.default)
    def nll_loss_backward_one_hot(grad_output, x, target, weight, reduction, ignore_index, total_weight):
        channel_dim = 0 if x.dim() < 2 else 1
        if reduction == 1:  # mean
            grad_output = grad_output / total_weight
        if x.dim() == 1 and target.dim() > 0:
            target = target[0]  # as ATen's kernel: an unbatched input reads one target
        target = target.unsqueeze(channel_dim)
        kept = target != ignore_index
        classes = torch.arange(x.shape[channel_dim], device=x.device)
        classes = classes.reshape([-1] + [1] * (x.dim() - 1 - channel_dim))
        one_hot = classes == torch.where(kept, target, 0)
        grad_input = torch.where(one_hot, torch.full((), -1.0, dtype=x.dtype, device=x.device),
                                 torch.zeros((), dtype=x.dtype, device=x.device))
        if grad_input.dim() > grad_output.dim() > 0:
            grad_output = grad_output.unsqueeze(channel_dim)
        if weight is not None:
            shape = [1] * x.dim()
            shape[channel_dim] = weight.shape[0]
            grad_output = grad_output * weight.reshape(shape)
        return grad_input * torch.where(kept, grad_output, 0)

    # Zeros that name no tensor: ``new_zeros(grad, size)`` reads only the gradient's dtype, but
    # as a graph node it depends on it, so the backward's segments could not make the zeros
    # where they are first read (partition._place_constants_with_their_readers).
    @register(aten.new_zeros.default)
    def new_zeros_of_no_tensor(x, size, dtype=None, layout=None, device=None, pin_memory=None):
        return torch.zeros(size, dtype=dtype or x.dtype, device=device or x.device)

    @register(aten.index_add.default)
    def index_add_as_scatter_add(x, dim, index, source, alpha=1):
        if x.dim() == 0:
            return _torch_decompositions[aten.index_add.default](x, dim, index, source, alpha=alpha)
        dim = dim % x.dim()
        source = source * alpha if alpha != 1 else source
        spread = index.reshape([-1 if d == dim else 1 for d in range(x.dim())]).expand(source.shape)
        return aten.scatter_add(x, dim, spread, source)

    @register(aten.gather.default)
    def gather_scalar(x, dim, index, sparse_grad=False):
        return x.clone() if x.dim() == 0 else NotImplemented

    @register(aten.median.default)
    def median_all(x):
        # The lower of the two middle values, as torch.median; any NaN makes it NaN.
        flat = x.reshape(-1)
        if flat.is_floating_point():
            flat = torch.where(torch.isnan(flat).any(), torch.full_like(flat, float("nan")), flat)
        values = torch.sort(flat, stable=True)[0]
        return values[(flat.numel() - 1) // 2].clone()

    @register(aten.kthvalue.default)
    def kthvalue(x, k, dim=-1, keepdim=False):
        if x.dim() == 0:
            return x.clone(), torch.zeros((), dtype=torch.int64, device=x.device)
        values, indices = torch.sort(x, dim=dim, stable=True)
        values, indices = values.narrow(dim, k - 1, 1), indices.narrow(dim, k - 1, 1)
        if not keepdim:
            values, indices = values.squeeze(dim), indices.squeeze(dim)
        return values, indices

    def cumulative_extreme(x, dim, largest: bool):
        # values[i] = max/min(x[j] for j <= i), NaN once one occurred; index = the last j
        # reaching it (torch's ties).
        if x.dim() == 0:
            return x.clone(), torch.zeros((), dtype=torch.int64, device=x.device)
        moved = x.movedim(dim, -1)
        n = moved.shape[-1]
        idx = torch.arange(n, device=x.device)
        upto = idx[None, :] <= idx[:, None]  # (i, j): j <= i
        fill = float("-inf") if largest else float("inf")
        if not x.is_floating_point():
            info = torch.iinfo(x.dtype) if x.dtype != torch.bool else None
            fill = (info.min if largest else info.max) if info else (not largest)
        rows = torch.where(upto, moved.unsqueeze(-2), torch.full((), fill, dtype=x.dtype, device=x.device))
        values = rows.amax(-1) if largest else rows.amin(-1)
        reached = values.unsqueeze(-1)
        hit = rows == reached
        if x.is_floating_point():  # a NaN is the extreme from where it occurs: the last NaN's index
            hit = hit | (rows.isnan() & reached.isnan())
        hit = upto & hit
        indices = torch.where(hit, idx, torch.full((), -1, dtype=torch.int64, device=x.device)).amax(-1)
        return values.movedim(-1, dim), indices.movedim(-1, dim)

    @register(aten.cummax.default)
    def cummax(x, dim):
        return cumulative_extreme(x, dim, largest=True)

    @register(aten.cummin.default)
    def cummin(x, dim):
        return cumulative_extreme(x, dim, largest=False)

    @register(aten.fmax.default)
    def fmax(a, b):
        # max that ignores NaN (torch's decomposition ends in prims.fmax).
        return torch.where(torch.isnan(a), b, torch.where(torch.isnan(b), a, torch.maximum(a, b)))

    @register(aten.fmin.default)
    def fmin(a, b):
        return torch.where(torch.isnan(a), b, torch.where(torch.isnan(b), a, torch.minimum(a, b)))

    @register(aten.hypot.default)
    def hypot(a, b):
        # Scaled, so that squares neither overflow nor underflow; an infinite side wins over
        # NaN (IEEE hypot, as torch's).
        a, b = a.abs(), b.abs()
        high, low = torch.maximum(a, b), torch.minimum(a, b)
        ratio = torch.where(high == 0, torch.zeros_like(high), low / high)
        result = high * torch.sqrt(1 + ratio * ratio)
        return torch.where(torch.isinf(a) | torch.isinf(b), torch.full_like(result, float("inf")), result)

    for op in (aten.replication_pad1d_backward.default, aten.replication_pad2d_backward.default,
               aten.replication_pad3d_backward.default):
        table[op] = functools.partial(_replication_pad_backward, op)
    for op in (aten.reflection_pad1d_backward.default, aten.reflection_pad2d_backward.default,
               aten.reflection_pad3d_backward.default):
        table[op] = functools.partial(_reflection_pad_backward, op)
    table[aten.unfold_backward.default] = _unfold_backward
    for n in (1, 2, 3):
        forward = getattr(aten, f"upsample_nearest{n}d").default
        table[forward] = functools.partial(_upsample_nearest, forward)
        table[getattr(aten, f"upsample_nearest{n}d_backward").default] = _upsample_nearest_backward
    for name in ("upsample_linear1d", "upsample_bilinear2d", "upsample_trilinear3d"):
        forward = getattr(aten, name).default
        table[forward] = functools.partial(_upsample_linear, forward)
        table[getattr(aten, f"{name}_backward").default] = _upsample_linear_backward

    if aten.max_pool2d_with_indices_backward.default not in _torch_decompositions:
        # torch 2.13 decomposes it as this scatter-add over each plane; torch 2.11 has no
        # decomposition, and the op, which torchlib cannot lower, fell back to PyTorch.
        @register(aten.max_pool2d_with_indices_backward.default)
        def max_pool2d_backward(grad, x, kernel_size, stride, padding, dilation, ceil_mode, indices):
            return _max_pool_indices_backward(grad, x, indices, 2)

    @register(aten.max_pool3d_with_indices_backward.default)
    def max_pool3d_backward(grad, x, kernel_size, stride, padding, dilation, ceil_mode, indices):
        # indices are flat positions in each (D*H*W) plane: scatter the gradient there.
        spatial = 3
        lead = x.shape[:-spatial]
        flat_grad = grad.reshape(*lead, -1)
        flat_index = indices.reshape(*lead, -1)
        plane = torch.zeros(*lead, x.shape[-3] * x.shape[-2] * x.shape[-1], dtype=grad.dtype,
                            device=grad.device)
        return plane.scatter_add(-1, flat_index, flat_grad).reshape(x.shape)

    @register(aten.index_reduce.default)
    def index_reduce(x, dim, index, source, reduce, include_self=True):
        # index_reduce along dim == scatter_reduce with the index broadcast over the other dims.
        if x.dim() == 0:  # as a 1-element vector: scatter ops reject rank 0
            return index_reduce(x.reshape(1), 0, index.reshape(1), source.reshape(1), reduce,
                                include_self).reshape([])
        shape = [1] * source.dim()
        shape[dim] = -1
        spread = index.reshape(shape).expand(source.shape)
        return aten.scatter_reduce.two(x, dim, spread, source, reduce, include_self=include_self)

    @register(aten.cumprod.default)
    def cumprod(x, dim, dtype=None):
        # out[i] = prod(x[j] for j <= i) as one masked product over an (n, n) expansion;
        # torch's decomposition ends in prims.prod, which nothing lowers.
        if dtype is not None:
            x = x.to(dtype)
        if x.dim() == 0:
            return x.clone()
        moved = x.movedim(dim, -1)
        n = moved.shape[-1]
        idx = torch.arange(n, device=x.device)
        upto = idx[None, :] <= idx[:, None]  # (i, j): j <= i
        terms = torch.where(upto, moved.unsqueeze(-2), torch.ones((), dtype=x.dtype, device=x.device))
        return aten.prod.dim_int(terms, -1, False).movedim(-1, dim)

    @register(aten.prod.default)
    def prod_all(x, dtype=None):
        # torch's own decomposition ends in prims.prod, which nothing lowers.
        if dtype is None:
            dtype = x.dtype if x.is_floating_point() else torch.int64
        return aten.prod.dim_int(x.reshape(-1), 0, False, dtype=dtype)

    @register(aten.prod.dim_int)
    def prod_of_scalar(x, dim, keepdim=False, dtype=None):
        if x.dim() != 0:
            return NotImplemented
        if dtype is None:  # integral products accumulate in int64, as torch.prod does
            dtype = x.dtype if x.is_floating_point() else torch.int64
        return x.to(dtype).clone()

    @register(aten.linalg_vector_norm.default)
    def norm_of_scalar(x, ord=2, dim=None, keepdim=False, dtype=None):
        if x.dim() != 0:
            return NotImplemented
        result = (x != 0).to(x.dtype) if ord == 0 else x.abs()
        return result.to(dtype) if dtype is not None else result

    @register(aten.value_selecting_reduction_backward.default)
    def value_selecting_reduction_backward(grad, dim, indices, sizes, keepdim):
        if len(sizes) == 0:
            return grad.reshape([])
        return _torch_decompositions[aten.value_selecting_reduction_backward.default](
            grad, dim, indices, sizes, keepdim)

    @register(aten.scatter_reduce.two)
    def scatter_reduce_mean(x, dim, index, src, reduce, include_self=True):
        # torchlib's "mean" averages wrongly where include_self=False; sum / count instead.
        if reduce != "mean":
            return NotImplemented
        base = x if include_self else torch.zeros_like(x)
        total = aten.scatter_reduce(base, dim, index, src, "sum", include_self=True)
        count = aten.scatter_reduce(torch.ones_like(x) if include_self else torch.zeros_like(x), dim,
                                    index, torch.ones_like(src), "sum", include_self=True)
        safe = count.clamp(min=1)
        mean = total / safe if x.is_floating_point() else torch.div(total, safe, rounding_mode="floor")
        return torch.where(count > 0, mean, x)

    @register(aten.diagonal_scatter.default)
    def diagonal_scatter(x, src, offset=0, dim1=0, dim2=1):
        # torch's decomposition copies into a diagonal view (not functional): select by mask.
        moved = x.movedim((dim1, dim2), (-2, -1))
        rows, cols = moved.shape[-2], moved.shape[-1]
        r = torch.arange(rows, device=x.device)[:, None]
        c = torch.arange(cols, device=x.device)[None, :]
        on_diagonal = (c - r) == offset
        length = src.shape[-1]
        # Element (r, c) of the diagonal is src[..., c - max(offset, 0)].
        pick = (torch.arange(cols, device=x.device) - max(offset, 0)).clamp(0, max(length - 1, 0))
        spread = src.index_select(-1, pick).unsqueeze(-2) if length else torch.zeros_like(moved)
        return torch.where(on_diagonal, spread, moved).movedim((-2, -1), (dim1, dim2))

    @register(aten.as_strided_scatter.default)
    def as_strided_scatter(x, src, size, stride, storage_offset=None):
        # Functional graphs scatter into a fresh, contiguous base: index its flat storage.
        index = _strided_indices(size, stride, storage_offset or 0, x.device)
        flat = x.contiguous().reshape(-1)
        return flat.scatter(0, index.reshape(-1), src.expand(list(size)).reshape(-1)).reshape(x.shape)

    @register(torch.ops.prims.fma.default)
    def fma(a, b, c):
        # addcmul's decomposition emits prims.fma (compiled Adam/AdamW); ONNX has no FMA.
        return a * b + c

    # ---- op gaps: ops with no torchlib lowering and no usable torch decomposition ----------

    @register(aten._efficientzerotensor.default)
    def efficient_zero_tensor(size, dtype=None, layout=None, device=None, pin_memory=None):
        # sgn's backward of a real input: a plain zero tensor (no "zero tensor" in ONNX).
        return torch.zeros(size, dtype=dtype, device=device)

    @register(aten.empty_permuted.default)
    def empty_permuted(size, physical_layout, dtype=None, layout=None, device=None, pin_memory=None):
        physical = torch.empty([size[p] for p in physical_layout], dtype=dtype, device=device)
        inverse = [0] * len(physical_layout)
        for i, p in enumerate(physical_layout):
            inverse[p] = i
        return physical.permute(inverse)

    @register(aten.searchsorted.Tensor)
    def searchsorted(sorted_sequence, values, *, out_int32=False, right=False, side=None, sorter=None):
        boundaries = sorted_sequence if sorter is None else sorted_sequence.gather(-1, sorter)
        found = _binary_search(boundaries, values, right or side == "right")
        return found.to(torch.int32) if out_int32 else found

    @register(aten.put.default)
    def put(x, index, source, accumulate=False):
        # put indexes x as if flat; negative indices count from the end (take's backward).
        flat = x.reshape(-1)
        index = index.reshape(-1)
        index = torch.where(index < 0, index + flat.shape[0], index)
        return flat.index_put((index,), source.reshape(-1), accumulate).reshape(x.shape)

    @register(aten._trilinear.default)
    def trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim=1):
        # F.bilinear: each input lacks its "expand" dims; the product is summed over sumdim.
        total = i1.dim() + len(expand1)
        letters = "abcdefghijklmnopqrstuvwxyz"[:total]

        def subscript(expand):
            return "".join(letters[d] for d in range(total) if d not in expand)

        present = set(subscript(expand1) + subscript(expand2) + subscript(expand3))
        kept = [d for d in range(total) if d not in sumdim]
        out = "".join(letters[d] for d in kept if letters[d] in present)
        result = torch.einsum(f"{subscript(expand1)},{subscript(expand2)},{subscript(expand3)}->{out}",
                              i1, i2, i3)
        for position, d in enumerate(kept):  # dims no input has: size 1
            if letters[d] not in present:
                result = result.unsqueeze(position)
        return result

    @register(aten._cdist_forward.default)
    def cdist_forward(x1, x2, p, compute_mode=None):
        r1, r2 = x1.shape[-2], x2.shape[-2]
        # The matmul form eager uses for p=2 on larger inputs (compute_mode 0/None: "if
        # necessary", 1: always, 2: never), so rounding near zero distance matches.
        if p == 2 and (compute_mode == 1 or (compute_mode in (None, 0) and (r1 > 25 or r2 > 25))):
            x1_norm = x1.pow(2).sum(-1, keepdim=True)
            x2_norm = x2.pow(2).sum(-1, keepdim=True)
            left = torch.cat([x1 * -2, x1_norm, torch.ones_like(x1_norm)], -1)
            right = torch.cat([x2, torch.ones_like(x2_norm), x2_norm], -1)
            return left.matmul(right.transpose(-2, -1)).clamp_min(0).sqrt()
        return _pnorm(x1.unsqueeze(-2) - x2.unsqueeze(-3), p)

    @register(aten._cdist_backward.default)
    def cdist_backward(grad, x1, x2, p, cdist):
        diff = x1.unsqueeze(-2) - x2.unsqueeze(-3)
        partial = _pnorm_backward(diff, grad.unsqueeze(-1), cdist.unsqueeze(-1), p).sum(-2)
        return partial.sum_to_size(x1.shape) if partial.shape != x1.shape else partial

    def pdist_pairs(n, device):
        # (i, j) for i < j in row-major order; torch.triu_indices' decomposition does not export.
        k = torch.arange(n * (n - 1) // 2, device=device)
        r = torch.arange(n, device=device)
        row_start = r * n - r * (r + 1) // 2  # position of pair (r, r + 1)
        i = (row_start[None, :] <= k[:, None]).sum(-1) - 1
        return i, k - row_start[i] + i + 1

    @register(aten._pdist_forward.default)
    def pdist_forward(x, p=2):
        if x.shape[0] < 2:  # no pairs
            return torch.zeros(0, dtype=x.dtype, device=x.device)
        i, j = pdist_pairs(x.shape[0], x.device)
        return _pnorm(x[i] - x[j], p)

    @register(aten._pdist_backward.default)
    def pdist_backward(grad, x, p, pdist):
        if x.shape[0] < 2:
            return torch.zeros_like(x)
        i, j = pdist_pairs(x.shape[0], x.device)
        part = _pnorm_backward(x[i] - x[j], grad.unsqueeze(-1), pdist.unsqueeze(-1), p)
        return torch.zeros_like(x).index_add(0, i, part).index_add(0, j, -part)

    @register(aten.adaptive_max_pool2d.default)
    def adaptive_max_pool2d(x, output_size):
        return _adaptive_max_pool(x, list(output_size))

    @register(aten.adaptive_max_pool3d.default)
    def adaptive_max_pool3d(x, output_size):
        return _adaptive_max_pool(x, list(output_size))

    @register(aten.adaptive_max_pool2d_backward.default)
    def adaptive_max_pool2d_backward(grad, x, indices):
        return _max_pool_indices_backward(grad, x, indices, 2)

    @register(aten.adaptive_max_pool3d_backward.default)
    def adaptive_max_pool3d_backward(grad, x, indices):
        return _max_pool_indices_backward(grad, x, indices, 3)

    def embedding_bag(weight, indices, offsets, scale_grad_by_freq=False, mode=0, sparse=False,
                      per_sample_weights=None, include_last_offset=False, padding_idx=-1):
        # torchlib's lowering returns placeholder offset2bag/bag_size/max_indices, which the
        # backward reads: computed here as eager does (padding entries count in no bag).
        n, dim = indices.shape[0], weight.shape[1]
        bags = offsets.shape[0] - (1 if include_last_offset else 0)
        position = torch.arange(n, device=indices.device)
        bag = (offsets[:bags][None, :] <= position[:, None]).sum(-1) - 1  # the last bag runs to the end
        keep = indices != padding_idx if padding_idx >= 0 else torch.ones_like(indices, dtype=torch.bool)
        rows = weight[indices]
        if per_sample_weights is not None:
            rows = rows * per_sample_weights[:, None].to(rows.dtype)
        counts = torch.zeros(bags, dtype=torch.int64, device=indices.device).index_add(
            0, bag, keep.to(torch.int64))
        zeros = torch.zeros(bags, dim, dtype=weight.dtype, device=weight.device)
        nonempty = (counts > 0)[:, None]
        if mode == 2:
            spread = bag[:, None].expand(n, dim)
            low = torch.full((), float("-inf"), dtype=weight.dtype, device=weight.device)
            best = torch.full_like(zeros, float("-inf")).scatter_reduce(
                0, spread, torch.where(keep[:, None], rows, low), "amax", include_self=True)
            hit = keep[:, None] & (rows == best[bag])  # the first position holding the max wins
            first = torch.full((bags, dim), n, dtype=torch.int64, device=indices.device).scatter_reduce(
                0, spread, torch.where(hit, position[:, None], n), "amin", include_self=True)
            max_indices = torch.where(nonempty, indices[first.clamp(max=max(n - 1, 0))], 0) if n else \
                torch.zeros((bags, dim), dtype=torch.int64, device=indices.device)
            out = torch.where(nonempty, best, zeros)
        else:
            out = zeros.index_add(0, bag, torch.where(keep[:, None], rows, torch.zeros_like(rows)))
            if mode == 1:
                out = out / counts.clamp(min=1)[:, None].to(out.dtype)
            max_indices = counts.clone() if mode == 1 else torch.zeros_like(counts)
        bag_size = counts if mode != 0 else torch.zeros_like(counts)
        # Eager leaves offset2bag empty in sum mode without padding_idx (the backward rebuilds it).
        offset2bag = bag if (mode != 0 or padding_idx >= 0) else bag.new_zeros(0)
        index_dtype = indices.dtype
        return (out, offset2bag.to(index_dtype), bag_size.to(index_dtype), max_indices.to(index_dtype))

    table[aten._embedding_bag.default] = embedding_bag
    table[aten._embedding_bag_forward_only.default] = embedding_bag

    @register(aten._embedding_bag_backward.default)
    def embedding_bag_backward(grad, indices, offsets, offset2bag, bag_size, maximum_indices, num_weights,
                               scale_grad_by_freq, mode, sparse, per_sample_weights=None, padding_idx=-1):
        if sparse:
            return NotImplemented  # a sparse gradient: stays in PyTorch
        if indices.numel() != 0 and offset2bag.numel() == 0:  # eager's forward skipped it
            offset2bag = _offset2bag(indices, offsets)
        return _embedding_bag_dense_backward(grad, indices, offset2bag, bag_size, maximum_indices,
                                             num_weights, scale_grad_by_freq, mode, per_sample_weights,
                                             padding_idx)

    table[aten._embedding_bag_dense_backward.default] = _embedding_bag_dense_backward

    @register(aten._embedding_bag_per_sample_weights_backward.default)
    def embedding_bag_per_sample_weights_backward(grad, weight, indices, offsets, offset2bag, mode,
                                                  padding_idx=-1):
        if indices.numel() != 0 and offset2bag.numel() == 0:
            offset2bag = _offset2bag(indices, offsets)
        dots = (grad[offset2bag] * weight[indices]).sum(-1)
        return torch.where(indices == padding_idx, torch.zeros_like(dots), dots) if padding_idx >= 0 else dots

    @register(aten.masked_scatter_backward.default)
    def masked_scatter_backward(grad, mask, sizes):
        # The source's gradient: grad at the masked positions, in order, then zeros.
        grad, mask = torch.broadcast_tensors(grad, mask)
        flat_grad, flat_mask = grad.reshape(-1), mask.reshape(-1)
        numel = 1
        for s in sizes:
            numel *= s
        slot = torch.cumsum(flat_mask.to(torch.int64), 0) - 1
        target = torch.where(flat_mask, slot, numel)  # unmasked ones go to a spare slot
        out = torch.zeros(numel + 1, dtype=grad.dtype, device=grad.device).scatter_add(0, target, flat_grad)
        return out[:numel].reshape(sizes)

    @register(aten.rrelu_with_noise_functional.default)
    def rrelu_with_noise_functional(x, noise, lower=0.125, upper=1.0 / 3.0, training=False, generator=None):
        if not training:
            return torch.where(x >= 0, x, x * ((lower + upper) / 2)), noise.clone()
        # Random slopes are drawn by ORT (RandomUniformLike): same distribution, other values.
        slope = lower + (upper - lower) * torch.rand_like(x)
        new_noise = torch.where(x <= 0, slope, torch.ones_like(x))
        return x * new_noise, new_noise.to(noise.dtype)

    @register(aten.uniform.default)
    def uniform(x, low=0.0, high=1.0, generator=None):
        return low + (high - low) * torch.rand_like(x)  # ORT's RNG (RandomUniformLike)

    def nan_last_order(moved):
        # Stable ascending order with every NaN after every number (+inf included).
        if not moved.is_floating_point():
            return torch.sort(moved, dim=-1, stable=True)[1]
        isnan = torch.isnan(moved)
        key = torch.where(isnan, torch.full((), float("inf"), dtype=moved.dtype, device=moved.device), moved)
        first = torch.sort(key, dim=-1, stable=True)[1]
        second = torch.sort(isnan.gather(-1, first).to(moved.dtype), dim=-1, stable=True)[1]
        return first.gather(-1, second)

    @register(aten.nanmedian.default)
    def nanmedian_all(x):
        flat = x.reshape(-1)
        if not flat.is_floating_point():
            return median_all(x)
        order = nan_last_order(flat)
        count = (~torch.isnan(flat)).sum()
        k = ((count - 1).clamp(min=0) // 2).reshape(1)
        return flat[order[k]].reshape([])  # NaN where everything is NaN

    @register(aten.nanmedian.dim)
    def nanmedian_dim(x, dim=-1, keepdim=False):
        if x.dim() == 0:
            return x.clone(), torch.zeros((), dtype=torch.int64, device=x.device)
        moved = x.movedim(dim, -1)
        order = nan_last_order(moved)
        count = (~torch.isnan(moved)).sum(-1, keepdim=True) if x.is_floating_point() else None
        if count is None:
            k = torch.full(moved.shape[:-1] + (1,), (moved.shape[-1] - 1) // 2, dtype=torch.int64,
                           device=x.device)
        else:
            k = (count - 1).clamp(min=0) // 2
        indices = order.gather(-1, k)
        values = moved.gather(-1, indices)
        values, indices = values.movedim(-1, dim), indices.movedim(-1, dim)
        if not keepdim:
            values, indices = values.squeeze(dim), indices.squeeze(dim)
        return values, indices

    @register(aten.mode.default)
    def mode(x, dim=-1, keepdim=False):
        # Eager sorts, then keeps the first longest run of equal values (so ties take the
        # smallest value) and reports the last position of that value (small inputs; larger
        # ones may report any of its positions; with NaNs eager's order is undefined). Run
        # lengths come from binary searches.
        if x.dim() == 0:
            return x.clone(), torch.zeros((), dtype=torch.int64, device=x.device)
        moved = x.movedim(dim, -1)
        values, order = torch.sort(moved, dim=-1, stable=True)
        first = _binary_search(values, values, right=False)
        end = _binary_search(values, values, right=True)
        run = end - first
        slot = torch.arange(moved.shape[-1], device=x.device)
        longest = run.amax(-1, keepdim=True)
        pick = torch.where(run == longest, slot, moved.shape[-1]).amin(-1, keepdim=True)
        value = values.gather(-1, pick)
        index = order.gather(-1, end.gather(-1, pick) - 1)
        value, index = value.movedim(-1, dim), index.movedim(-1, dim)
        if not keepdim:
            value, index = value.squeeze(dim), index.squeeze(dim)
        return value, index

    @register(aten._upsample_bilinear2d_aa.default)
    def upsample_bilinear2d_aa(x, output_size, align_corners, scales_h=None, scales_w=None):
        # torchlib's lowering differs from eager with align_corners=True or explicit scales.
        out = x
        for axis, scale in ((2, scales_h), (3, scales_w)):
            m = _antialias_matrix(x.shape[axis], output_size[axis - 2], align_corners, scale, x)
            out = (out.movedim(axis, -1).unsqueeze(-2) * m).sum(-1).movedim(-1, axis)
        return out

    @register(aten._upsample_bilinear2d_aa_backward.default)
    def upsample_bilinear2d_aa_backward(grad, output_size, input_size, align_corners, scales_h=None,
                                        scales_w=None):
        # The forward is a weighted sum per dim: the backward applies the transposed weights.
        out = grad
        for axis, scale in ((2, scales_h), (3, scales_w)):
            m = _antialias_matrix(input_size[axis], output_size[axis - 2], align_corners, scale, grad)
            out = (out.movedim(axis, -1).unsqueeze(-1) * m).sum(-2).movedim(-1, axis)
        return out

    def histogram(x, edges, weight, density):
        # Bin = last edge <= value (the last bin also takes the right edge); values outside the
        # edges, and NaN, are not counted: eager's upper_bound search.
        flat = x.reshape(-1)
        bins = edges.shape[0] - 1
        pos = _binary_search(edges, flat, right=True) - 1
        pos = torch.where(pos == bins, bins - 1, pos).clamp(0, bins - 1)
        inside = (flat >= edges[0]) & (flat <= edges[-1])
        w = weight.reshape(-1).to(x.dtype) if weight is not None else torch.ones_like(flat)
        hist = torch.zeros(bins, dtype=x.dtype, device=x.device).index_add(
            0, pos, torch.where(inside, w, torch.zeros_like(w)))
        if density:
            hist = hist / (hist.sum() * (edges[1:] - edges[:-1]))
        return hist, edges

    @register(aten.histogram.bins_tensor)
    def histogram_bins_tensor(x, bins, *, weight=None, density=False):
        return histogram(x, bins.to(x.dtype), weight, density)

    @register(aten.histogram.bin_ct)
    def histogram_bin_ct(x, bins=100, *, range=None, weight=None, density=False):
        if range is not None:
            low = torch.full((), range[0], dtype=x.dtype, device=x.device)
            high = torch.full((), range[1], dtype=x.dtype, device=x.device)
        elif x.numel() == 0:
            low = torch.zeros((), dtype=x.dtype, device=x.device)
            high = torch.ones((), dtype=x.dtype, device=x.device)
        else:
            low, high = x.min(), x.max()
        same = low == high  # widened by 0.5 either side, as numpy does
        low, high = torch.where(same, low - 0.5, low), torch.where(same, high + 0.5, high)
        # eager's linspace: from the start for the first half, from the end for the rest
        i = torch.arange(bins + 1, device=x.device)
        step = (high - low) / bins
        edges = torch.where(i < (bins + 1) // 2, low + step * i.to(x.dtype),
                            high - step * (bins - i).to(x.dtype))
        return histogram(x, edges, weight, density)

    @register(aten.median.dim)
    def median_dim(x, dim=-1, keepdim=False):
        # The lower middle value; a slice with a NaN gives its first NaN (value and index).
        if x.dim() == 0:
            return x.clone(), torch.zeros((), dtype=torch.int64, device=x.device)
        moved = x.movedim(dim, -1)
        n = moved.shape[-1]
        order = nan_last_order(moved)
        indices = order[..., (n - 1) // 2:(n - 1) // 2 + 1]
        if x.is_floating_point():
            isnan = torch.isnan(moved)
            first_nan = torch.where(isnan, torch.arange(n, device=x.device), n).amin(-1, keepdim=True)
            indices = torch.where(first_nan < n, first_nan, indices)
        values = moved.gather(-1, indices)
        values, indices = values.movedim(-1, dim), indices.movedim(-1, dim)
        if not keepdim:
            values, indices = values.squeeze(dim), indices.squeeze(dim)
        return values, indices

    def segment_bounds(lengths, offsets):
        if offsets is not None:
            return offsets[:-1], offsets[1:]
        ends = torch.cumsum(lengths, 0)
        return ends - lengths, ends

    def reduce_identity(reduce, initial):
        if initial is not None:
            return float(initial)
        return {"max": float("-inf"), "min": float("inf"), "prod": 1.0}.get(reduce, 0.0)

    @register(aten.segment_reduce.default)
    def segment_reduce(data, reduce, *, lengths=None, indices=None, offsets=None, axis=0, unsafe=False,
                       initial=None):
        # Eager's CPU loop: start from `initial` (or the reduction's identity); max/min keep a
        # NaN once seen; an empty segment's mean is NaN unless `initial` is given.
        bounds = offsets if offsets is not None else lengths
        if bounds is None or bounds.dim() != 1 or indices is not None:
            return NotImplemented  # batched lengths/offsets stay in PyTorch
        start, end = segment_bounds(lengths, offsets)
        x = data.movedim(axis, -1).unsqueeze(-2)  # (..., 1, n)
        pos = torch.arange(x.shape[-1], device=data.device)
        member = (pos >= start[:, None]) & (pos < end[:, None])  # (segments, n)
        init = reduce_identity(reduce, initial)
        fill = torch.full((), init if reduce in ("max", "min") else (1.0 if reduce == "prod" else 0.0),
                          dtype=data.dtype, device=data.device)
        picked = torch.where(member, x, fill)
        if reduce in ("sum", "mean"):
            out = picked.sum(-1) + init
            if reduce == "mean":
                size = (end - start).to(data.dtype)
                out = torch.where(size > 0, out / size.clamp(min=1),
                                  out if initial is not None else torch.full_like(out, float("nan")))
        elif reduce == "prod":
            out = aten.prod.dim_int(picked, -1) * init
        else:
            out = picked.amax(-1) if reduce == "max" else picked.amin(-1)
            out = torch.maximum(out, fill) if reduce == "max" else torch.minimum(out, fill)
            has_nan = (member & torch.isnan(x)).any(-1)
            out = torch.where(has_nan, torch.full_like(out, float("nan")), out)
        return out.movedim(-1, axis)

    @register(aten._segment_reduce_backward.default)
    def segment_reduce_backward(grad, output, data, reduce, *, lengths=None, offsets=None, axis=0,
                                initial=None):
        bounds = offsets if offsets is not None else lengths
        if bounds is None or bounds.dim() != 1:
            return NotImplemented
        start, end = segment_bounds(lengths, offsets)
        x = data.movedim(axis, -1)  # (..., n)
        n = x.shape[-1]
        pos = torch.arange(n, device=data.device)
        member = (pos >= start[:, None]) & (pos < end[:, None])  # (segments, n)
        zero = torch.zeros((), dtype=grad.dtype, device=grad.device)

        def spread(per_segment):  # (..., segments) -> (..., n): each element's segment value
            return torch.where(member, per_segment.movedim(axis, -1).unsqueeze(-1), zero).sum(-2)

        g = spread(grad)
        if reduce == "mean":
            g = spread(grad / (end - start).clamp(min=1).to(grad.dtype).reshape(
                [-1] + [1] * (grad.dim() - 1 - axis)))
        elif reduce in ("max", "min"):
            hit = torch.isnan(x) | (x == spread(output))
            g = torch.where(hit, g, zero)
            count = (member & hit.unsqueeze(-2)).sum(-1, keepdim=True)  # (..., S, 1)
            count = torch.where(member, count, 0).sum(-2)  # per element
            # eager divides only positive gradients among tied extremes
            g = torch.where((count >= 2) & (g > 0), g / count.clamp(min=1).to(g.dtype), g)
        elif reduce == "prod":
            out = spread(output)
            same = member.unsqueeze(-1) & member.unsqueeze(-2)  # (S, n, n): j, k share segment s
            same = same.any(0) & ~torch.eye(n, dtype=torch.bool, device=data.device)
            others = aten.prod.dim_int(torch.where(same, x.unsqueeze(-2), torch.ones((), dtype=x.dtype,
                                                                                       device=x.device)), -1)
            exclusive = g * others * reduce_identity(reduce, initial)
            g = torch.where(torch.isnan(x) | (x == 0), exclusive, g * out / x)
        elif reduce != "sum":
            return NotImplemented
        return g.movedim(-1, axis)

    @register(aten.nonzero_static.default)
    def nonzero_static(x, *, size, fill_value=-1):
        # The first `size` non-zero coordinates in row-major order, padded with fill_value.
        flat = (x != 0).reshape(-1)
        n = flat.shape[0]
        if n == 0:
            return torch.full((size, x.dim()), fill_value, dtype=torch.int64, device=x.device)
        slot = torch.cumsum(flat.to(torch.int64), 0) - 1
        target = torch.where(flat & (slot < size), slot, size)  # the rest go to a spare slot
        position = torch.full((size + 1,), n, dtype=torch.int64, device=x.device).scatter_reduce(
            0, target, torch.arange(n, device=x.device), "amin", include_self=True)[:size]
        coords = []
        stride = n
        for s in x.shape:
            stride //= s
            coords.append((position // stride) % s)
        found = torch.stack(coords, -1) if coords else position.new_zeros((size, 0))
        valid = (torch.arange(size, device=x.device) < flat.sum())[:, None]
        return torch.where(valid, found, torch.full((), fill_value, dtype=torch.int64, device=x.device))

    return table


def _select_backward_as_where(grad, input_sizes, dim, index):
    """``select_backward`` as an elementwise Where against the selected row: one pass that the
    pointwise kernels fuse with the sum of a split's gradients (torchtune's interleaved RoPE:
    ``x.reshape(..., -1, 2)[..., 0]`` and ``[..., 1]``), where ORT's Pad along an axis of 2 is
    four times slower. Without those kernels ORT's broadcasting Where is the slower one."""
    row = _row(input_sizes, dim, index)
    if row is None:
        return own_decompositions()[aten.select_backward.default](grad, input_sizes, dim, index)
    dim, size, index = row
    row = torch.arange(size, device=grad.device).view([size if d == dim else 1 for d in range(len(input_sizes))])
    return torch.where(row == index, grad.unsqueeze(dim), torch.zeros((), dtype=grad.dtype, device=grad.device))


def _strided_slice_backward_as_where(grad, input_sizes, dim, start, end, step):
    """The backward of ``x[..., start::step]`` over the whole dim (GPT-J's interleaved rotary
    reads ``x[..., ::2]`` and ``x[..., 1::2]``): each gradient element a row of ``step``, the
    element where ``start`` is and zeros elsewhere, read back as the dim. Other slices as before."""
    every = _every_step(input_sizes, dim, start, end, step)
    if every is None:
        return own_decompositions()[aten.slice_backward.default](grad, input_sizes, dim, start, end, step)
    dim, start = every
    rows = _select_backward_as_where(grad, [*grad.shape[:dim + 1], step, *grad.shape[dim + 1:]], dim + 1, start)
    return rows.flatten(dim, dim + 1)


def _every_step(sizes, dim, start, end, step):
    """(dim, start) of a static slice ``start::step`` (step > 1) that takes one element of every
    run of ``step`` along the whole dim; None otherwise."""
    dim = dim % len(sizes)
    size = sizes[dim]
    if not all(isinstance(v, int) for v in (size, step, start or 0, end if end is not None else 0)):
        return None
    first, stop, stride = slice(start, end, step).indices(size)
    if stride < 2 or size % stride or not 0 <= first < stride or len(range(first, stop, stride)) != size // stride:
        return None
    return dim, first


@functools.lru_cache(None)
def product_decompositions() -> dict:
    """Replacements for ``own_decompositions`` entries where the CPU kernels include products of
    their own (csrc/bf16_gemm.h's float32 blocking: ``_kernels.float32_products``)."""
    return {aten.convolution_backward.default: _convolution_backward(own_product=True)}


@functools.lru_cache(None)
def pointwise_decompositions() -> dict:
    """Replacements for ``own_decompositions`` entries where the graph's elementwise chains will
    become generated kernels (CPU, a C compiler, ``pointwise_kernels``)."""
    return {aten.select_backward.default: _select_backward_as_where,
            aten.slice_backward.default: _strided_slice_backward_as_where}
