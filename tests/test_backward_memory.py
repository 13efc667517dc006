"""Training memory: saved activations are freed as the backward goes (backward_segments) and
views that make graph outputs are PyTorch views, not ORT copies."""

import copy
import math
import weakref

import pytest
import torch
import torch.nn as nn

import ort_dynamo
from ort_dynamo import _pointwise
from ort_dynamo import run as run_stage
from parity import assert_all_on_ort


def _deep_model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.LayerNorm(32)) for _ in range(8)])


def _live_saved_tensors_per_backward_run(monkeypatch, segments):
    """How many of the forward's saved activations are still alive as each backward ORT run starts."""
    ort_dynamo.reset()
    model = _deep_model()
    compiled = torch.compile(model, backend="ort", options={"backward_segments": segments})
    x = torch.randn(16, 32, requires_grad=True)
    compiled(x).sum().backward()  # compile both graphs first
    saved, alive_at_run = [], []
    original = run_stage.OrtRunner._run

    def spy(runner, args):
        if runner.report.kind == "backward":
            alive_at_run.append(sum(ref() is not None for ref in saved))
        return original(runner, args)

    monkeypatch.setattr(run_stage.OrtRunner, "_run", spy)

    parameters = {p.data_ptr() for p in model.parameters()}

    def pack(tensor):
        if tensor.data_ptr() not in parameters:  # weights live on anyway; count activations
            saved.append(weakref.ref(tensor))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = compiled(x).sum()
    loss.backward()
    assert_all_on_ort()
    return alive_at_run, len(saved)


def test_segmented_backward_frees_saved_activations_before_it_ends(monkeypatch):
    whole, n_saved = _live_saved_tensors_per_backward_run(monkeypatch, 1)
    assert len(whole) == 1 and whole[0] == n_saved  # one run: all saved tensors live to the end

    segmented, _ = _live_saved_tensors_per_backward_run(monkeypatch, 4)
    assert len(segmented) >= 3, segmented
    assert segmented == sorted(segmented, reverse=True) and segmented[-1] < n_saved // 2, (segmented, n_saved)


def test_segmented_backward_gives_the_same_gradients():
    grads = {}
    for segments in (1, 4):
        ort_dynamo.reset()
        model = _deep_model()
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
        torch.compile(model, backend="ort", options={"backward_segments": segments})(x).square().sum().backward()
        backward = next(g for g in ort_dynamo.report().graphs if g.kind == "backward")
        assert backward.partitions == (1 if segments == 1 else 4), backward.partitions
        grads[segments] = [x.grad, *(p.grad for p in model.parameters())]
    expected_model = _deep_model()
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    expected_model(x).square().sum().backward()
    expected = [x.grad, *(p.grad for p in expected_model.parameters())]
    for got1, got4, want in zip(grads[1], grads[4], expected):
        torch.testing.assert_close(got4, got1, rtol=0, atol=0)  # same kernels, cut in pieces
        torch.testing.assert_close(got4, want, rtol=1e-3, atol=1e-4)


def test_backward_segments_must_not_be_negative():
    with pytest.raises(ort_dynamo.OptionsError, match=r"backward_segments must be >= 0 \(0: by device\), got -1"):
        ort_dynamo.OrtOptions(backward_segments=-1)


def _default_backward_runs(model, x) -> int:
    ort_dynamo.reset()
    torch.compile(model, backend="ort")(x).sum().backward()
    return next(g for g in ort_dynamo.report().graphs if g.kind == "backward").partitions


def test_by_default_a_cpu_backward_runs_in_segments_when_it_reads_enough_to_free():
    """``backward_segments=0`` (the default) on CPU: one run per 8 MB the backward reads, up to 8
    (on CUDA one: ``tests/test_cuda.py::test_by_default_a_cuda_backward_is_one_ort_run``)."""
    wide = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.LayerNorm(256)) for _ in range(8)])
    assert 4 <= _default_backward_runs(wide, torch.randn(4096, 256, requires_grad=True)) <= 8  # ~100 MB saved
    # Under a megabyte: cutting it would free nothing worth a run, and split what kernels fuse.
    assert _default_backward_runs(_deep_model(), torch.randn(16, 32, requires_grad=True)) == 1


def test_a_short_backward_is_one_run_however_much_it_reads():
    """A group norm's backward reads 16 MB (two 8 MB runs by size) but has under 64 nodes: a
    second run would be its last few nodes alone, freeing nothing and unfusing its final Add."""
    layer = nn.GroupNorm(32, 64)
    assert _default_backward_runs(layer, torch.randn(8, 64, 64, 64, requires_grad=True)) == 1
    x = torch.randn(8, 64, 64, 64, requires_grad=True)
    want = x.detach().requires_grad_()
    (torch.compile(copy.deepcopy(layer), backend="ort")(x) * 1.5).square().sum().backward()
    (layer(want) * 1.5).square().sum().backward()
    torch.testing.assert_close(x.grad, want.grad, rtol=1e-4, atol=1e-4)


def test_output_views_alias_as_in_eager():
    def f(a, b):
        y = (a @ b).relu()
        return y, y.view(-1), y.t(), b.t()

    a, b = torch.randn(4, 6), torch.randn(6, 5)
    got = torch.compile(f, backend="ort")(a, b)
    for g, want in zip(got, f(a, b)):
        torch.testing.assert_close(g, want)
    y, flat, transposed, b_t = got
    assert flat.data_ptr() == y.data_ptr() and transposed.data_ptr() == y.data_ptr()
    assert b_t.data_ptr() == b.data_ptr()  # a view of the input, as eager's
    assert ort_dynamo.report().fallback_nodes == 0


def test_views_that_rely_on_eager_strides_are_computed_on_ort():
    # In eager, q * 2 keeps q's transposed layout, so its transpose back is contiguous and
    # AOTAutograd traces a plain view of it. ORT's result is contiguous: the same view would
    # fail (or an as_strided read the wrong elements), so ORT computes this output itself.
    def f(x):
        q = x.view(4, 8, 2, 3).transpose(1, 2)
        return (q * 2.0).transpose(1, 2).reshape(4, 8, 6)

    x = torch.randn(4, 8, 6)
    torch.testing.assert_close(torch.compile(f, backend="ort")(x), f(x))
    assert ort_dynamo.report().fallback_nodes == 0


def test_saved_transposed_weight_is_the_parameter_not_a_copy():
    ort_dynamo.reset()
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    compiled = torch.compile(model, backend="ort")
    x = torch.randn(8, 16)
    compiled(x).sum().backward()
    storages = []

    def pack(tensor):
        storages.append(tensor.untyped_storage().data_ptr())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = compiled(x).sum()
    loss.backward()
    assert model[2].weight.untyped_storage().data_ptr() in storages
    assert_all_on_ort()


def test_transposed_inputs_reach_ort_without_a_copy_and_fallback_still_sees_views(monkeypatch):
    from onnxruntime.capi import _pybind_state as C

    a, b = torch.randn(6, 4), torch.randn(5, 6)
    x, y = a.t(), b.t()  # non-contiguous views, as saved `weight.t()` activations arrive

    def f(x, y):
        return (x @ y).tanh()

    handed = []
    original = C.OrtValueVector.push_back_batch

    def spy(self, tensors, pointers, *rest):
        handed.extend(pointers)
        return original(self, tensors, pointers, *rest)

    monkeypatch.setattr(C.OrtValueVector, "push_back_batch", spy)
    compiled = torch.compile(f, backend="ort")
    torch.testing.assert_close(compiled(x, y), f(x, y))
    assert a.data_ptr() in handed and b.data_ptr() in handed  # the views' own memory, no copies

    def broken(runner, args):
        raise RuntimeError("simulated ORT failure")

    monkeypatch.setattr(run_stage.OrtRunner, "_run", broken)
    with pytest.warns(UserWarning, match="running it in PyTorch"):
        torch.testing.assert_close(compiled(x, y), f(x, y))  # the FX fallback takes the views as they are


class _TinyLanguageModel(nn.Module):
    def __init__(self, vocab=256, hidden=32, length=16):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, hidden), nn.Embedding(length, hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids):
        return self.head((self.tokens(ids) + self.positions(torch.arange(ids.shape[1]))).tanh())


def test_gradients_that_start_from_zeros_leave_no_zeros_in_the_sessions(monkeypatch, tmp_path):
    """The embeddings' gradients and the loss's start from zeros ([vocab, hidden], [tokens,
    vocab]). ORT folds zeros of a constant shape into an initializer kept for the session's
    life; none is left for it to fold, and the gradients are eager's (padding id and an
    ignored class among the targets)."""
    sessions = []
    real = run_stage.session_options

    def saving_optimized_models(options, *args, **kwargs):
        so = real(options, *args, **kwargs)
        so.optimized_model_filepath = str(tmp_path / f"session_{len(sessions)}.onnx")
        sessions.append(so.optimized_model_filepath)
        return so

    monkeypatch.setattr(run_stage, "session_options", saving_optimized_models)
    ort_dynamo.reset()
    torch.manual_seed(0)
    model, ids = _TinyLanguageModel(), torch.randint(0, 256, (4, 16))
    ids[0, :4], targets = 0, ids.roll(-1, dims=1)

    def loss_of(m):
        return nn.functional.cross_entropy(m(ids).flatten(0, 1), targets.flatten(), ignore_index=0)

    compiled = torch.compile(copy.deepcopy(model), backend="ort", options={"fallback_policy": "DISABLE"})
    loss_of(compiled).backward()
    ort_dynamo.wait_for_kernels()  # the sessions with the kernels are made on the next step
    compiled.zero_grad()
    loss_of(compiled).backward()
    loss_of(model).backward()
    for (name, want), got in zip(model.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-6, msg=name)
    import onnx

    # The sessions with the kernels: the backward's, where the zeros are (the forward is too
    # small for kernels). A graph whose kernels were not built when its first session was made
    # (a cold kernel folder) runs an interim session without them until then, and ORT folds
    # that one's zeros: it is dropped with them.
    models = [onnx.load(path) for path in sessions]
    sizes = {path: max([math.prod(t.dims) for t in model.graph.initializer], default=0)
             for path, model in zip(sessions, models) if any(n.domain == _pointwise.DOMAIN for n in model.graph.node)}
    assert sizes and max(sizes.values()) < 16 * 32, sizes  # the smallest zeros: positions'
    assert sum(n.op_type == "ScatterAddRowsToZeros" for m in models for n in m.graph.node) == 2


def test_sessions_get_models_without_the_exporters_provenance_unless_saved(monkeypatch, tmp_path):
    """The exporter notes on each node its stack trace and module path, ~95% of a model's
    bytes, which ORT would keep for the session's life. The models ORT runs go without them;
    the files ``save_onnx`` writes for a person to read keep them."""
    import onnx

    runners = set()
    original = run_stage.OrtRunner._run

    def spy(runner, args):
        runners.add(runner)
        return original(runner, args)

    monkeypatch.setattr(run_stage.OrtRunner, "_run", spy)

    def train_step(options):
        ort_dynamo.reset()
        runners.clear()
        model = _deep_model()
        torch.compile(model, backend="ort", options=options)(torch.randn(4, 32)).sum().backward()
        assert_all_on_ort()
        assert {r.report.kind for r in runners} == {"forward", "backward"}
        return [onnx.load_from_string(r.model_bytes) for r in runners]

    def provenance(model):
        return [p.key for n in model.graph.node for p in n.metadata_props]

    assert not any(provenance(m) for m in train_step({}))

    saved = train_step({"save_onnx": True, "save_path": str(tmp_path)})
    assert all("namespace" in provenance(m) for m in saved)
    paths = ort_dynamo.report().graphs[0].onnx_paths
    namespaces = [p.value for n in onnx.load(paths[0]).graph.node for p in n.metadata_props if p.key == "namespace"]
    assert any("torch.nn.modules.linear.Linear" in namespace for namespace in namespaces)


def test_backward_runs_are_cut_where_the_fewest_bytes_cross():
    """A cut near the even one, but not through a large tensor made before it and read after
    (PyTorch would hold it between the two runs): at the even cut where nothing large crosses."""
    from ort_dynamo.partition import _cheap_cuts

    graph = torch.fx.Graph()
    value = graph.placeholder("x")
    value.meta["val"] = torch.empty(4)
    nodes = []
    for i in range(100):
        value = graph.call_function(torch.neg, (value,))
        value.meta["val"] = torch.empty(4)
        nodes.append(value)
    assert _cheap_cuts(nodes, 40) == {40, 80}
    nodes[35].meta["val"] = torch.empty(1 << 18)  # 1 MB, read 25 nodes later
    nodes[60].args = (nodes[59], nodes[35])
    nodes[60].target = torch.add
    assert _cheap_cuts(nodes, 40) == {35, 80}  # before it is made; 36..60 would hand it over
    # Runs of at least 38 nodes: a cut at 35 would leave a shorter first run, so the even cut;
    # no later cut leaves 38 nodes after it.
    assert _cheap_cuts(nodes, 40, shortest=38) == {40}
