"""Options: validated, frozen, overridable by environment variables."""

import dataclasses
import logging
import os

import pytest
import torch

import ort_dynamo
from ort_dynamo import LogLevel, OrtBackend, OrtOptions


def test_defaults_are_valid_and_frozen():
    opts = OrtOptions()
    assert opts.opset == 18 and opts.fallback_policy == ort_dynamo.FallbackPolicy.DEFAULT
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.opset = 19


def test_unknown_key_lists_valid_keys():
    with pytest.raises(ValueError, match="unknown ort_dynamo option.*'opsett'.*valid keys: opset, fallback_policy"):
        torch.compile(torch.nn.Linear(2, 2), backend="ort", options={"opsett": 18})(torch.randn(1, 2))


@pytest.mark.parametrize("bad, message", [
    ({"opset": 7}, "opset must be in 18..23"),
    ({"opset": "18"}, "opset must be an int"),
    ({"log_level": "LOUD"}, "log_level must be one of"),
    ({"graph_optimization_level": "max"}, "graph_optimization_level must be one of"),
    ({"providers": ["TensorrtExecutionProvider"]}, "unsupported provider"),
    ({"save_onnx": "maybe"}, "save_onnx must be a boolean"),
    ({"cuda_torch_attention": "maybe"}, "cuda_torch_attention must be a boolean"),
    ({"memory_opt_level": 3}, "memory_opt_level must be 0 or 1"),
    ({"cache_dir": __file__}, "cache_dir=.* is a file, not a folder"),
    ({"save_path": __file__}, "save_path=.* is a file, not a folder"),
])
def test_bad_values_raise_value_error_naming_the_field(bad, message):
    with pytest.raises(ValueError, match=message):
        OrtOptions.from_mapping(bad)


def test_env_var_overrides_option(monkeypatch):
    monkeypatch.setenv("ORT_DYNAMO_OPSET", "20")
    monkeypatch.setenv("ORT_DYNAMO_SAVE_ONNX", "1")
    backend = OrtBackend({"opset": 18, "save_onnx": False})
    assert backend.options.opset == 20 and backend.options.save_onnx is True


def test_ortmodule_env_names_are_honoured_but_ours_win(monkeypatch):
    monkeypatch.setenv("ORTMODULE_ONNX_OPSET_VERSION", "19")
    assert OrtBackend().options.opset == 19
    monkeypatch.setenv("ORT_DYNAMO_OPSET", "21")
    assert OrtBackend().options.opset == 21


def test_bad_env_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("ORT_DYNAMO_OPSET", "eighteen")
    with pytest.raises(ValueError, match="ORT_DYNAMO_OPSET: expected an integer"):
        OrtBackend()


def test_env_opset_is_used_by_the_exported_model(monkeypatch, tmp_path):
    import onnx

    monkeypatch.setenv("ORT_DYNAMO_OPSET", "20")
    model, x = torch.nn.Linear(3, 2), torch.randn(2, 3)
    options = {"save_onnx": True, "save_path": str(tmp_path), "onnx_prefix": "runs/linear"}
    torch.testing.assert_close(torch.compile(model, backend="ort", options=options)(x), model(x))
    saved = ort_dynamo.report().graphs[0].onnx_paths
    assert saved and all(os.path.exists(p) for p in saved)
    assert all(p.startswith(str(tmp_path / "runs" / "linear_")) for p in saved)  # the prefix's folder made
    opsets = {o.domain: o.version for o in onnx.load(saved[0]).opset_import}
    assert opsets[""] == 20


def test_log_level_drives_python_logging(caplog):
    with caplog.at_level(logging.DEBUG, logger="ort_dynamo"):
        OrtBackend({"log_level": "VERBOSE"})
        assert logging.getLogger("ort_dynamo").level == logging.DEBUG
        torch.compile(torch.nn.Linear(2, 2), backend=OrtBackend({"log_level": "INFO"}))(torch.randn(1, 2))
    assert any("node(s) on ORT" in r.getMessage() for r in caplog.records)
    assert LogLevel("WARNING").to_logging() == logging.WARNING
    logging.getLogger("ort_dynamo").setLevel(logging.WARNING)


def test_log_level_verbose_shows_onnxruntimes_node_placements_and_warning_keeps_it_quiet(capfd):
    """ORT logs from C++ to the process's stderr: where it put each node is what to read when
    a CUDA graph is slower than expected (nodes left on the CPU provider, copies added)."""
    for level in ("VERBOSE", "WARNING"):
        torch._dynamo.reset()
        torch.compile(torch.nn.Linear(2, 2), backend="ort", options={"log_level": level})(torch.randn(1, 2))
        logged = capfd.readouterr().err
        assert ("All nodes placed on [CPUExecutionProvider]" in logged) == (level == "VERBOSE"), level
    assert [LogLevel(v).to_onnxruntime() for v in ("VERBOSE", "INFO", "WARNING", "ERROR", "FATAL")] == [0, 2, 3, 3, 4]
    logging.getLogger("ort_dynamo").setLevel(logging.WARNING)


def test_same_options_give_the_same_backend_object():
    from ort_dynamo.capture import _backend_for
    from ort_dynamo.options import resolve_options

    assert _backend_for(resolve_options({"opset": 19})) is _backend_for(resolve_options({"opset": 19}))
    assert _backend_for(resolve_options({"opset": 19})) is not _backend_for(resolve_options({"opset": 20}))


def test_options_doc_lists_every_option_and_env_var():
    """docs/options.md is generated from OrtOptions: regenerate it with tools/gen_options_doc.py."""
    from tools_gen import render_options_doc

    path = os.path.join(os.path.dirname(__file__), "..", "docs", "options.md")
    with open(path) as fh:
        assert fh.read() == render_options_doc(), "docs/options.md is stale: run python tools/gen_options_doc.py"
