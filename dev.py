#!/usr/bin/env python3
"""Set-up and tasks with nothing but Python 3.11 (or newer): creates ./.venv with the pinned set.

    python3 dev.py train   # train a small GPT with backend="ort"; parity and speed vs eager
    python3 dev.py test    # the test suite (what CI runs)
    python3 dev.py bench   # benchmarks (speed ratios), see docs/performance.md
    python3 dev.py test-torch 2.11.0   # the tests under another torch, in ./.venv-torch-2.11.0-py3.11
    python3.12 dev.py test-torch 2.11.0   # ... and another Python (the lent GPU machine's pair)
"""

import hashlib
import os
import subprocess
import sys
import venv

ROOT = os.path.dirname(os.path.abspath(__file__))
VENV = os.path.join(ROOT, ".venv")
PY = os.path.join(VENV, "bin", "python")
REQS = os.path.join(ROOT, "requirements-dev.txt")


def _digest() -> str:
    h = hashlib.sha256()
    for name in (REQS, os.path.join(ROOT, "pyproject.toml")):
        with open(name, "rb") as fh:
            h.update(fh.read())
    return h.hexdigest()


def ensure_venv(root: str = VENV, torch_version: str = "") -> str:
    """``root`` with the pinned set installed (torch at ``torch_version`` where given, the other
    pins unchanged), unless its stamp says it has them; returns its python."""
    if sys.version_info < (3, 11):
        # onnxruntime >= 1.31 (ort_dynamo's floor) publishes no wheels for 3.10.
        sys.exit(f"ort_dynamo needs Python >= 3.11 (onnxruntime 1.31, the oldest it runs on, has no "
                 f"wheels for older ones); this is {sys.version.split()[0]}. Run python3.11 or newer.")
    py, stamp = os.path.join(root, "bin", "python"), os.path.join(root, ".ort_dynamo_stamp")
    digest = _digest() + torch_version
    if not os.path.exists(py):
        print(f"creating {root}", flush=True)
        venv.EnvBuilder(with_pip=True).create(root)
    if os.path.exists(stamp) and open(stamp).read() == digest:
        return py
    print("installing pinned dependencies (first run only)", flush=True)
    pip = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    if torch_version:
        with open(REQS) as fh:
            pins = [line.strip() for line in fh if line.strip() and not line.startswith(("#", "torch=="))]
        subprocess.check_call(pip + [f"torch=={torch_version}", *pins])
    else:
        subprocess.check_call(pip + ["-r", REQS])
    subprocess.check_call(pip + ["--no-deps", "-e", ROOT])
    with open(stamp, "w") as fh:
        fh.write(digest)
    return py


def _usable_cpus() -> int:
    """CPUs this process may run on: a container's share, not the host's count."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def pytest_command(py: str, pytest_args: list[str]) -> list[str]:
    """pytest on ``tests`` (or the arguments given) with one xdist worker per core, at most 4:
    most tests are single-threaded compiles, so 2 workers halve the suite on CI's 2 cores.
    ``-n 0`` among the arguments runs it in one process (the last ``-n`` wins)."""
    workers = min(_usable_cpus(), 4)
    return [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", str(workers),
            *(pytest_args or [os.path.join(ROOT, "tests")])]


def test_other_torch(version: str, pytest_args: list[str]) -> int:
    """The suite (or the pytest arguments given) under torch ``version`` (PyPI's build: for 2.11,
    a CUDA build of a few GB) and the Python running this, in a venv of its own per pair."""
    python = "{}.{}".format(*sys.version_info[:2])
    py = ensure_venv(os.path.join(ROOT, f".venv-torch-{version}-py{python}"), version)
    return subprocess.call(pytest_command(py, pytest_args), cwd=ROOT,
                           env=dict(os.environ, PYTHONUNBUFFERED="1"))


def main(argv: list[str]) -> int:
    if argv and argv[0] == "test-torch":
        if len(argv) < 2:
            print("usage: python3 dev.py test-torch VERSION [pytest arguments, default: tests]")
            return 2
        return test_other_torch(argv[1], argv[2:])
    tasks = {  # each task's command, given the arguments after its name
        "train": lambda args: [PY, os.path.join(ROOT, "examples", "train_gpt.py"), *args],
        "test": lambda args: pytest_command(PY, args),
        "bench": lambda args: [PY, os.path.join(ROOT, "benchmarks", "train_step.py"), *args],
    }
    if not argv or argv[0] not in tasks:
        print(__doc__)
        return 2
    ensure_venv()
    # The user's environment as it is: OMP_WAIT_POLICY=PASSIVE, set here before, slowed eager's
    # small ops far more than ort's (main job: eager 22 -> 40 ms, ort 23 -> 26-30 ms on a 2-core
    # VM), so the speed line flattered ort (docs/performance.md, "OpenMP's wait policy").
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.call(tasks[argv[0]](argv[1:]), cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
