"""The on-disk cache: a new process reuses exported models; damaged entries are rebuilt."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import ort_dynamo

SCRIPT = textwrap.dedent("""
    import json, sys, torch
    import ort_dynamo
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    x = torch.randn(4, 8, requires_grad=True)
    out = torch.compile(model, backend="ort", options={"cache_dir": sys.argv[1]})(x)
    out.sum().backward()
    torch.testing.assert_close(out, model(x))
    r = ort_dynamo.report()
    from ort_dynamo.export import _built_registry
    print(json.dumps({"exports": r.exports, "hits": sum(g.cache_hits for g in r.graphs),
                      "grad": x.grad.sum().item(), "fallbacks": r.fallback_nodes,
                      "registry_built": _built_registry.cache_info().currsize > 0}))
""")


def _run(cache_dir):
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(cache_dir)], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_restarted_process_reuses_cached_models_and_damage_is_not_trusted(tmp_path):
    first = _run(tmp_path)
    assert first["exports"] == 2 and first["hits"] == 0 and first["fallbacks"] == 0
    second = _run(tmp_path)
    assert second["exports"] == 0 and second["hits"] == 2
    assert second["grad"] == first["grad"]
    assert first["registry_built"] and not second["registry_built"]  # a warm start skips torchlib

    for folder, _, files in os.walk(tmp_path):  # damage every model file
        for name in files:
            if name.endswith(".onnx"):
                with open(os.path.join(folder, name), "r+b") as fh:
                    fh.write(b"garbage")
    third = _run(tmp_path)
    assert third["exports"] == 2 and third["hits"] == 0
    assert third["grad"] == first["grad"]


def test_cache_key_changes_with_options_and_shapes():
    import torch

    from ort_dynamo.cache import cache_key
    from ort_dynamo.options import OrtOptions

    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    placeholder = next(iter(gm.graph.nodes))
    placeholder.meta["val"] = torch.empty(2, 3)
    base = cache_key(gm, OrtOptions())
    assert cache_key(gm, OrtOptions(opset=19)) != base
    assert cache_key(gm, OrtOptions(log_level="INFO")) == base  # logging does not change the model
    placeholder.meta["val"] = torch.empty(4, 3)
    assert cache_key(gm, OrtOptions()) != base


def test_cached_lowered_op_set_equals_the_computed_one(tmp_path):
    from ort_dynamo.lower import _onnx_lowered_ops

    computed = _onnx_lowered_ops(18)
    assert _onnx_lowered_ops(18, str(tmp_path)) == computed  # computes and stores
    _onnx_lowered_ops.cache_clear()
    assert _onnx_lowered_ops(18, str(tmp_path)) == computed  # read back from disk
    assert len(computed) > 300


def test_a_cache_folder_that_cannot_be_read_or_written_costs_only_the_cache(tmp_path):
    """Read-only, full, or (here) every entry's subfolder taken by a file: the model still
    compiles and trains on ORT, and a warning names the folder once."""
    for first in "0123456789abcdef":
        for second in "0123456789abcdef":
            (tmp_path / (first + second)).write_text("")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    x = torch.randn(4, 8)
    options = {"cache_dir": str(tmp_path), "fallback_policy": "DISABLE"}
    with pytest.warns(UserWarning, match="cannot (read|write) the on-disk cache cache_dir=") as caught:
        torch.compile(model, backend="ort", options=options)(x).sum().backward()
    said = [str(w.message) for w in caught if "on-disk cache" in str(w.message)]
    assert len(said) == 2 and str(tmp_path) in said[0], said  # one read, one write
    report = ort_dynamo.report()
    assert report.exports == 2 and report.fallback_nodes == 0
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).sum().backward()
    for got, p in zip(grads, model.parameters()):
        torch.testing.assert_close(got, p.grad)
