"""Our decompositions: ops torch has no (ONNX-friendly) decomposition for, written in ops
torchlib lowers. Used by ``lower.decomposition_table``; one function per op, each small."""

from __future__ import annotations

import functools

import torch
from torch._decomp import decomposition_table as _torch_decompositions

aten = torch.ops.aten

__all__ = ["own_decompositions"]


# ---- decompositions torch lacks -------------------------------------------------------------


def _conv_weight_grad(inp, grad_out, weight_shape, stride, padding, dilation, groups):
    """dL/dW of a (non-transposed) convolution, as one grouped convolution."""
    n = inp.shape[0]
    spatial = len(weight_shape) - 2
    cin_g = inp.shape[1] // groups
    # Input channels become the batch, batch x groups the channels.
    x = inp.transpose(0, 1).reshape(groups, cin_g, n, *inp.shape[2:]).transpose(0, 1)
    x = x.reshape(cin_g, groups * n, *inp.shape[2:])
    gy = grad_out.transpose(0, 1)  # (groups * cout_g, n, ...)
    grad = aten.convolution(x, gy, None, dilation, padding, stride, False, [0] * spatial, groups)
    grad = grad.transpose(0, 1)  # (cout, cin_g, k...)
    for dim, size in enumerate(weight_shape[2:]):
        grad = grad.narrow(dim + 2, 0, size)
    return grad


def _pool_geometry(size: int, k: int, s: int, p: int, ceil_mode: bool) -> tuple[int, int]:
    """PyTorch's pooling output length, and the zeros ceil mode adds past the right padding."""
    out = (size + 2 * p - k + (s - 1 if ceil_mode else 0)) // s + 1
    if ceil_mode and (out - 1) * s >= size + p:
        out -= 1
    return out, max(0, (out - 1) * s + k - (size + 2 * p))


def _avg_pool_parts(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    """Average pooling as a ones-kernel convolution over an explicitly padded input.

    Returns ``(x_padded, kernel, stride, divisor, pads)`` with ``x`` reshaped to (N*C, 1, *S):
    the pooled sum is ``conv(x_padded, kernel, stride)`` and the average that over ``divisor``
    (a per-window count, or the override). Used where torchlib has nothing: the backward,
    and ``divisor_override`` (which torchlib's lowering ignores).
    """
    spatial = len(kernel_size) if len(kernel_size) > 1 else x.dim() - 2
    ks = list(kernel_size) * (spatial if len(kernel_size) == 1 else 1)
    st = list(stride or ks)
    st = st * (spatial if len(st) == 1 else 1)
    pd = list(padding) * (spatial if len(padding) == 1 else 1)
    sizes = list(x.shape[-spatial:])
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
    x_padded, kernel, st, divisor, (pd, sizes, spatial) = _avg_pool_parts(
        x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)
    g = grad_out.reshape(-1, 1, *grad_out.shape[-spatial:]) / divisor
    # The transposed conv spreads each window's gradient back; output_padding covers the
    # rows past the last window (always < stride).
    out_pad = [x_padded.shape[2 + i] - ((g.shape[2 + i] - 1) * st[i] + kernel.shape[2 + i])
               for i in range(spatial)]
    grad_padded = aten.convolution(g, kernel, None, st, [0] * spatial, [1] * spatial, True, out_pad, 1)
    grad = grad_padded
    for i in range(spatial):
        grad = grad.narrow(2 + i, pd[i], sizes[i])
    return grad.reshape(x.shape)


def _adaptive_matrix(in_size: int, out_size: int, like):
    """(out, in) averaging matrix of adaptive pooling along one dim, built from traced ops."""
    i = torch.arange(out_size, device=like.device)
    start = (i * in_size) // out_size
    end = ((i + 1) * in_size + out_size - 1) // out_size
    j = torch.arange(in_size, device=like.device)
    inside = (j[None, :] >= start[:, None]) & (j[None, :] < end[:, None])
    return inside.to(like.dtype) / (end - start).to(like.dtype)[:, None]


def _adaptive_avg_pool(x, output_size):
    spatial = len(output_size)
    out = x
    for d in range(spatial):
        axis = x.dim() - spatial + d
        m = _adaptive_matrix(x.shape[axis], output_size[d], x)
        # (.., in) x (out, in) -> (.., out) as multiply + sum: ORT's MatMul+Transpose fusion
        # mis-shapes some of these products (see docs/ops.md).
        out = (out.movedim(axis, -1).unsqueeze(-2) * m).sum(-1).movedim(-1, axis)
    return out


def _adaptive_avg_pool_backward(grad_out, x, spatial: int):
    grad = grad_out
    for d in range(spatial):
        axis = grad_out.dim() - spatial + d
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


@functools.lru_cache(None)
def own_decompositions() -> dict:
    table = {}

    def register(op):
        def wrap(fn):
            table[op] = fn
            return fn
        return wrap

    @register(aten.convolution_backward.default)
    def convolution_backward(grad_out, inp, weight, bias_sizes, stride, padding, dilation,
                             transposed, output_padding, groups, output_mask):
        spatial = weight.dim() - 2
        grad_input = grad_weight = grad_bias = None
        if output_mask[0]:
            if transposed:
                grad_input = aten.convolution(grad_out, weight, None, stride, padding, dilation,
                                              False, [0] * spatial, groups)
                # output_padding rows of the forward get no window: crop to the input size.
                for dim in range(spatial):
                    grad_input = grad_input.narrow(dim + 2, 0, inp.shape[dim + 2])
            else:
                # output_padding makes the transposed conv land exactly on the input size.
                extra = []
                for i in range(spatial):
                    full = ((grad_out.shape[i + 2] - 1) * stride[i] - 2 * padding[i]
                            + dilation[i] * (weight.shape[i + 2] - 1) + 1)
                    extra.append(inp.shape[i + 2] - full)
                grad_input = aten.convolution(grad_out, weight, None, stride, padding, dilation,
                                              True, extra, groups)
        if output_mask[1]:
            if transposed:
                grad_weight = _conv_weight_grad(grad_out, inp, weight.shape, stride, padding,
                                                dilation, groups)
            else:
                grad_weight = _conv_weight_grad(inp, grad_out, weight.shape, stride, padding,
                                                dilation, groups)
        if output_mask[2]:
            grad_bias = grad_out.sum([0] + list(range(2, grad_out.dim())))
        return grad_input, grad_weight, grad_bias

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

    @register(aten._adaptive_avg_pool3d.default)
    def adaptive_avg_pool3d(x, output_size):
        return _adaptive_avg_pool(x, output_size)

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
        # values[i] = max/min(x[j] for j <= i); index = the last j reaching it (torch's ties).
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
        hit = upto & (rows == values.unsqueeze(-1))
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
        return torch.sqrt(a * a + b * b)

    def replication_pad_backward(grad, x, padding):
        # Each padded position copies its nearest edge element: send its gradient back there.
        spatial = len(padding) // 2
        out = grad
        for i in range(spatial):
            dim = x.dim() - 1 - i  # padding pairs run from the last dim backwards
            left = padding[2 * i]
            size = x.shape[dim]
            source = (torch.arange(out.shape[dim], device=x.device) - left).clamp(0, size - 1)
            zeros_shape = list(out.shape)
            zeros_shape[dim] = size
            out = torch.zeros(zeros_shape, dtype=grad.dtype, device=grad.device).index_add(dim, source, out)
        return out

    for op in (aten.replication_pad1d_backward.default, aten.replication_pad2d_backward.default,
               aten.replication_pad3d_backward.default):
        table[op] = replication_pad_backward

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
        if source.dim() == 0:
            return NotImplemented  # 0-d: stays an aten op (runs in PyTorch)
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

    return table
