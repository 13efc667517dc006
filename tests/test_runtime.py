"""The run stage: zero-copy hand-off, sessions per graph, shapes, odd inputs and outputs."""

import copy
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
from onnxruntime.capi import _pybind_state as C

import ort_dynamo
from parity import partition_runner


def test_cpu_path_never_goes_through_numpy(monkeypatch):
    """Inputs are wrapped in place (their data pointers reach ORT); numpy is never touched."""

    def numpy_path(*args, **kwargs):
        raise AssertionError("ort_dynamo copied through numpy")

    monkeypatch.setattr(C.InferenceSession, "run", numpy_path)
    monkeypatch.setattr(C.OrtValue, "numpy", numpy_path)
    monkeypatch.setattr(C.OrtValue, "ortvalue_from_numpy", numpy_path)
    handed_over = []
    original = C.OrtValueVector.push_back_batch

    def spy(self, tensors, pointers, *rest):
        handed_over.append((list(tensors), list(pointers)))
        return original(self, tensors, pointers, *rest)

    monkeypatch.setattr(C.OrtValueVector, "push_back_batch", spy)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    x = torch.randn(16, 32, requires_grad=True)
    out = torch.compile(model, backend="ort")(x)
    out.sum().backward()
    torch.testing.assert_close(out, model(x))
    assert handed_over, "the OrtValueVector batch path was not taken"
    for tensors, pointers in handed_over:
        assert pointers == [t.data_ptr() for t in tensors]
    assert any(x.data_ptr() in pointers for _, pointers in handed_over)


def test_outputs_are_ort_buffers_handed_over_by_dlpack(monkeypatch):
    """Outputs come from ORT's own allocation through DLPack: no copy back into PyTorch."""
    seen = []
    original = C.OrtValueVector.to_dlpacks

    def spy(self, to_tensor):
        capsules = original(self, None)
        tensors = [torch._C._from_dlpack(c) for c in capsules]
        seen.extend(t.data_ptr() for t in tensors)
        return tensors

    monkeypatch.setattr(C.OrtValueVector, "to_dlpacks", spy)
    out = torch.compile(lambda a, b: (a @ b).relu(), backend="ort")(torch.randn(8, 8), torch.randn(8, 8))
    assert out.data_ptr() in seen


def test_inference_runs_one_graph_per_partition():
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2)).eval()
    compiled = torch.compile(model, backend="ort")
    x = torch.randn(4, 8)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(compiled(x), model(x))
    report = ort_dynamo.report()
    assert [g.kind for g in report.graphs] == ["inference"]
    graph = report.graphs[0]
    assert graph.partitions == 1 and graph.sessions == 1 and graph.runs == 3
    assert report.fallback_nodes == 0


def test_changing_batch_size_gives_right_results():
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    compiled = torch.compile(model, backend="ort")
    for batch in (2, 5, 2, 9):
        x = torch.randn(batch, 8)
        torch.testing.assert_close(compiled(x), model(x))


def test_dynamic_true_does_not_recompile_or_reexport_for_new_batch_or_length():
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 3))
    compiled = torch.compile(model, backend="ort", dynamic=True)
    # Sizes 0 and 1 are always specialized by Dynamo, so they would recompile: not used here.
    for batch, length in ((2, 5), (3, 7), (6, 4), (4, 9)):
        x = torch.randn(batch, length, 8, requires_grad=True)
        out = compiled(x)
        torch.testing.assert_close(out, model(x))
        out.sum().backward()
    report = ort_dynamo.report()
    assert sorted(g.kind for g in report.graphs) == ["backward", "forward"]
    assert report.exports == 2 and report.sessions == 2
    assert report.graphs[0].runs == 4


def test_odd_inputs_and_outputs():
    """None outputs, passthrough inputs, repeated outputs, scalars, int64 indices, bool masks,
    0-d tensors, non-contiguous inputs."""

    def fn(x, idx, mask, scale: float, zero_d):
        picked = x[idx]  # int64 indices
        masked = x.masked_fill(mask, 0.0)  # bool mask
        y = (masked * scale + zero_d).sum(-1)
        return y, y, picked, idx, None, mask.any()

    x = torch.randn(6, 4).t()  # non-contiguous
    idx = torch.tensor([0, 2, 2, 1])
    mask = torch.rand(4, 6) > 0.5
    zero_d = torch.tensor(0.5)
    compiled = torch.compile(fn, backend="ort")
    for scale in (2.0, 3.0):
        got, want = compiled(x, idx, mask, scale, zero_d), fn(x, idx, mask, scale, zero_d)
        assert got[4] is None and got[3] is idx
        assert got[5].dtype == torch.bool
        for g, w in zip(got, want):
            if w is not None:
                torch.testing.assert_close(g, w)
    assert ort_dynamo.report().fallback_nodes == 0


def test_dynamic_scalar_and_symint_inputs():
    def fn(x, n: int):
        return x.view(n, -1) * n

    compiled = torch.compile(fn, backend="ort", dynamic=True)
    for n in (2, 4, 3):
        x = torch.randn(12)
        torch.testing.assert_close(compiled(x, n), fn(x, n))
    assert ort_dynamo.report().fallback_nodes == 0, ort_dynamo.report()


def test_bfloat16_and_empty_tensors():
    def fn(a, b, empty):
        return (a * b).sum(), torch.cat([empty, a.float()]).sum()

    a = torch.randn(5, dtype=torch.bfloat16)
    b = torch.randn(5, dtype=torch.bfloat16)
    empty = torch.zeros(0)
    got = torch.compile(fn, backend="ort")(a, b, empty)
    want = fn(a, b, empty)
    assert got[0].dtype == torch.bfloat16
    torch.testing.assert_close(got[0], want[0], rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got[1], want[1])
    assert ort_dynamo.report().fallback_nodes == 0, ort_dynamo.report()


def test_cpu_sessions_do_not_spin():
    from ort_dynamo.options import OrtOptions
    from ort_dynamo.run import session_options

    so = session_options(OrtOptions())
    assert so.get_session_config_entry("session.intra_op.allow_spinning") == "0"


def test_the_memory_pattern_is_off_on_cpu_and_an_option_on_cuda(monkeypatch):
    """ORT's memory pattern (one block of each run's planned peak) fragments the shared CPU
    arena, so CPU sessions never use it; on CUDA it is off (it raised the step's peak above
    eager's) unless ``cuda_memory_pattern=True``.
    (The CUDA sessions' allocator is registered elsewhere: not needed to read the options.)"""
    from ort_dynamo import _cuda_allocator
    from ort_dynamo.options import OrtOptions, resolve_options
    from ort_dynamo.run import session_options

    monkeypatch.setattr(_cuda_allocator, "register", lambda *args: None)
    assert not session_options(OrtOptions()).enable_mem_pattern
    assert not session_options(OrtOptions(cuda_memory_pattern=True)).enable_mem_pattern
    assert not session_options(OrtOptions(), "cuda").enable_mem_pattern
    assert session_options(OrtOptions(cuda_memory_pattern=True), "cuda").enable_mem_pattern
    monkeypatch.setenv("ORT_DYNAMO_CUDA_MEMORY_PATTERN", "1")
    assert session_options(resolve_options(None), "cuda").enable_mem_pattern


def test_save_onnx_writes_models_and_fx_graphs(tmp_path):
    model = nn.Linear(4, 2)
    x = torch.randn(3, 4, requires_grad=True)
    opts = {"save_onnx": True, "save_path": str(tmp_path / "models"), "onnx_prefix": "mlp"}
    torch.compile(model, backend="ort", options=opts)(x).sum().backward()
    files = sorted(os.listdir(tmp_path / "models"))
    assert "mlp_forward_0_fused_0.onnx" in files and "mlp_backward_0_fused_0.onnx" in files
    assert "mlp_forward_0_fused_0.fx.txt" in files
    fx_text = (tmp_path / "models" / "mlp_forward_0_fused_0.fx.txt").read_text()
    assert "torch.ops.aten" in fx_text


def test_backend_name_works_in_a_fresh_interpreter_without_importing_ort_dynamo():
    code = textwrap.dedent("""
        import sys, torch
        f = torch.compile(lambda x: (x * 2).sin(), backend="ort")
        x = torch.randn(4)
        torch.testing.assert_close(f(x), (x * 2).sin())
        assert "ort_dynamo" in sys.modules  # loaded through the entry point
        import ort_dynamo
        assert ort_dynamo.report().ort_nodes == 2, ort_dynamo.report()
        print("OK")
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("OK")


def test_backend_name_works_from_a_checkout_without_an_installed_entry_point():
    """Run from source (PYTHONPATH, no pip install), no entry point declares "ort": importing
    ort_dynamo registers the name, so ``backend="ort"`` still works."""
    code = textwrap.dedent("""
        import importlib.metadata as metadata
        real = metadata.entry_points
        def without_ours(**selection):
            if selection.get("group") == "torch_dynamo_backends":
                return metadata.EntryPoints([])
            return real(**selection)
        metadata.entry_points = without_ours
        import torch
        import ort_dynamo
        from torch._dynamo.backends import registry
        assert registry._COMPILER_FNS["ort"] is ort_dynamo.ort_backend
        fn = torch.compile(lambda x: x.sin() * 2, backend="ort")
        x = torch.randn(4)
        assert torch.allclose(fn(x), x.sin() * 2)
        print("ok", ort_dynamo.report().ort_nodes)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.split()[0] == "ok" and int(out.stdout.split()[1]) > 0, out.stderr[-2000:]


def test_reset_clears_report_and_recompiles():
    model = nn.Linear(2, 2)
    compiled = torch.compile(model, backend="ort")
    compiled(torch.randn(1, 2))
    assert len(ort_dynamo.report().graphs) == 1
    ort_dynamo.reset()
    assert len(ort_dynamo.report().graphs) == 0
    compiled(torch.randn(1, 2))
    assert len(ort_dynamo.report().graphs) == 1


def test_report_prints_a_table_and_saves_json(tmp_path):
    torch.compile(nn.Linear(2, 2), backend="ort")(torch.randn(1, 2))
    text = str(ort_dynamo.report())
    assert "on ORT" in text and "inference_0" in text or "forward_0" in text
    path = tmp_path / "report.json"
    ort_dynamo.report().save(str(path))
    import json

    data = json.loads(path.read_text())
    assert data["ort_nodes"] == ort_dynamo.report().ort_nodes and data["graphs"]


def test_report_lists_dynamo_graph_breaks_with_their_reason():
    def fn(x):
        y = x.sin()
        print("side effect")  # Dynamo cannot capture print: a graph break
        return y.cos()

    x = torch.randn(3)
    torch.testing.assert_close(torch.compile(fn, backend="ort")(x), x.sin().cos())
    report = ort_dynamo.report()
    assert sum(report.graph_breaks.values()) >= 1, report.graph_breaks
    assert any("print" in reason for reason in report.graph_breaks)
    assert "Dynamo graph breaks" in str(report)
    assert len(report.graphs) == 2 and report.fallback_nodes == 0  # both halves ran on ORT


def test_report_tells_apart_the_same_graph_break_at_two_calls():
    log = logging.getLogger("ort_dynamo_tests.breaks")

    def fn(x):
        log.warning("before the product")
        y = x * 2
        log.warning("after the product")
        return y + 1

    torch.compile(fn, backend="ort")(torch.randn(3))
    lines = [line for line in str(ort_dynamo.report()).splitlines() if line.startswith("  1 x logging.Logger")]
    assert len(lines) == 2, str(ort_dynamo.report())
    assert "before the product" in lines[0] + lines[1] and "after the product" in lines[0] + lines[1]


def test_report_lists_a_data_dependent_branch_as_a_graph_break():
    """Dynamo counts a branch on a tensor's value apart from breaks at a call; both split the graph."""

    def fn(x):
        y = x.sin()
        if y.sum() > 0:
            y = y * 2
        return y.cos()

    x = torch.ones(3)
    torch.testing.assert_close(torch.compile(fn, backend="ort")(x), (x.sin() * 2).cos())
    report = ort_dynamo.report()
    assert any("Data-dependent branching" in reason for reason in report.graph_breaks), report.graph_breaks
    assert "Data-dependent branching" in str(report)


def test_int32_indices_run_on_ort():
    """torch indexes with int32 tensors; ONNX GatherND/ScatterND need int64 (cast at export)."""
    idx = torch.tensor([4, 1, 1], dtype=torch.int32)

    def fn(x, values):
        return x[idx] * 2, x.index_put((idx,), values, accumulate=True)

    x, values = torch.randn(6), torch.randn(3)
    for got, want in zip(torch.compile(fn, backend="ort")(x, values), fn(x, values)):
        torch.testing.assert_close(got, want)
    assert ort_dynamo.report().fallback_nodes == 0, ort_dynamo.report()


def test_bool_input_next_to_an_empty_tensor_runs_on_ort():
    """An empty input sends every input through the one-by-one DLPack path, which must carry
    bool tensors too (ORT's DLPack import has no bool type)."""
    def fn(mask, x, empty):
        return torch.where(mask, x, 0.0) + empty.sum()

    mask, x, empty = torch.tensor([True, False, True]), torch.randn(3), torch.zeros(0)
    compiled = torch.compile(fn, backend="ort", options={"fallback_policy": "DISABLE"})
    torch.testing.assert_close(compiled(mask, x, empty), fn(mask, x, empty))
    assert ort_dynamo.report().fallback_nodes == 0, ort_dynamo.report()


def test_cpu_sessions_share_one_arena():
    """Forward and backward sessions peak at different times: one shared CPU arena holds the
    larger peak instead of each session keeping its own."""
    from ort_dynamo.run import session_options

    so = session_options(ort_dynamo.OrtOptions())
    assert so.get_session_config_entry("session.use_env_allocators") == "1"
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    compiled = torch.compile(model, backend="ort")
    x = torch.randn(4, 8)
    compiled(x).sum().backward()
    assert ort_dynamo.report().sessions == 2 and ort_dynamo.report().fallback_nodes == 0


def test_the_shared_arena_settings_are_ones_onnxruntime_accepts():
    """A setting ORT rejects would leave every session its own arena (with a warning): the
    process would hold each session's peak, not one."""
    import onnxruntime as ort

    from ort_dynamo import run as run_stage

    config = ort.OrtArenaCfg(run_stage._SHARED_ARENA_CONFIG)
    assert config.initial_chunk_size_bytes == run_stage._SHARED_ARENA_CONFIG["initial_chunk_size_bytes"]
    assert config.max_dead_bytes_per_chunk == run_stage._SHARED_ARENA_CONFIG["max_dead_bytes_per_chunk"]


def test_shared_cpu_arena_off_keeps_the_applications_own_cpu_allocator():
    """An application registered its own CPU arena (capped at 3 MB here). By default
    ort_dynamo's shared arena replaces it, and a 4 MB output fits; with
    ``shared_cpu_arena=False`` our sessions allocate from the application's, and the cap shows,
    for the first model and for one compiled after another model trained.

    The cap is 3 MB, not 1 MB: the arena's first region is 1 MB, and ORT's ``Reserve`` (a
    session's small initializers) does not check the cap; once reserves push the total past a
    1 MB cap, ORT's ``limit - total`` wraps around and the cap stops holding."""
    code = textwrap.dedent("""
        import sys, onnxruntime as ort, torch
        import ort_dynamo
        memory = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
        ort.create_and_register_allocator(memory, ort.OrtArenaCfg(3 << 20, 0, -1, -1))
        options = {"shared_cpu_arena": sys.argv[1] == "shared", "fallback_policy": "DISABLE"}
        if sys.argv[2] == "after_training":
            first = torch.compile(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()),
                                  backend="ort", options=options)
            first(torch.randn(2, 8)).sum().backward()
        f = torch.compile(torch.nn.Linear(256, 256), backend="ort", options=options)
        try:
            with torch.no_grad():
                f(torch.randn(4096, 256))
            print("RAN")
        except ort_dynamo.OrtRuntimeError as exc:
            print("CAPPED" if "Available memory" in str(exc) else exc)
    """)
    for arena, expected in (("shared", "RAN"), ("own", "CAPPED")):
        for when in ("first", "after_training"):
            result = subprocess.run([sys.executable, "-c", code, arena, when], capture_output=True, text=True,
                                    timeout=300)
            assert result.returncode == 0, result.stderr[-3000:]
            assert result.stdout.strip().splitlines()[-1] == expected, (arena, when, result.stdout[-2000:])


class _Attention(nn.Module):
    """Scaled dot-product attention over heads, k computed (as rotary embeddings compute
    Llama's): its backward takes saved permuted views (the heads' transposes, kᵀ)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = (t.view(2, 8, 2, 8).transpose(1, 2) for t in self.qkv(x).split(16, dim=-1))
        return nn.functional.scaled_dot_product_attention(q, k.tanh(), v).pow(2).sum()


def test_saved_permuted_views_keep_eagers_strides_and_reach_backward_without_a_copy(monkeypatch):
    """A graph output that eager has as a permuted view (a saved kᵀ) comes back from ORT in
    its buffer's layout and is permuted in PyTorch, with eager's strides; the graph that
    reads it takes it as it is, with no ``.contiguous()`` copy on the way in (there was one
    before)."""
    from ort_dynamo.export import ExportedGraph

    layouts = []
    real = ExportedGraph.ort_layout

    def recorded(self, index, tensor):
        out = real(self, index, tensor)
        if self.input_permutations and self.input_permutations[index] is not None:
            layouts.append((tuple(tensor.shape), out.is_contiguous()))
        return out

    monkeypatch.setattr(ExportedGraph, "ort_layout", recorded)
    torch.manual_seed(0)
    eager = _Attention()
    compiled = torch.compile(copy.deepcopy(eager), backend="ort", options={"fallback_policy": "DISABLE"})
    x = torch.randn(2, 8, 16)
    eager(x).backward()
    compiled(x).backward()
    for (name, want), got in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-6, msg=name)
    permuted = [shape for shape, contiguous in layouts if len(shape) >= 3]
    assert permuted, layouts  # permuted views did arrive
    assert all(contiguous for _, contiguous in layouts), layouts


def test_a_cuda_partition_gets_a_session_for_each_stream_it_runs_on(monkeypatch):
    """A CUDA session runs on the stream it was made with (``user_compute_stream``). Called on
    another stream, the partition gets a session made with that one: run on the first, ORT would
    read inputs before PyTorch's work on the new stream had written them. (Without a GPU: the
    session and the stream are stand-ins; what is checked is which stream each session gets.)"""
    from ort_dynamo import run as run_stage

    class FakeSession:
        def __init__(self, model, options, providers):
            self.stream = dict(providers[0][1])["user_compute_stream"]

        def get_providers(self):
            return ["CUDAExecutionProvider", "CPUExecutionProvider"]

    current = {"stream": 1111}
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: type("Stream", (), {"cuda_stream": current["stream"]})())
    monkeypatch.setattr(run_stage.ort, "get_available_providers",
                        lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(run_stage.ort, "InferenceSession", FakeSession)
    _, runner = partition_runner(lambda x: x.sin() * 2, torch.randn(4))
    gpu = torch.device("cuda", 0)

    first, _, _, options, _ = runner._session(gpu)
    assert first.stream == "1111" and runner._session(gpu)[0] is first
    assert options.get_run_config_entry("disable_synchronize_execution_providers") == "1"
    current["stream"] = 2222  # e.g. inside `with torch.cuda.stream(side_stream):`
    second = runner._session(gpu)[0]
    assert second.stream == "2222"
    current["stream"] = 1111
    assert runner._session(gpu)[0] is first
    # PyTorch's default stream is 0 to PyTorch, "none given" to ORT: it is named cudaStreamLegacy.
    current["stream"] = 0
    assert runner._session(gpu)[0].stream == "1"


@pytest.fixture
def cuda_settings():
    """Sets ``torch.backends.cudnn.benchmark`` (``set_flags``: the attribute refuses once
    ``torch.testing._internal`` has frozen the flags); restores it and PyTorch's float32 matmul
    precision, legacy and newer API, as they were."""
    legacy, newer = torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.fp32_precision
    benchmark = torch.backends.cudnn.benchmark
    yield lambda value: torch.backends.cudnn.set_flags(_benchmark=value, _fp32_precision=None)
    torch.backends.cudnn.set_flags(_benchmark=benchmark, _fp32_precision=None)
    torch.set_float32_matmul_precision(legacy)
    torch.backends.cuda.matmul.fp32_precision = newer


def test_a_cuda_session_follows_pytorchs_tf32_and_cudnn_benchmark_settings(monkeypatch, cuda_settings):
    """ORT's CUDA provider uses TF32 for float32 products and searches every convolution's
    algorithms exhaustively unless told otherwise; PyTorch does neither by default. A session
    is made with PyTorch's settings at the call, and a change of them gets a new session, as a
    new stream does. (Without a GPU: the sessions are stand-ins; checked is what they are made with.)"""
    from ort_dynamo import run as run_stage

    class FakeSession:
        def __init__(self, model, options, providers):
            self.cuda = dict(providers[0][1])

        def get_providers(self):
            return ["CUDAExecutionProvider", "CPUExecutionProvider"]

    monkeypatch.setattr(run_stage, "compute_stream", lambda device: 1111)
    monkeypatch.setattr(run_stage.ort, "get_available_providers",
                        lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(run_stage.ort, "InferenceSession", FakeSession)
    cuda_settings(False)
    _, runner = partition_runner(lambda x: x @ x, torch.randn(4, 4))
    gpu = torch.device("cuda", 0)

    default = runner._session(gpu)[0]
    assert default.cuda["use_tf32"] == "0" and default.cuda["cudnn_conv_algo_search"] == "HEURISTIC"
    torch.set_float32_matmul_precision("high")
    tf32 = runner._session(gpu)[0]
    assert tf32.cuda["use_tf32"] == "1" and tf32 is not default
    torch.backends.cuda.matmul.fp32_precision = "ieee"  # the newer API decides once it is used
    assert runner._session(gpu)[0] is default
    cuda_settings(True)
    assert runner._session(gpu)[0].cuda["cudnn_conv_algo_search"] == "EXHAUSTIVE"
    assert run_stage.torch_settings(torch.device("cpu")) == ()


def test_a_cuda_provider_names_its_device_only_when_it_is_not_the_first(monkeypatch):
    """ORT 1.31 warns once per session ("No registered plugin EP device found") when device_id
    is given, so it is given only where it is not the provider's default, 0."""
    from ort_dynamo import run as run_stage

    monkeypatch.setattr(run_stage, "compute_stream", lambda device: 1111)
    monkeypatch.setattr(run_stage.ort, "get_available_providers",
                        lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    options = ort_dynamo.OrtOptions()
    first = dict(run_stage.providers_for(torch.device("cuda", 0), options)[0][1])
    second = dict(run_stage.providers_for(torch.device("cuda", 1), options)[0][1])
    assert "device_id" not in first and second["device_id"] == "1"
    assert first["user_compute_stream"] == second["user_compute_stream"] == "1111"


def test_an_onnxruntime_older_than_the_tested_one_is_refused(monkeypatch):
    """Before 1.25, ORT's CPU kernels answer an integer division by zero with SIGFPE: the
    process, and the training state in it, would be gone; 1.25 still pools some windows
    wrongly. No session is made with an onnxruntime older than the one the suite passes on."""
    from ort_dynamo import OrtRuntimeError
    from ort_dynamo import run as run_stage

    assert run_stage.onnxruntime_problem("1.31.1") == run_stage.onnxruntime_problem("1.32.0") == ""
    assert "average pooling" in run_stage.onnxruntime_problem("1.25.0")
    monkeypatch.setattr(run_stage.ort, "__version__", "1.24.4")
    compiled = torch.compile(lambda a, b: a // b, backend="ort")
    with pytest.raises(OrtRuntimeError, match=r"needs onnxruntime >= 1\.31, this is 1\.24\.4: .*division by zero"):
        compiled(torch.tensor([4, 5]), torch.tensor([2, 1]))


def test_cuda_runs_do_not_wait_for_the_device_and_cpu_runs_are_left_as_they_are():
    """ORT synchronizes the device after each run unless a run option says not to; ORT and
    PyTorch share one stream, so on CUDA that wait would only stall the host per partition."""
    from ort_dynamo.run import run_options

    key = "disable_synchronize_execution_providers"
    assert run_options(torch.device("cuda", 0)).get_run_config_entry(key) == "1"
    with pytest.raises(RuntimeError, match="does not have configuration"):
        run_options(torch.device("cpu")).get_run_config_entry(key)


def test_a_compiled_graph_keeps_the_onnx_bytes_it_runs_not_the_ir_they_came_from(monkeypatch):
    """The IR of an exported partition is tens of thousands of Python objects; kept for the
    life of the compiled graph, every full garbage collection of the process walks them."""
    import gc
    import weakref

    from ort_dynamo import export

    models = []
    export_graph = export.export_graph

    def export_and_watch(*args, **kwargs):
        exported = export_graph(*args, **kwargs)
        models.append(weakref.ref(exported.model))
        return exported

    monkeypatch.setattr(export, "export_graph", export_and_watch)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
    expected = copy.deepcopy(model)
    x = torch.randn(4, 8)
    torch.compile(model, backend="ort")(x).sum().backward()
    expected(x).sum().backward()
    gc.collect()
    assert len(models) == 2 and ort_dynamo.report().fallback_nodes == 0
    assert [ref() for ref in models] == [None, None]
    assert torch.allclose(model[0].weight.grad, expected[0].weight.grad, atol=1e-6)


def test_the_cuda_allocator_adapter_hands_ort_pytorchs_blocks_and_names_a_refused_size():
    """ORT's CUDA provider calls ``void* alloc(size_t)``/``free(void*)``; PyTorch's C shim has
    ``int raw_alloc(uint64, void**)``/``raw_delete(void*)``. The adapter between them, with
    stand-ins for PyTorch's two (no GPU here): blocks pass through, and a refusal is NULL to
    ORT and a size ort_dynamo can name in its out-of-memory error."""
    import ctypes

    from ort_dynamo import _cuda_allocator, _kernels

    if _kernels._compiler() is None:
        pytest.skip("no C compiler")
    adapter = _cuda_allocator._adapter()
    blocks, freed = {}, []

    @ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_uint64, ctypes.POINTER(ctypes.c_void_p))
    def raw_alloc(nbytes, out):
        if nbytes > 1 << 20:
            return 1  # PyTorch's shim: an error code, its exception caught
        block = ctypes.create_string_buffer(nbytes)
        blocks[ctypes.addressof(block)] = block
        out[0] = ctypes.addressof(block)
        return 0

    @ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p)
    def raw_delete(pointer):
        freed.append(pointer)
        return 0

    adapter.ortd_torch_allocator_init(ctypes.cast(raw_alloc, ctypes.c_void_p), ctypes.cast(raw_delete, ctypes.c_void_p))
    pointer = adapter.ortd_torch_alloc(4096)
    assert pointer in blocks and adapter.ortd_torch_refused_bytes() == 0
    adapter.ortd_torch_free(pointer)
    adapter.ortd_torch_free(None)  # ORT frees null pointers: not PyTorch's business
    assert freed == [pointer]
    assert adapter.ortd_torch_alloc(3 << 20) is None
    assert adapter.ortd_torch_refused_bytes() == 3 << 20
    assert adapter.ortd_torch_refused_bytes() == 0  # read once


def test_without_pytorchs_cuda_allocator_sessions_fall_back_to_an_ort_arena_and_say_why(monkeypatch, caplog):
    """``cuda_allocator="pytorch"`` where it cannot be had (here: a torch without CUDA, an
    onnxruntime without the CUDA provider): a warning names the reason and what is used
    instead; the choice is made once per GPU and kept."""
    from ort_dynamo import _cuda_allocator

    monkeypatch.setattr(_cuda_allocator, "_registered", {})
    monkeypatch.setattr(_cuda_allocator, "_register_shared_arena", lambda device_index: None)
    problem = _cuda_allocator.torch_allocator_problem()
    if not problem:
        pytest.skip("PyTorch's CUDA allocator is available here (tests/test_cuda.py covers it)")
    with caplog.at_level("WARNING", logger="ort_dynamo"):
        assert _cuda_allocator.register(0, "pytorch") == "shared_arena"
    assert problem in caplog.text and "share one ORT arena instead" in caplog.text
    assert _cuda_allocator.register(0, "per_session") == "shared_arena" == _cuda_allocator.registered(0)
    assert _cuda_allocator.refused_bytes(0) == 0


def test_cuda_allocator_option_names_its_choices():
    with pytest.raises(ort_dynamo.OptionsError, match="cuda_allocator must be one of .*pytorch.*got 'torch'"):
        ort_dynamo.OrtOptions(cuda_allocator="torch")


def test_pytorchs_allocator_is_registered_with_ort_as_the_gpus_external_allocator(monkeypatch):
    """What ``cuda_allocator="pytorch"`` hands ORT (no GPU here: torch's shim and ORT's
    registration are stand-ins): the adapter's two functions as the CUDA provider's
    ``gpu_external_alloc``/``gpu_external_free`` (decimal addresses, as ORT parses them), for
    the right device, once; the adapter forwards to torch's shim functions it was given."""
    import ctypes

    from ort_dynamo import _cuda_allocator, _kernels

    if _kernels._compiler() is None:
        pytest.skip("no C compiler")
    calls = []

    @ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_uint64, ctypes.POINTER(ctypes.c_void_p))
    def raw_alloc(nbytes, out):
        calls.append(("alloc", nbytes))
        out[0] = 4096
        return 0

    @ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p)
    def raw_delete(pointer):
        calls.append(("delete", pointer))
        return 0

    shim = type("Shim", (), {"aoti_torch_cuda_caching_allocator_raw_alloc": raw_alloc,
                             "aoti_torch_cuda_caching_allocator_raw_delete": raw_delete})()
    registered = []
    monkeypatch.setattr(_cuda_allocator, "_registered", {})
    monkeypatch.setattr(_cuda_allocator, "_adapters", {})
    monkeypatch.setattr(_cuda_allocator, "torch_allocator_problem", lambda: "")
    monkeypatch.setattr(_kernels, "torch_library", lambda name: shim)
    monkeypatch.setattr(_cuda_allocator.ort, "create_and_register_allocator_v2",
                        lambda provider, memory, options, arena: registered.append((provider, options)))
    assert _cuda_allocator.register(1, "pytorch") == "pytorch" == _cuda_allocator.registered(1)
    assert _cuda_allocator.register(1, "pytorch") == "pytorch" and len(registered) == 1  # once per GPU
    provider, options = registered[0]
    assert provider == "CUDAExecutionProvider" and options["device_id"] == "1"
    alloc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t)(int(options["gpu_external_alloc"]))
    free = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(int(options["gpu_external_free"]))
    assert alloc(100) == 4096
    free(4096)
    assert calls == [("alloc", 100), ("delete", 4096)]


def test_inputs_of_another_dtype_than_the_last_run_are_never_read_as_its_types():
    """A partition keeps its inputs' numpy types from one run to the next, checked in the same
    pass as their device and layout. Given float64 where the last run had float32 (Dynamo's
    guards make that a new graph; a runner called directly can see it), the types are looked up
    again: ORT refuses the input for the model's float32, rather than reading its bytes as
    float32, and the values of later float32 runs are still right."""
    import dataclasses

    from ort_dynamo.errors import OrtRuntimeError
    from ort_dynamo.options import FallbackPolicy

    exported, runner = partition_runner(lambda x: x * 2, torch.randn(4))
    runner.options = dataclasses.replace(runner.options, fallback_policy=FallbackPolicy.DISABLE)  # ORT's error itself
    x = torch.arange(4.0)
    assert torch.equal(runner(x), x * 2) and torch.equal(runner(x + 1), (x + 1) * 2)
    with pytest.raises(OrtRuntimeError, match="(?i)type"):
        runner(x.double())
    assert torch.equal(runner(x + 2), (x + 2) * 2)
    strided = torch.arange(8.0)[::2]  # not contiguous: copied, then read
    assert torch.equal(runner(strided), strided * 2)
