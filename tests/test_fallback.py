"""Ops without an ONNX lowering: reported fallback by default, a named error with DISABLE."""

import contextlib
import copy
import json
import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ort_dynamo
from ort_dynamo import FallbackPolicy, OrtOptions, lower
from parity import assert_same_training, train_both


@torch.library.custom_op("ort_dynamo_tests::soft_clip", mutates_args=())
def soft_clip(x: torch.Tensor) -> torch.Tensor:
    """An op ONNX has never heard of (a custom op with its own autograd formula)."""
    return x / (1 + x.abs())


@soft_clip.register_fake
def _(x):
    return torch.empty_like(x)


def _soft_clip_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return grad / (1 + x.abs()) ** 2


soft_clip.register_autograd(_soft_clip_backward,
                            setup_context=lambda ctx, inputs, output: ctx.save_for_backward(inputs[0]))


class WithCustomOp(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x):
        return self.b(soft_clip(self.a(x)))


def test_unsupported_op_falls_back_trains_correctly_and_is_reported():
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    with pytest.warns(UserWarning, match="soft_clip.default runs in PyTorch: no ONNX lowering") as caught:
        result = train_both(WithCustomOp(), lambda: (x,), lambda out: F.cross_entropy(out, y))
    assert sum("soft_clip" in str(w.message) for w in caught) == 1  # once per cause, not per graph
    assert_same_training(*result)
    report = ort_dynamo.report()
    assert report.fallback_nodes >= 1
    assert report.ort_nodes > 0  # the linear layers still run on ORT
    ops = {f.op for f in report.fallbacks}
    assert "ort_dynamo_tests.soft_clip.default" in ops, report.fallbacks
    fallback = next(f for f in report.fallbacks if f.op == "ort_dynamo_tests.soft_clip.default")
    assert "no ONNX lowering" in fallback.reason
    assert "test_fallback.py" in fallback.source and "soft_clip(self.a(x))" in fallback.source
    assert "soft_clip" in str(report)  # the printed table names it too


def test_disable_policy_raises_naming_op_and_source_line():
    model = torch.compile(WithCustomOp(), backend="ort", options={"fallback_policy": "DISABLE"})
    with pytest.raises(ort_dynamo.UnsupportedOpError) as info:
        model(torch.randn(2, 8))
    message = str(info.value)
    assert "ort_dynamo_tests.soft_clip" in message
    assert "test_fallback.py" in message and "soft_clip(self.a(x))" in message
    assert "no ONNX lowering" in message


@torch.library.custom_op("ort_dynamo_tests::over_its_max", mutates_args=())
def over_its_max(x: torch.Tensor) -> torch.Tensor:
    return x / x.max()


@over_its_max.register_fake
def _(x):
    return torch.empty_like(x)


@torch._decomp.register_decomposition(torch.ops.ort_dynamo_tests.over_its_max.default)
def _over_its_max_read_on_the_host(x):
    # A decomposition that reads a value on the host (as torch's own take did for a 0-d
    # index): AOTAutograd's tracing with fake tensors cannot follow it.
    return x / x.max().item()


@pytest.fixture
def decompositions_with_over_its_max():
    lower.decomposition_table.cache_clear()  # built once per process; the op may be newer
    yield
    lower.decomposition_table.cache_clear()


def test_a_graph_aotautograd_cannot_trace_runs_in_pytorch_reported_with_op_and_line(
        decompositions_with_over_its_max):
    fn = torch.compile(lambda x: over_its_max(x) * 2, backend="ort")
    x = torch.rand(5) + 1
    with pytest.warns(UserWarning, match="over_its_max.default runs in PyTorch: AOTAutograd cannot trace it"):
        out = fn(x)
    torch.testing.assert_close(out, over_its_max(x) * 2)
    report = ort_dynamo.report()
    assert [g.kind for g in report.graphs] == ["dynamo"] and report.ort_nodes == 0
    assert report.fallback_nodes == 2 and not report.graph_breaks
    (fallback,) = report.fallbacks
    assert fallback.op == "over_its_max.default"
    assert "_local_scalar_dense" in fallback.reason and "whole graph runs in PyTorch" in fallback.reason
    assert "test_fallback.py" in fallback.source and "over_its_max(x) * 2" in fallback.source


def test_a_graph_aotautograd_cannot_trace_is_an_error_when_the_policy_forbids_pytorch(
        decompositions_with_over_its_max):
    fn = torch.compile(lambda x: over_its_max(x) * 2, backend="ort", options={"fallback_policy": "DISABLE"})
    with pytest.raises(ort_dynamo.UnsupportedOpError,
                       match=r"(?s)over_its_max.default cannot be traced by AOTAutograd.*"
                             r"source: .*test_fallback.py.*reason: AOTAutograd cannot trace"):
        fn(torch.rand(5))


def _put(x, mask, value):
    return torch.index_put(x * 2, (mask,), value).tanh()


def _setitem(x, mask, value):
    y = x * 2
    y[mask] = value
    return y.tanh()


@pytest.mark.parametrize("assign", [_put, _setitem])
def test_assigning_through_a_boolean_mask_trains_on_ort_unless_each_place_has_its_own_value(assign):
    mask = torch.tensor([True, False, True, True, False])

    def step(fn, value, grad=True):
        x = torch.linspace(-1, 1, 25).reshape(5, 5).requires_grad_()
        value = value.clone().requires_grad_(grad)
        out = fn(x, mask, value)
        out.sum().backward()
        return out, x.grad, value.grad

    compiled = torch.compile(assign, backend="ort")
    # One value for every masked place (a number, a row), with its gradient, or a constant.
    for value, grad in ((torch.tensor(-1.0), True), (torch.randn(5), True), (torch.randn(1), True),
                        (torch.randn(3, 5), False)):
        ort_dynamo.reset()
        for got, want in zip(step(compiled, value, grad), step(assign, value, grad)):
            torch.testing.assert_close(got, want)
        assert ort_dynamo.report().fallback_nodes == 0 and ort_dynamo.report().ort_nodes > 0, value.shape
    # A value per masked place that needs a gradient: that gradient gathers the masked places
    # (``grad[mask]``), a count only the mask gives. The graph runs in PyTorch, reported.
    ort_dynamo.reset()
    values = torch.randn(3, 5)
    with pytest.warns(UserWarning, match="AOTAutograd cannot trace"):
        result = step(compiled, values)
    for got, want in zip(result, step(assign, values)):
        torch.testing.assert_close(got, want)
    (fallback,) = ort_dynamo.report().fallbacks
    assert "aten.nonzero" in fallback.reason and "whole graph runs in PyTorch" in fallback.reason


def test_disable_policy_from_ortmodule_env_name(monkeypatch):
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    model = torch.compile(WithCustomOp(), backend="ort")
    with pytest.raises(Exception, match="soft_clip"):
        model(torch.randn(2, 8))


def test_export_failure_falls_back_per_partition(monkeypatch):
    """A partition that cannot be exported runs in PyTorch, reported, result still right."""
    import ort_dynamo.export as export_stage

    def broken_export(gm, opset=18):
        raise RuntimeError("simulated exporter bug")

    monkeypatch.setattr(export_stage, "export_graph", broken_export)
    model = nn.Linear(4, 2)
    x = torch.randn(3, 4)
    with pytest.warns(UserWarning, match="simulated exporter bug"):
        out = torch.compile(model, backend="ort")(x)
    torch.testing.assert_close(out, model(x))
    report = ort_dynamo.report()
    assert report.ort_nodes == 0 and report.fallback_nodes > 0
    assert any("simulated exporter bug" in f.reason for f in report.fallbacks)


def test_export_failure_with_disable_raises(monkeypatch):
    import ort_dynamo.export as export_stage

    monkeypatch.setattr(export_stage, "export_graph", lambda gm, opset=18: 1 / 0)
    model = torch.compile(nn.Linear(4, 2), backend="ort", options={"fallback_policy": "UNSUPPORTED_OP"})
    with pytest.raises(ort_dynamo.ExportFailedError, match="could not be exported"):
        model(torch.randn(3, 4))


def test_runtime_failure_warns_once_and_stays_in_pytorch(monkeypatch):
    import ort_dynamo.run as run_stage

    calls = {"n": 0}

    def failing_run(self, args):
        calls["n"] += 1
        raise RuntimeError("simulated ORT crash")

    monkeypatch.setattr(run_stage.OrtRunner, "_run", failing_run)
    model = nn.Linear(4, 2)
    compiled = torch.compile(model, backend="ort")
    x = torch.randn(3, 4)
    with pytest.warns(UserWarning, match="simulated ORT crash"):
        torch.testing.assert_close(compiled(x), model(x))
    torch.testing.assert_close(compiled(x), model(x))  # no second attempt, no second warning
    assert calls["n"] == 1
    assert ort_dynamo.report().fallback_nodes > 0


def test_a_partition_failing_at_run_time_moves_exactly_its_nodes_to_pytorch(monkeypatch):
    """Export adds casts to the partition it translates (here: the int64 sum); the report
    moves the nodes it counted on ORT, never more, so no count goes negative."""
    import ort_dynamo.run as run_stage

    def failing_run(self, args):
        raise RuntimeError("simulated ORT crash")

    def fn(x, n):
        return (x * x).sum(-1, keepdim=True) * x + n.sum()

    ort_dynamo.reset()
    compiled = torch.compile(fn, backend="ort")
    x, n = torch.randn(4, 8), torch.arange(3)
    expected = fn(x, n)
    monkeypatch.setattr(run_stage.OrtRunner, "_run", failing_run)
    with pytest.warns(UserWarning, match="simulated ORT crash"):
        torch.testing.assert_close(compiled(x, n), expected)
    report = ort_dynamo.report()
    assert report.ort_nodes == 0 and report.fallback_nodes > 0


@torch.library.custom_op("ort_dynamo_tests::heads_first", mutates_args=())
def heads_first(x: torch.Tensor) -> torch.Tensor:
    """[B, S, H, D] to [B, H, S, D] as a permuted copy, in [B, S, H, D] memory: what PyTorch's
    fused CUDA attention kernels return, whose fake (meta) functions can predict other strides
    (pytorch/pytorch#180445, #138340)."""
    return x.clone().transpose(1, 2)


@heads_first.register_fake
def _(x):
    return x.new_empty(x.shape[0], x.shape[2], x.shape[1], x.shape[3])  # contiguous: not what runs


@pytest.mark.parametrize("failure", [None, "export", "run"])
def test_a_partition_run_in_pytorch_gets_its_inputs_in_the_layout_they_were_traced_with(monkeypatch, failure):
    """A partition that runs in PyTorch (its export or its ORT run failed) is the traced FX
    code, whose ``view`` is valid for the traced strides. A kernel kept in PyTorch before it
    may return other strides than its fake function said; ORT takes any layout (its inputs are
    made contiguous), and the partition's PyTorch code gets its inputs copied to the traced one.
    On an H200, GPT-2's partitions after PyTorch's attention failed here ("view size is not
    compatible") when run in PyTorch."""
    import ort_dynamo.export as export_stage
    import ort_dynamo.run as run_stage

    def fn(x):
        y = heads_first(x * 2)
        # Traced as a view (the fake output is contiguous); eager copies, as reshape must here.
        return y.reshape(y.shape[0], y.shape[1], -1) + 1

    x = torch.randn(2, 5, 3, 4)
    expected = fn(x)
    ort_dynamo.reset()
    if failure == "export":
        original = export_stage.export_graph  # the partition after heads_first is the one with a view
        monkeypatch.setattr(export_stage, "export_graph",
                            lambda gm, opset=18: 1 / 0 if "view" in gm.code else original(gm, opset))
    elif failure == "run":
        original_run = run_stage.OrtRunner._run
        monkeypatch.setattr(run_stage.OrtRunner, "_run",
                            lambda self, args: 1 / 0 if "view" in self.torch_fn.code else original_run(self, args))
    with pytest.warns(UserWarning, match="ZeroDivisionError|division by zero") if failure else contextlib.nullcontext():
        torch.testing.assert_close(torch.compile(fn, backend="ort")(x), expected)
    if failure is None:  # ORT itself takes heads_first's real layout
        assert ort_dynamo.report().fallback_nodes == 1, str(ort_dynamo.report())


@pytest.mark.parametrize("model", ["gelu_mlp", "cnn"])
def test_float64_ops_ort_has_no_cpu_kernel_for_stay_in_pytorch_alone(model):
    """ORT's CPU provider runs Erf, Conv, AveragePool and the inverse and hyperbolic trig ops in
    float32 but not float64 ("Could not find an implementation for Erf(13)"). Found at run
    time, a float64 model's whole partition moved to PyTorch (the MLP's 40 nodes); the
    partitioner now leaves those ops alone there, named in the report, and the rest runs on
    ORT in float64, with eager's gradients."""
    torch.manual_seed(0)
    if model == "gelu_mlp":
        net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))
        x, missing = torch.randn(4, 8), {"Erf"}
    else:
        net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AvgPool2d(2), nn.Flatten(), nn.Linear(36, 2))
        x, missing = torch.randn(2, 3, 8, 8), {"Conv", "AveragePool"}
    net, x = net.double(), x.double()
    twin = copy.deepcopy(net)
    ort_dynamo.reset()
    torch.compile(twin, backend="ort")(x).square().sum().backward()
    net(x).square().sum().backward()
    for p, q in zip(net.parameters(), twin.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-12, atol=1e-12)
    report = ort_dynamo.report()
    reasons = {f.reason for f in report.fallbacks}
    assert reasons == {f"ORT's CPU provider has no float64 {op} kernel (float32 would lose eager's digits)"
                       for op in missing}, reasons
    assert report.ort_nodes > report.fallback_nodes, str(report)


def test_fallback_policy_parsing():
    assert FallbackPolicy.parse("DISABLE") == FallbackPolicy.DISABLE
    assert FallbackPolicy.parse("FALLBACK_DISABLE") == FallbackPolicy.DISABLE
    assert FallbackPolicy.parse("UNSUPPORTED_OP|EXPORT_FAILURE") == (
        FallbackPolicy.UNSUPPORTED_OP | FallbackPolicy.EXPORT_FAILURE)
    assert OrtOptions(fallback_policy="DEFAULT").fallback_policy == FallbackPolicy.DEFAULT
    with pytest.raises(ValueError, match="unknown fallback policy 'SOMETIMES'"):
        FallbackPolicy.parse("SOMETIMES")


def test_provider_list_without_the_tensors_provider_is_a_clear_error():
    model = torch.compile(nn.Linear(2, 2), backend="ort",
                          options={"providers": ["CUDAExecutionProvider"], "fallback_policy": "DISABLE"})
    with pytest.raises(ort_dynamo.OrtRuntimeError, match="need CPUExecutionProvider"):
        model(torch.randn(1, 2))


def test_only_a_graph_with_a_fallback_needs_the_partitioners_search(monkeypatch):
    """A graph that runs on ORT whole is one partition, taken without the partitioner's cycle
    search (a twentieth of a second of BERT's first step); one with an op left in PyTorch is
    split by that search around it."""
    from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner

    searched = []
    search = CapabilityBasedPartitioner.propose_partitions

    def counted(self):
        searched.append(self)
        return search(self)

    monkeypatch.setattr(CapabilityBasedPartitioner, "propose_partitions", counted)
    x = torch.randn(4, 8)
    ort_dynamo.reset()
    torch.compile(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)), backend="ort")(x).sum().backward()
    assert not searched
    assert [g.partitions for g in ort_dynamo.report().graphs] == [1, 1]
    ort_dynamo.reset()
    with pytest.warns(UserWarning, match="soft_clip"):
        torch.compile(WithCustomOp(), backend="ort")(x).sum().backward()
    assert searched
    forward = next(g for g in ort_dynamo.report().graphs if g.kind == "forward")
    assert forward.partitions == 2 and forward.torch_nodes == 1


@pytest.mark.parametrize("op", ["_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention"])
def test_cuda_attention_kernels_run_in_pytorch_because_torchlib_fakes_their_logsumexp(op):
    """CUDA's attention kernels reach a graph where Dynamo keeps their caller whole
    (nn.MultiheadAttention). torchlib lowers them with a logsumexp of zeros, which their backward
    reads; with no decomposition tested on a GPU, they stay in PyTorch, saying why."""
    from ort_dynamo.partition import partition
    from ort_dynamo.report import GraphReport

    graph = torch.fx.Graph()
    q, k, v = (graph.placeholder(name) for name in "qkv")
    for node in (q, k, v):
        node.meta["val"] = torch.empty(2, 4, 8, 16)
    target = getattr(torch.ops.aten, op).default
    attention = graph.call_function(target, (q, k, v) if "flash" in op else (q, k, v, None, True))
    attention.meta["val"] = (torch.empty(2, 4, 8, 16), torch.empty(2, 4, 8), torch.empty(()), torch.empty(()))
    out = graph.call_function(operator.getitem, (attention, 0))
    out.meta["val"] = torch.empty(2, 4, 8, 16)
    graph.output((out,))
    report = GraphReport(name="forward_0", kind="forward")
    partition(torch.fx.GraphModule(torch.nn.Module(), graph), lambda: None, FallbackPolicy.DEFAULT, report)
    assert [(f.op, f.reason) for f in report.fallbacks] == [
        (str(target), "torchlib's lowering returns a logsumexp of zeros, which this op's backward reads")]


def test_cuda_attention_kept_by_design_is_neither_a_fallback_nor_refused_by_the_policy():
    """On CUDA (option cuda_torch_attention), PyTorch's fused attention stays in PyTorch because it
    is faster there: the report lists it as kept by design, fallback_policy=DISABLE does not
    refuse it, and the work on either side of it runs on ORT in its own partition."""
    from ort_dynamo.export import onnx_registry
    from ort_dynamo.lower import TORCH_ATTENTION
    from ort_dynamo.partition import partition
    from ort_dynamo.report import GraphReport, Report, format_report

    graph = torch.fx.Graph()
    q, k, v = (graph.placeholder(name) for name in "qkv")
    for node in (q, k, v):
        node.meta["val"] = torch.empty(2, 4, 8, 16)
    scaled = graph.call_function(torch.ops.aten.mul.Tensor, (q, 2.0))
    scaled.meta["val"] = torch.empty(2, 4, 8, 16)
    target = torch.ops.aten._scaled_dot_product_flash_attention.default
    attention = graph.call_function(target, (scaled, k, v))
    attention.meta["val"] = (torch.empty(2, 4, 8, 16), torch.empty(2, 4, 8), torch.empty(()), torch.empty(()))
    first = graph.call_function(operator.getitem, (attention, 0))
    first.meta["val"] = torch.empty(2, 4, 8, 16)
    out = graph.call_function(torch.ops.aten.mul.Tensor, (first, 3.0))
    out.meta["val"] = torch.empty(2, 4, 8, 16)
    graph.output((out,))
    report = GraphReport(name="forward_0", kind="forward")
    parts = partition(torch.fx.GraphModule(torch.nn.Module(), graph), lambda: onnx_registry(18),
                      FallbackPolicy.DISABLE, report, kept=TORCH_ATTENTION)
    assert report.fallbacks == [] and report.torch_nodes == 0
    assert [(f.op, "kept by design" in f.reason) for f in report.kept] == [(str(target), True)]
    assert len(parts.ort_submodules) == 2 and report.ort_nodes == 2  # the two multiplications
    whole = Report()
    whole.graphs.append(report)
    assert whole.kept_nodes == 1 and whole.fallback_nodes == 0
    assert "kept in PyTorch by design" in format_report(whole.to_dict())
    json.dumps(whole.to_dict())  # saved reports stay JSON


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("torch_attention", [True, False])
def test_attention_trains_like_eager_kept_in_pytorch_on_cuda_and_on_ort_otherwise(device, torch_attention):
    """cuda_torch_attention (default on): on CUDA, attention forward and backward are PyTorch's
    fused kernels, kept by design even under fallback_policy=DISABLE; off, or on CPU, attention is
    written out on ORT. Either way, eager's gradients."""
    q = torch.randn(2, 4, 8, 16, device=device, requires_grad=True)

    def fn(q):
        return F.scaled_dot_product_attention(q, q * 2, q, is_causal=True).sum()

    ort_dynamo.reset()
    options = {"cuda_torch_attention": torch_attention, "fallback_policy": "DISABLE"}
    torch.compile(fn, backend="ort", options=options)(q).backward()
    got, q.grad = q.grad, None
    fn(q).backward()
    torch.testing.assert_close(got, q.grad, rtol=1e-4, atol=1e-5)
    report = ort_dynamo.report()
    assert report.fallback_nodes == 0 and report.ort_nodes > 0, report
    if device == "cuda" and torch_attention:
        assert {g.kind for g in report.graphs if g.kept} == {"forward", "backward"}, report
    else:
        assert report.kept_nodes == 0, report


def test_a_convolution_whose_stride_dynamo_made_symbolic_falls_back_alone_with_that_reason():
    # Under dynamic=True an int the function closes over becomes a SymInt; ONNX's Conv takes
    # strides as an attribute. Before: every node of both graphs fell back, with the reason
    # "Unsupported attribute type: <class 'list'>".
    def make(stride):
        def conv(t, w):
            return F.conv2d(t.sin(), w, stride=stride).square()
        return conv

    x, w = torch.randn(3, 6, 9, 9, requires_grad=True), torch.randn(4, 6, 1, 1, requires_grad=True)
    compiled = torch.compile(make(2), backend="ort", dynamic=True)
    compiled(x, w).sum().backward()
    got = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    make(2)(x, w).sum().backward()
    torch.testing.assert_close(got, (x.grad, w.grad))
    report = ort_dynamo.report()
    assert report.ort_nodes > 0 and {f.op for f in report.fallbacks} == {"aten.convolution.default"}, report
    assert all("stride is symbolic" in f.reason for f in report.fallbacks), report.fallbacks


@pytest.mark.parametrize("layer", ["max_pool", "avg_pool", "adaptive_avg", "nearest_up", "im2col", "pixel_shuffle"])
def test_other_layers_whose_sizes_the_function_closes_over_train_on_ort_under_dynamic_true(layer):
    # The same closure ints as the convolution's stride above, for layers whose ONNX ops take
    # kernels, strides or scales as attributes too: these stay on ORT, with eager's gradients.
    def make(k):
        return {"max_pool": lambda t: F.max_pool2d(t.sin(), k), "avg_pool": lambda t: F.avg_pool2d(t.sin(), k, k),
                "adaptive_avg": lambda t: F.adaptive_avg_pool2d(t.sin(), k),
                "nearest_up": lambda t: F.interpolate(t.sin(), scale_factor=k, mode="nearest"),
                "im2col": lambda t: F.unfold(t.sin(), k), "pixel_shuffle": lambda t: F.pixel_shuffle(t.sin(), k)}[layer]

    ort_dynamo.reset()
    torch._dynamo.reset()
    x = torch.randn(3, 8, 10, 10, requires_grad=True)
    compiled = torch.compile(make(2), backend="ort", dynamic=True)
    compiled(x).square().sum().backward()
    got = x.grad.clone()
    x.grad = None
    make(2)(x).square().sum().backward()
    torch.testing.assert_close(got, x.grad)
    report = ort_dynamo.report()
    assert report.ort_nodes > 0 and report.fallback_nodes == 0, report.fallbacks
