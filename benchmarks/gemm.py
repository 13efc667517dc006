"""ORT's GEMM (MLAS, via FusedMatMul with its transposes) against PyTorch's (torch.mm) on the
shapes of the benchmark models' training steps, one process, same threads.

    .venv/bin/python benchmarks/gemm.py
    .venv/bin/python benchmarks/gemm.py --cold   # operands not in cache, as in a training step
    .venv/bin/python benchmarks/gemm.py --bfloat16 [--cold]   # CPU autocast's products
    .venv/bin/python benchmarks/gemm.py --ours --attention [--cold]   # attention's batched products
    .venv/bin/python benchmarks/gemm.py --blas [--cold]   # torch's BLAS inside ORT (cpu_matmul)
    .venv/bin/python benchmarks/gemm.py --blas --chain 20   # ... 20 products in one run, as in a step
    .venv/bin/python benchmarks/gemm.py --ours --skinny [--chain 64]   # products of few rows (an LSTM's)
    .venv/bin/python benchmarks/gemm.py --transpose-first --cold   # weight gradients: A transposed first?

``--bfloat16``: bfloat16 operands and result, as under CPU autocast: ort_dynamo's bfloat16
product (csrc/bf16_gemm.h, AVX512-BF16) against torch.mm on bfloat16 tensors (oneDNN), and
against ORT's float32 FusedMatMul of the same values, which is what ran before it.

``--attention`` (with ``--ours``): attention's batched products instead, the six of a layer's
forward and backward at the models' sizes (batch 8 x 4 heads, 128 positions, head size 64).

``--blas``: the product option ``cpu_matmul="torch_blas"`` puts in the models (csrc/torch_blas.c:
torch's sgemm inside an ORT session) against ORT's FusedMatMul and torch.mm, calls interleaved.

``--chain N`` (with ``--blas``): N products one after the other in one ORT run (each multiplying
the one before by the same square matrix) against the same N ``torch.mm`` calls: what a product
costs inside a training step's run, without a one-op session's call per product.

``--skinny`` (with ``--ours``): products of few rows instead (an LSTM's step: 16 sequences
against its recurrent weight, forward with B transposed and backward in rows), where
ort_dynamo's product reads B in place rather than packing it (at most 32 rows; 64 for
comparison).

``--chain N`` (with ``--ours --skinny``): an LSTM step's two products (16 rows by a [1024, 256]
weight, B transposed, then the result by the weight in rows, a Tanh after) N times in one run,
ours against ORT's: a one-op session's call costs more than such a product (the figures above
are mostly that), a step's run does not.

``--transpose-first``: the weight gradients' products (X^T dY, the tokens the inner dimension)
as FusedMatMul with transA, as ORT runs them, against a Transpose of X then a MatMul in one
session, and against the MatMul alone on an X transposed beforehand (what the product would cost
if the transpose were free), with the Transpose alone beside them; the calls interleaved.

``--cold``: each call gets operands from a rotation of 6 copies and, before it (not timed), a
32 MB write evicts the caches. In a training step most operands come from memory: saved
activations were written during the forward, gradients a few kernels earlier.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort
import torch
from onnx import TensorProto, helper

# (M, K, N) of the CPU benchmark models: tokens 1024, hidden 256, MLP 1024, GPT-2's QKV 768
# (M 256 and K 1024: weight gradients, the MLP's first one 256 x 1024).
SHAPES = [(1024, 256, 256), (1024, 256, 1024), (1024, 1024, 256), (256, 1024, 256),
          (1024, 256, 768), (256, 1024, 768), (256, 1024, 1024)]


#: (M, K, N) of products with few rows: the LSTM benchmark's steps (16 rows, hidden 256, four
#: gates), GPT-2's projection widths, and 64 rows, past where ort_dynamo reads B in place.
SKINNY = [(16, 256, 1024), (16, 1024, 256), (32, 256, 1024), (8, 256, 768), (4, 512, 512), (64, 256, 1024)]


#: Attention's batched products, per head: (what, M, K, N, trans_a, trans_b), and the heads.
ATTENTION = [("q kT", 128, 64, 128, 0, 1), ("P v", 128, 128, 64, 0, 0), ("dO vT", 128, 64, 128, 0, 1),
             ("PT dO", 128, 128, 64, 1, 0), ("dS k", 128, 128, 64, 0, 0), ("dST q", 128, 128, 64, 1, 0)]
HEADS = 32


def _cpu_session(model: bytes, library: str = "", optimize: bool = True) -> ort.InferenceSession:
    """A CPU session of ``model`` on torch's thread count, not spinning (as ort_dynamo's own);
    ``library``: a custom-op library it registers; ``optimize=False``: without ORT's graph
    optimizations (which would fold a Transpose into the MatMul after it)."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = torch.get_num_threads()
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if library:
        so.register_custom_ops_library(library)
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def _float32_model(nodes, inputs, output, domain: str = "") -> bytes:
    """ONNX ``nodes`` as a model: ``inputs`` and ``output`` (name, shape) float32; ``domain``: the
    custom ops' domain, if any."""
    graph = helper.make_graph(nodes, "products", [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape)
                                                  for n, shape in inputs],
                              [helper.make_tensor_value_info(output[0], TensorProto.FLOAT, output[1])])
    opsets = [helper.make_opsetid("", 18)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    return helper.make_model(graph, ir_version=10, opset_imports=opsets).SerializeToString()


def _session(a_shape, b_shape, trans_a: int, trans_b: int) -> ort.InferenceSession:
    m = a_shape[-1] if trans_a else a_shape[-2]
    n = b_shape[-2] if trans_b else b_shape[-1]
    node = helper.make_node("FusedMatMul", ["a", "b"], ["y"], domain="com.microsoft",
                            transA=trans_a, transB=trans_b, alpha=1.0)
    return _cpu_session(_float32_model([node], [("a", a_shape), ("b", b_shape)], ("y", [*a_shape[:-2], m, n]),
                                       "com.microsoft"))


def _our_session(trans_a: int, trans_b: int, float32: bool = False, rank: int = 2) -> ort.InferenceSession:
    """ort_dynamo's bfloat16 product as one op: bfloat16 in and out; or (``float32``) its float32
    product, float32 in and out; of operands of ``rank`` axes."""
    import onnx_ir as ir

    from ort_dynamo import _kernels, _op_kernels

    if float32:
        name, unit = _op_kernels.f32_matmul_kernel([bool(trans_a), bool(trans_b)], False)
    else:
        name, unit = _op_kernels.bf16_matmul_kernel([bool(trans_a), bool(trans_b)], [True, True, True], False, False)
    dtype = ir.DataType.FLOAT if float32 else ir.DataType.BFLOAT16
    inputs = [ir.Value(name=n, type=ir.TensorType(dtype), shape=ir.Shape(["b", "r", "c"][-rank:])) for n in "ab"]
    node = ir.node(name, inputs, domain=_op_kernels.DOMAIN)
    node.outputs[0].name, node.outputs[0].dtype = "y", dtype
    graph = ir.Graph(inputs, node.outputs, nodes=[node], opset_imports={"": 18, _op_kernels.DOMAIN: 1})
    return _cpu_session(ir.serde.serialize_model(ir.Model(graph, ir_version=10)).SerializeToString(),
                        _kernels.library([unit]))


def _cases(attention: bool = False, skinny: bool = False):
    """(m, k, n, trans_a, trans_b, A's shape, B's shape) of each product measured (``attention``:
    attention's batched ones, A and B of ``HEADS`` matrices; ``skinny``: few rows, A in rows)."""
    if skinny:
        for m, k, n in SKINNY:
            for trans_b in (0, 1):
                yield m, k, n, 0, trans_b, [m, k], ([n, k] if trans_b else [k, n])
        return
    if attention:
        for _, m, k, n, trans_a, trans_b in ATTENTION:
            yield (m, k, n, trans_a, trans_b, [HEADS] + ([k, m] if trans_a else [m, k]),
                   [HEADS] + ([n, k] if trans_b else [k, n]))
        return
    for m, k, n in SHAPES:
        for trans_a, trans_b in ((0, 0), (0, 1), (1, 0)):
            yield m, k, n, trans_a, trans_b, ([k, m] if trans_a else [m, k]), ([n, k] if trans_b else [k, n])


def _header(args, what: str = "") -> int:
    """Prints the run's settings; returns how many copies of the operands to rotate through."""
    print(f"threads: {torch.get_num_threads()}, onnxruntime {ort.__version__}, torch {torch.__version__}, "
          f"operands {'cold' if args.cold else 'in cache'}{what}")
    return 6 if args.cold else 1


def _operands(make, a_shape, b_shape, trans_a: int, trans_b: int, copies: int) -> tuple[list, list, list, list]:
    """``copies`` of A and of B, each made by ``make(shape)``, and their views as ``torch.matmul`` takes them."""
    a, b = [make(a_shape) for _ in range(copies)], [make(b_shape) for _ in range(copies)]
    return a, b, [x.mT if trans_a else x for x in a], [x.mT if trans_b else x for x in b]


def _row(case, ms: dict, ratios: str, batch: int = 1) -> None:
    """One product's line: its sizes and layout, each contender's ms and GF/s, the ratios."""
    m, k, n, trans_a, trans_b = case
    gflop = 2 * batch * m * k * n / 1e6
    timings = "  ".join(f"{name} {t:6.2f} ms ({gflop / t:3.0f} GF/s)" for name, t in ms.items())
    heads = f"{batch} x " if batch > 1 else ""
    print(f"{heads}M {m:5d} K {k:5d} N {n:5d} transA {trans_a} transB {trans_b}: {timings}  {ratios}")


def _ort_values(tensors: list[torch.Tensor]) -> list:
    from ort_dynamo.run import _wrap

    return [ort.OrtValue(_wrap(t, t.data_ptr(), None)) for t in tensors]


_EVICT = np.zeros(8 << 20, np.float32)  # 32 MB, more than this machine's last-level cache


def _median_ms(fn, repeats: int, cold: bool) -> float:
    """``fn(i)`` runs call ``i``; with ``cold`` the caches are evicted before each (untimed)."""
    for i in range(3):
        fn(i)
    times = []
    for i in range(repeats):
        if cold:
            np.add(_EVICT, 1.0, out=_EVICT)
        start = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--cold", action="store_true", help="operands from memory, not cache (see above)")
    parser.add_argument("--bfloat16", action="store_true", help="CPU autocast's bfloat16 products (see above)")
    parser.add_argument("--ours", action="store_true",
                        help="float32: ort_dynamo's own product (what the rewrite uses where K >= 512, or with few "
                             "rows: --skinny) against ORT's, the calls interleaved")
    parser.add_argument("--blas", action="store_true",
                        help="float32: torch's BLAS inside ORT (cpu_matmul) against ORT's, the calls interleaved")
    parser.add_argument("--attention", action="store_true",
                        help="with --ours: attention's batched products (see above)")
    parser.add_argument("--skinny", action="store_true",
                        help="with --ours: products of few rows, an LSTM step's (see above)")
    parser.add_argument("--transpose-first", action="store_true",
                        help="float32: weight gradients as FusedMatMul transA against Transpose then MatMul (see above)")
    parser.add_argument("--chain", type=int, default=0,
                        help="with --blas: this many products in one ORT run against as many torch.mm calls")
    args = parser.parse_args()
    if args.chain and not (args.blas or args.skinny):
        parser.error("--chain times torch's BLAS inside ORT (add --blas) or products of few rows (add --ours "
                     "--skinny)")
    if args.skinny and not args.ours:
        parser.error("--skinny chooses the products --ours measures: add --ours")
    if args.chain < 0:
        parser.error(f"--chain must be a count of products, got {args.chain}")
    if args.transpose_first:
        if args.bfloat16 or args.ours or args.blas:
            parser.error("--transpose-first compares ORT's own float32 products: no --bfloat16, --ours or --blas")
        return transpose_first(args)
    if args.bfloat16:
        return bfloat16_products(args)
    if args.ours:
        return our_float32_products(args)
    if args.blas:
        return blas_products(args)
    copies = _header(args)
    ratios = []
    for m, k, n, trans_a, trans_b, a_shape, b_shape in _cases():
        a = [np.random.randn(*a_shape).astype(np.float32) for _ in range(copies)]
        b = [np.random.randn(*b_shape).astype(np.float32) for _ in range(copies)]
        session = _session(a_shape, b_shape, trans_a, trans_b)
        ort_ms = _median_ms(lambda i: session.run(None, {"a": a[i % copies], "b": b[i % copies]}),
                            args.repeats, args.cold)
        ta = [torch.from_numpy(x).t() if trans_a else torch.from_numpy(x) for x in a]
        tb = [torch.from_numpy(x).t() if trans_b else torch.from_numpy(x) for x in b]
        torch_ms = _median_ms(lambda i: torch.mm(ta[i % copies], tb[i % copies]), args.repeats, args.cold)
        ratios.append(ort_ms / torch_ms)
        _row((m, k, n, trans_a, trans_b), {"ort": ort_ms, "torch": torch_ms}, f"ort/torch {ort_ms / torch_ms:.2f}")
    print(f"geometric mean ort/torch: {statistics.geometric_mean(ratios):.2f}")


def _interleaved_ms(fns, repeats: int, cold: bool) -> list[float]:
    """Median ms of each of ``fns`` (``fn(i)`` runs call ``i``), their calls alternating, so that
    a slow stretch of a shared VM slows them alike."""
    for fn in fns:
        for i in range(3):
            fn(i)
    times = [[] for _ in fns]
    for i in range(repeats):
        for fn, got in zip(fns, times):
            if cold:
                np.add(_EVICT, 1.0, out=_EVICT)
            start = time.perf_counter()
            fn(i)
            got.append(time.perf_counter() - start)
    return [statistics.median(t) * 1e3 for t in times]


def _one_op_against_ort(args, label: str, make, what: str) -> None:
    """``make(trans_a, trans_b, rank)``'s one-op session (``label``) against ORT's FusedMatMul and
    torch.matmul on each case, the calls interleaved; its error against a float64 product."""
    copies = _header(args, what)
    ratios, to_torch = [], []
    for m, k, n, trans_a, trans_b, a_shape, b_shape in _cases(args.attention, args.skinny):
        a, b, ta, tb = _operands(lambda shape: torch.randn(*shape), a_shape, b_shape, trans_a, trans_b, copies)
        op, theirs = make(trans_a, trans_b, len(a_shape)), _session(a_shape, b_shape, trans_a, trans_b)
        feeds = list(zip(_ort_values(a), _ort_values(b)))  # both sessions called the same way
        got = op.run_with_ort_values(["y"], dict(zip("ab", feeds[0])))[0].numpy()
        want = torch.matmul(ta[0].double(), tb[0].double()).numpy()
        error = float(np.abs(got - want).max() / np.abs(want).max())
        op_ms, ort_ms, torch_ms = _interleaved_ms(
            [lambda i: op.run_with_ort_values(["y"], dict(zip("ab", feeds[i % copies]))),
             lambda i: theirs.run_with_ort_values(["y"], dict(zip("ab", feeds[i % copies]))),
             lambda i: torch.matmul(ta[i % copies], tb[i % copies])], args.repeats, args.cold)
        ratios.append(op_ms / ort_ms)
        to_torch.append(op_ms / torch_ms)
        _row((m, k, n, trans_a, trans_b), {label: op_ms, "ORT": ort_ms, "torch": torch_ms},
             f"{label}/ORT {op_ms / ort_ms:.2f}  {label}/torch {op_ms / torch_ms:.2f}  error {error:.1e}",
             a_shape[0] if len(a_shape) > 2 else 1)
    print(f"geometric mean {label}/ORT: {statistics.geometric_mean(ratios):.2f}, "
          f"{label}/torch: {statistics.geometric_mean(to_torch):.2f}")


def _skinny_chain_session(steps: int, ours: bool) -> ort.InferenceSession:
    """h -> Tanh((h Wᵀ) W), ``steps`` times, h [16, 256], W [1024, 256]: ort_dynamo's products
    (``ours``) or ORT's (FusedMatMul with transB, MatMul)."""
    import onnx_ir as ir

    from ort_dynamo import _kernels, _op_kernels

    def value(name, shape):
        return ir.Value(name=name, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(shape))

    h, w = value("h", [16, 256]), value("w", [1024, 256])
    nodes, x, units = [], h, {}
    for _ in range(steps):
        for trans_b in (True, False):
            if ours:
                name, units[trans_b] = _op_kernels.f32_matmul_kernel([False, trans_b], False)
                nodes.append(ir.node(name, [x, w], domain=_op_kernels.DOMAIN))
            elif trans_b:
                nodes.append(ir.node("FusedMatMul", [x, w], attributes={"transB": 1, "alpha": 1.0},
                                     domain="com.microsoft"))
            else:
                nodes.append(ir.node("MatMul", [x, w]))
            nodes[-1].outputs[0].dtype = ir.DataType.FLOAT
            x = nodes[-1].outputs[0]
        nodes.append(ir.node("Tanh", [x]))
        nodes[-1].outputs[0].dtype = ir.DataType.FLOAT
        x = nodes[-1].outputs[0]
    x.name = "y"
    graph = ir.Graph([h, w], [x], nodes=nodes, opset_imports={"": 18, _op_kernels.DOMAIN: 1, "com.microsoft": 1})
    return _cpu_session(ir.serde.serialize_model(ir.Model(graph, ir_version=10)).SerializeToString(),
                        _kernels.library(list(units.values())) if ours else "")


def _skinny_chain(args) -> None:
    _header(args, f", float32, an LSTM step's two products {args.chain} times in one run, ours against ORT's")
    sessions = [_skinny_chain_session(args.chain, ours) for ours in (True, False)]
    gen = torch.Generator().manual_seed(0)
    feeds = dict(zip("hw", _ort_values([torch.randn(16, 256, generator=gen) * 0.1,
                                        torch.randn(1024, 256, generator=gen) * 0.05])))
    got, want = (s.run_with_ort_values(["y"], feeds)[0].numpy() for s in sessions)
    ours_ms, ort_ms = _interleaved_ms([lambda i, s=s: s.run_with_ort_values(["y"], feeds) for s in sessions],
                                      args.repeats, args.cold)
    per = 1e3 / (2 * args.chain)
    print(f"ours {ours_ms * per:6.1f} us a product  ORT {ort_ms * per:6.1f} us  ours/ORT {ours_ms / ort_ms:.3f}  "
          f"largest difference at the end {float(np.abs(got - want).max()):.1e} (values up to "
          f"{float(np.abs(want).max()):.2f}; the sums' order differs, and differences grow along the chain)")


def our_float32_products(args) -> None:
    from ort_dynamo import _kernels

    if not (_kernels.available() and _kernels.float32_products()):
        raise SystemExit("ort_dynamo's float32 product needs a C compiler targeting AVX-512: none here")
    if args.chain:
        return _skinny_chain(args)
    _one_op_against_ort(args, "ours", lambda trans_a, trans_b, rank: _our_session(trans_a, trans_b, True, rank),
                        ", float32, ours against ORT's (MLAS), calls interleaved")


def _blas_session(trans_a: int, trans_b: int) -> ort.InferenceSession:
    """The product ``cpu_matmul="torch_blas"`` puts in a model, as one op."""
    return _blas_products_session([("a", "b", "y", trans_a, trans_b)], [("a", ["r", "c"]), ("b", ["r", "c"])],
                                  ("y", ["m", "n"]))


def _blas_products_session(products, inputs, output) -> ort.InferenceSession:
    """A session of torch's BLAS products (``cpu_matmul="torch_blas"``): ``products`` (a, b, y,
    trans_a, trans_b) in order, ``inputs`` and ``output`` (name, shape) float32."""
    from ort_dynamo import _torch_blas

    nodes = [helper.make_node("MatMul", [a, b], [y], domain=_torch_blas.DOMAIN, trans_a=ta, trans_b=tb)
             for a, b, y, ta, tb in products]
    return _cpu_session(_float32_model(nodes, inputs, output, _torch_blas.DOMAIN), _torch_blas.library())


def blas_products(args) -> None:
    from ort_dynamo import _torch_blas

    if _torch_blas.problem():
        raise SystemExit(f"torch's BLAS cannot run inside ORT here: {_torch_blas.problem()}")
    if args.attention:
        raise SystemExit("--blas multiplies one matrix by another (float32 batches stay ORT's): no --attention")
    if args.chain:
        return _blas_chain(args)
    _one_op_against_ort(args, "blas", lambda trans_a, trans_b, rank: _blas_session(trans_a, trans_b),
                        ", float32, torch's BLAS inside ORT against ORT's (MLAS), calls interleaved")


#: (rows, size) of the chains: rows x size times size x size, as the models' projections.
CHAIN_SHAPES = [(1024, 256), (256, 1024), (1024, 1024)]


def _blas_chain(args) -> None:
    """``args.chain`` products in one ORT run (torch's BLAS inside ORT) against as many torch.mm
    calls, the runs interleaved."""
    _header(args, f", float32, {args.chain} products in one ORT run (torch's BLAS) against {args.chain} torch.mm")
    ratios = []
    for m, k in CHAIN_SHAPES:
        names = ["a"] + [f"y{i}" for i in range(args.chain)]
        name = names[-1]
        session = _blas_products_session([(x, "w", y, 0, 0) for x, y in zip(names, names[1:])],
                                         [("a", [m, k]), ("w", [k, k])], (name, [m, k]))
        a, w = torch.randn(m, k) / k ** 0.5, torch.randn(k, k) / k ** 0.5  # values stay near 1 along the chain
        feeds = dict(zip("aw", _ort_values([a, w])))
        got = session.run_with_ort_values([name], feeds)[0].numpy()

        def torch_chain():
            x = a
            for _ in range(args.chain):
                x = torch.mm(x, w)
            return x

        error = float(np.abs(got - torch_chain().numpy()).max() / np.abs(got).max())
        ort_ms, torch_ms = _interleaved_ms([lambda i: session.run_with_ort_values([name], feeds),
                                            lambda i: torch_chain()], args.repeats, args.cold)
        ratios.append(ort_ms / torch_ms)
        print(f"M {m:5d} K {k:5d} N {k:5d} x {args.chain}: ORT run {ort_ms:7.2f} ms  torch {torch_ms:7.2f} ms  "
              f"ORT/torch {ort_ms / torch_ms:.3f}  ({(ort_ms - torch_ms) / args.chain * 1e3:+.0f} us a product)  "
              f"error {error:.1e}")
    print(f"geometric mean ORT/torch: {statistics.geometric_mean(ratios):.3f}")


#: (M, K, N) of the weight gradients X^T dY: X [K tokens, M inputs], dY [K, N outputs].
WEIGHT_GRADIENTS = [(1024, 1024, 256), (256, 1024, 1024), (256, 1024, 768), (256, 1024, 256)]


def _plain_session(nodes, inputs, output) -> ort.InferenceSession:
    """ONNX ``nodes`` as ORT runs them without its graph optimizations."""
    return _cpu_session(_float32_model(nodes, inputs, output), optimize=False)


def transpose_first(args) -> None:
    copies = _header(args, ", weight gradients: FusedMatMul transA against Transpose then MatMul, interleaved")
    ratios = []
    for m, k, n in WEIGHT_GRADIENTS:
        x = [np.random.randn(k, m).astype(np.float32) for _ in range(copies)]
        dy = [np.random.randn(k, n).astype(np.float32) for _ in range(copies)]
        xt = [np.ascontiguousarray(a.T) for a in x]
        fused = _session([k, m], [k, n], 1, 0)
        both = _plain_session([helper.make_node("Transpose", ["a"], ["at"], perm=[1, 0]),
                               helper.make_node("MatMul", ["at", "b"], ["y"])], [("a", [k, m]), ("b", [k, n])],
                              ("y", [m, n]))
        product = _plain_session([helper.make_node("MatMul", ["a", "b"], ["y"])], [("a", [m, k]), ("b", [k, n])],
                                 ("y", [m, n]))
        transpose = _plain_session([helper.make_node("Transpose", ["a"], ["y"], perm=[1, 0])], [("a", [k, m])],
                                   ("y", [m, k]))
        difference = float(np.abs(fused.run(None, {"a": x[0], "b": dy[0]})[0]
                                  - both.run(None, {"a": x[0], "b": dy[0]})[0]).max())
        fused_ms, both_ms, product_ms, transpose_ms = _interleaved_ms(
            [lambda i: fused.run(None, {"a": x[i % copies], "b": dy[i % copies]}),
             lambda i: both.run(None, {"a": x[i % copies], "b": dy[i % copies]}),
             lambda i: product.run(None, {"a": xt[i % copies], "b": dy[i % copies]}),
             lambda i: transpose.run(None, {"a": x[i % copies]})], args.repeats, args.cold)
        ratios.append(both_ms / fused_ms)
        _row((m, k, n, 1, 0), {"transA": fused_ms, "Transpose+MatMul": both_ms, "MatMul alone": product_ms},
             f"Transpose alone {transpose_ms:.2f} ms  (Transpose+MatMul)/transA {both_ms / fused_ms:.3f}  "
             f"difference {difference:.0e}")
    print(f"geometric mean (Transpose+MatMul)/transA: {statistics.geometric_mean(ratios):.3f}")


def bfloat16_products(args) -> None:
    from ort_dynamo import _kernels

    if not (_kernels.available() and _kernels.bfloat16_products()):
        raise SystemExit("no C compiler targeting AVX512-BF16 here: no bfloat16 products to measure")
    copies = _header(args, ", bfloat16")
    ratios, before = [], []
    for m, k, n, trans_a, trans_b, a_shape, b_shape in _cases():
        a, b, ta, tb = _operands(lambda shape: torch.randn(*shape).bfloat16(), a_shape, b_shape, trans_a, trans_b,
                                 copies)
        ours, feeds = _our_session(trans_a, trans_b), list(zip(_ort_values(a), _ort_values(b)))
        ours_ms = _median_ms(lambda i: ours.run_with_ort_values(["y"], dict(zip("ab", feeds[i % copies]))),
                             args.repeats, args.cold)
        fp32 = _session(a_shape, b_shape, trans_a, trans_b)
        a32, b32 = [x.float().numpy() for x in a], [x.float().numpy() for x in b]
        fp32_ms = _median_ms(lambda i: fp32.run(None, {"a": a32[i % copies], "b": b32[i % copies]}),
                             args.repeats, args.cold)
        torch_ms = _median_ms(lambda i: torch.mm(ta[i % copies], tb[i % copies]), args.repeats, args.cold)
        ratios.append(ours_ms / torch_ms)
        before.append(ours_ms / fp32_ms)
        _row((m, k, n, trans_a, trans_b), {"ours": ours_ms, "torch bf16": torch_ms, "ORT float32": fp32_ms},
             f"ours/torch {ours_ms / torch_ms:.2f}  ours/float32 {ours_ms / fp32_ms:.2f}")
    print(f"geometric mean ours/torch: {statistics.geometric_mean(ratios):.2f}, "
          f"ours/ORT float32: {statistics.geometric_mean(before):.2f}")


if __name__ == "__main__":
    main()
