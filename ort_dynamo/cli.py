"""``python -m ort_dynamo``: environment check, last run's report, and debugging/benchmark tools.

    python -m ort_dynamo info                 versions, execution providers, GPU usable or not and why
    python -m ort_dynamo report [--path P]    the report a run saved (ORT_DYNAMO_REPORT_PATH)
    python -m ort_dynamo compare SCRIPT ...   first step/node where ort and eager training diverge
    python -m ort_dynamo bench [NAME] ...     run benchmarks/NAME.py (default train_step)
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Callable

from .report import format_report

__all__ = ["REPORT_PATH_ENV", "DEFAULT_REPORT_PATH", "main", "report_path"]

#: Where a run saves its report (at exit) and where ``report`` reads it.
REPORT_PATH_ENV = "ORT_DYNAMO_REPORT_PATH"
DEFAULT_REPORT_PATH = "ort_dynamo_report.json"

_BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
_INSTALL_GPU = "pip uninstall -y onnxruntime && pip install onnxruntime-gpu"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # compare and bench own their options (and their --help): hand them the rest untouched.
    passthrough: dict[str, Callable[[list[str]], int]] = {"compare": _compare, "bench": _bench}
    if argv and argv[0] in passthrough:
        return passthrough[argv[0]](argv[1:])
    args = _parser().parse_args(argv)
    if args.command is None:
        _parser().print_help()
        return 2
    return args.run(args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ort_dynamo",
        description="ort_dynamo: torch.compile(model, backend=\"ort\") trains on ONNX Runtime.",
        epilog="Run 'python -m ort_dynamo COMMAND --help' for a command's options. Docs: docs/getting-started.md",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    info = sub.add_parser("info", help="versions, execution providers found, and whether a CUDA GPU is usable (and why not)",
                          description="Print package versions, ONNX Runtime's execution providers, the "
                                      "torch.compile backend names, and whether training can use a CUDA GPU.")
    info.set_defaults(run=_info)
    report = sub.add_parser(
        "report", help=f"print the report a run saved (set {REPORT_PATH_ENV} before training)",
        description=f"Print the report a training run saved: graphs compiled, nodes on ORT and in PyTorch, "
                    f"fallbacks and why. A run saves it when {REPORT_PATH_ENV} is set, or by calling "
                    f"ort_dynamo.report().save(path).")
    report.add_argument("--path", default=None,
                        help=f"report JSON to read (default: ${REPORT_PATH_ENV}, else ./{DEFAULT_REPORT_PATH})")
    report.add_argument("--json", action="store_true", help="print the raw JSON instead of a table")
    report.set_defaults(run=_report)
    # Listed for --help only; main() dispatches them before parsing.
    sub.add_parser("compare", help="find the first step/activation/ONNX node where ort and eager training differ "
                                   "(python -m ort_dynamo compare --help)")
    sub.add_parser("bench", help="run a benchmark from benchmarks/: bench [NAME] [ARGS] (default NAME: train_step)")
    return parser


# ---------------------------------------------------------------- info

def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _ort_wheel_folders() -> dict[str, str]:
    """The installed onnxruntime wheels (CPU and GPU builds, one module name), each with the
    folder it is installed in."""
    folders = {}
    for name in ("onnxruntime", "onnxruntime-gpu"):
        try:
            folders[name] = str(importlib.metadata.distribution(name).locate_file(""))
        except importlib.metadata.PackageNotFoundError:
            pass
    return folders


def _module_version(module: str) -> str:
    try:
        return getattr(importlib.import_module(module), "__version__", "unknown")
    except ImportError as exc:
        return f"not importable ({exc})"


def _info(args: argparse.Namespace) -> int:
    import torch  # before onnxruntime: a CUDA torch loads the CUDA libraries onnxruntime-gpu needs

    import onnxruntime

    import ort_dynamo

    ort_wheels = _ort_wheel_folders()
    rows = [
        ("ort_dynamo", ort_dynamo.__version__),
        ("python", f"{platform.python_version()} ({sys.executable})"),
        ("torch", f"{torch.__version__} (CUDA build: {torch.version.cuda or 'none, CPU-only'})"),
        ("onnxruntime", f"{onnxruntime.__version__} (wheel: {', '.join(ort_wheels) or 'unknown'})"),
        ("onnxscript", _module_version("onnxscript")),
        ("onnx", _module_version("onnx")),
        ("onnx_ir", _module_version("onnx_ir")),
    ]
    for optional in ("transformers", "accelerate"):
        rows.append((optional, _version(optional) or "not installed (optional)"))
    width = max(len(name) for name, _ in rows)
    print("versions:")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")

    from .run import onnxruntime_problem

    if problem := onnxruntime_problem():
        print(f"PROBLEM: {problem}")
    providers = onnxruntime.get_available_providers()
    print(f"onnxruntime providers: {', '.join(providers)}")
    print(f"torch.compile backends: {_backend_names()}")
    from ._kernels import describe, describe_cuda

    print(f"CPU pointwise kernels: {describe()}")
    print(f"CUDA pointwise kernels: {describe_cuda()}")
    from ._cuda_allocator import torch_allocator_problem

    problem = torch_allocator_problem()
    print("ORT allocates CUDA memory from: " + ("PyTorch's caching allocator (cuda_allocator=pytorch)" if not problem
                                                 else f"its own arena, not PyTorch's allocator: {problem}"))
    from ._torch_attention import problem as torch_attention_problem

    problem = torch_attention_problem()
    print("PyTorch's CPU attention inside ORT (cpu_torch_attention): " + (problem or "available"))
    from . import _openmp, _torch_blas

    print("CPU matrix products (cpu_matmul=auto): " + _torch_blas.describe())
    print("CPU sessions' threads (cpu_thread_pool=auto): " + _openmp.describe())

    usable, lines = _cuda_verdict(torch, providers, ort_wheels, os.path.dirname(os.path.dirname(onnxruntime.__file__)))
    print(f"CUDA GPU usable: {'yes' if usable else 'no'}")
    for line in lines:
        print(f"  - {line}")
    return 0


def _backend_names() -> str:
    try:
        from .integrations.huggingface import TRAINER_BACKEND_NAME, is_enabled

        hf = "registered" if is_enabled() else "not registered: call ort_dynamo.integrations.huggingface.enable()"
        return f"ort, {TRAINER_BACKEND_NAME} (HF Trainer name: {hf})"
    except Exception as exc:  # info must print whatever else it can
        return f"could not inspect the Dynamo registry: {type(exc).__name__}: {exc}"


def _cuda_verdict(torch, providers: list[str], ort_wheels: dict[str, str],
                  loaded_from: str = "") -> tuple[bool, list[str]]:
    """Whether a CUDA GPU can train with the backend; each line says what is found or missing."""
    lines = []
    torch_ok = torch.cuda.is_available()
    if torch_ok:
        lines.append(f"torch sees {torch.cuda.device_count()} GPU(s): {torch.cuda.get_device_name(0)}")
    elif torch.version.cuda is None:
        lines.append(f"torch {torch.__version__} is a CPU-only build: install a CUDA build of torch "
                     "(https://pytorch.org/get-started/locally/)")
    else:
        lines.append(f"torch has CUDA {torch.version.cuda} but torch.cuda.is_available() is False: no GPU, "
                     "no driver, or CUDA_VISIBLE_DEVICES hides it")
    ep_ok = "CUDAExecutionProvider" in providers
    if ep_ok:
        lines.append("onnxruntime has CUDAExecutionProvider")
    else:
        lines.append(f"onnxruntime has no CUDAExecutionProvider: {_INSTALL_GPU} (docs/gpu.md)")
    if len(set(ort_wheels.values())) == 1 and len(ort_wheels) > 1:
        lines.append("both onnxruntime and onnxruntime-gpu are installed and overwrite each other's "
                     f"`onnxruntime` module: {_INSTALL_GPU} --force-reinstall")
    elif len(ort_wheels) > 1:  # e.g. one in the environment, one on PYTHONPATH: the first on the path wins
        lines.append("onnxruntime and onnxruntime-gpu are installed in different folders "
                     f"({', '.join(f'{name} in {folder}' for name, folder in ort_wheels.items())}); "
                     f"the one loaded is {loaded_from or 'the first on sys.path'}")
    return torch_ok and ep_ok, lines


# ---------------------------------------------------------------- report

def report_path(explicit: str | None = None) -> str:
    """The report file: ``explicit``, else ``$ORT_DYNAMO_REPORT_PATH``, else ./ort_dynamo_report.json."""
    return explicit or os.environ.get(REPORT_PATH_ENV) or DEFAULT_REPORT_PATH


def _report(args: argparse.Namespace) -> int:
    path = report_path(args.path)
    try:
        with open(path) as fh:
            data = json.load(fh)
    except FileNotFoundError:
        print(f"ort_dynamo report: no report at {path!r}. Set {REPORT_PATH_ENV}=FILE before training "
              "(or call ort_dynamo.report().save(FILE)), then run this again.", file=sys.stderr)
        return 1
    except json.JSONDecodeError as exc:
        print(f"ort_dynamo report: {path!r} is not a report JSON: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    try:
        print(format_report(data, path))
    except (KeyError, TypeError) as exc:
        what = f"missing {exc}" if isinstance(exc, KeyError) else str(exc)
        print(f"ort_dynamo report: {path!r} is not an ort_dynamo report ({what})", file=sys.stderr)
        return 1
    return 0


# ---------------------------------------------------------------- compare, bench

def _compare(argv: list[str]) -> int:
    try:
        from .debug import main_compare
    except ImportError as exc:
        print(f"ort_dynamo compare: not available in this build (ort_dynamo.debug.main_compare: {exc})",
              file=sys.stderr)
        return 2
    return main_compare(argv)


def _bench(argv: list[str]) -> int:
    available = sorted(p.stem for p in _BENCHMARKS.glob("*.py")) if _BENCHMARKS.is_dir() else []
    if argv and argv[0] in ("-h", "--help"):
        print("usage: python -m ort_dynamo bench [NAME] [ARGS...]\n\n"
              "Run benchmarks/NAME.py of an ort_dynamo source checkout (default NAME: train_step);\n"
              "ARGS go to the benchmark ('bench NAME --help' shows them).\n"
              f"available: {', '.join(available) or 'none (not a source checkout)'}")
        return 0
    name = "train_step"
    if argv and not argv[0].startswith("-"):
        name, argv = argv[0], argv[1:]
    script = _BENCHMARKS / f"{name}.py"
    if not script.is_file():
        print(f"ort_dynamo bench: no benchmark {name!r} at {script}; available: "
              f"{', '.join(available) or 'none (benchmarks/ ships with the source checkout only)'}",
              file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, str(script), *argv])
