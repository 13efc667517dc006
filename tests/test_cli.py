"""``python -m ort_dynamo``: run as a user would, in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import onnxruntime
import torch

import ort_dynamo
from ort_dynamo.cli import REPORT_PATH_ENV


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ort_dynamo", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


def test_info_prints_versions_real_providers_and_gpu_verdict():
    result = run_cli("info")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for version in (ort_dynamo.__version__, torch.__version__, onnxruntime.__version__):
        assert version in out
    providers_line = next(line for line in out.splitlines() if line.startswith("onnxruntime providers:"))
    assert "CPUExecutionProvider" in providers_line
    for provider in onnxruntime.get_available_providers():
        assert provider in providers_line
    gpu_ready = torch.cuda.is_available() and "CUDAExecutionProvider" in onnxruntime.get_available_providers()
    assert f"CUDA GPU usable: {'yes' if gpu_ready else 'no'}" in out
    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        assert "pip uninstall -y onnxruntime && pip install onnxruntime-gpu" in out
    from ort_dynamo import _kernels

    kernels_line = next(line for line in out.splitlines() if line.startswith("CPU pointwise kernels:"))
    assert kernels_line.split(": ", 1)[1].startswith("yes (" if _kernels.available() else "no: ")
    from ort_dynamo import _torch_attention

    attention_line = next(line for line in out.splitlines() if line.startswith("PyTorch's CPU attention inside ORT"))
    assert attention_line.endswith(_torch_attention.problem() or ": available")
    from ort_dynamo import _torch_blas

    products_line = next(line for line in out.splitlines() if line.startswith("CPU matrix products"))
    # "ORT's (torch's BLAS is taken by default only on ...)" names torch's BLAS too: the verdict leads
    verdict = products_line.split(": ", 1)[1]
    assert verdict.startswith("torch's BLAS") == _torch_blas.applies(ort_dynamo.OrtOptions(), "cpu")
    assert verdict.startswith(("torch's BLAS", "ORT's"))
    from ort_dynamo import _openmp

    threads_line = next(line for line in out.splitlines() if line.startswith("CPU sessions' threads"))
    verdict = threads_line.split(": ", 1)[1]
    assert verdict.startswith("PyTorch's OpenMP threads") == _openmp.applies(ort_dynamo.OrtOptions(), "cpu")


def test_info_tells_two_onnxruntime_wheels_in_one_folder_from_two_in_different_folders():
    """Both wheels in one environment overwrite each other's module (fix: reinstall one); one in
    the environment and one on PYTHONPATH (as the GPU machine's staging has it) do not: the
    first on the path is loaded, and info says which."""
    from ort_dynamo.cli import _cuda_verdict

    class NoGpu:
        class cuda:
            is_available = staticmethod(lambda: False)

        class version:
            cuda = None

        __version__ = "2.13.0+cpu"

    _, lines = _cuda_verdict(NoGpu, ["CPUExecutionProvider"],
                             {"onnxruntime": "/env/site-packages", "onnxruntime-gpu": "/env/site-packages"})
    assert any("overwrite each other's" in line and "--force-reinstall" in line for line in lines), lines
    _, lines = _cuda_verdict(NoGpu, ["CUDAExecutionProvider", "CPUExecutionProvider"],
                             {"onnxruntime": "/env/site-packages", "onnxruntime-gpu": "/tmp/ortsite"}, "/tmp/ortsite")
    assert not any("overwrite" in line for line in lines), lines
    assert any("onnxruntime-gpu in /tmp/ortsite" in line and "the one loaded is /tmp/ortsite" in line
               for line in lines), lines
    _, lines = _cuda_verdict(NoGpu, ["CPUExecutionProvider"], {"onnxruntime": "/env/site-packages"})
    assert not any("installed in different folders" in line or "overwrite" in line for line in lines), lines


def test_report_prints_what_a_run_saved(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    torch.compile(model, backend="ort")(torch.randn(3, 4)).sum().backward()
    saved = ort_dynamo.report()
    path = tmp_path / "run_report.json"
    saved.save(str(path))

    result = run_cli("report", env={REPORT_PATH_ENV: str(path)})
    assert result.returncode == 0, result.stderr
    assert f"{saved.ort_nodes} node(s) on ORT, 0 in PyTorch" in result.stdout
    for graph in saved.graphs:
        assert any(line.split()[:3] == [graph.name, graph.kind, str(graph.ort_nodes)]
                   for line in result.stdout.splitlines()), result.stdout

    as_json = run_cli("report", "--path", str(path), "--json")
    assert json.loads(as_json.stdout)["ort_nodes"] == saved.ort_nodes



def test_the_cli_prints_the_table_print_report_shows_kernels_stages_and_breaks_included(tmp_path):
    def fn(x):
        x = torch.tanh(x) * 2
        print("a graph break")  # Dynamo cannot capture print: two graphs
        return x.exp() + 1

    torch.compile(fn, backend="ort")(torch.randn(8, 8))
    saved = ort_dynamo.report()
    assert saved.graph_breaks and saved.stage_seconds()
    path = tmp_path / "run_report.json"
    saved.save(str(path))

    printed = run_cli("report", "--path", str(path)).stdout
    assert printed.splitlines()[0] == str(saved).splitlines()[0].replace("report:", f"report ({path}):")
    assert printed.splitlines()[1:] == str(saved).splitlines()[1:]
    assert "time per stage: " in printed and "Dynamo graph breaks (1):" in printed

def test_report_without_a_saved_run_says_how_to_save_one(tmp_path):
    result = run_cli("report", "--path", str(tmp_path / "missing.json"))
    assert result.returncode == 1
    assert "no report at" in result.stderr and REPORT_PATH_ENV in result.stderr


def test_help_lists_every_command_and_bench_names_what_exists():
    result = run_cli("--help")
    assert result.returncode == 0
    for command in ("info", "report", "compare", "bench"):
        assert f"    {command} " in result.stdout
    unknown = run_cli("bench", "no_such_benchmark")
    assert unknown.returncode == 2
    assert "no benchmark 'no_such_benchmark'" in unknown.stderr and "available:" in unknown.stderr


def test_report_saved_at_exit_is_printed_by_the_cli(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "run_{rank}.json"
    code = "import torch; torch.compile(lambda x: x.cos() + 1, backend='ort')(torch.ones(3))"
    env = dict(__import__("os").environ, ORT_DYNAMO_REPORT_PATH=str(path), RANK="1")
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)
    saved = tmp_path / "run_1.json"
    assert saved.exists()
    out = subprocess.run([sys.executable, "-m", "ort_dynamo", "report", "--path", str(saved)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "2 node(s) on ORT, 0 in PyTorch" in out.stdout
