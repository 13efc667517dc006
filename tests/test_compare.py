"""ort_dynamo.debug.compare: finds the first diverging step, activation and ONNX node."""

import pytest
import torch

import ort_dynamo.export as export_stage
from ort_dynamo import OrtDynamoError
from ort_dynamo.debug import compare, main_compare
from parity import torch_older_than

# compare's activation hooks run eagerly (torch.compiler.disable) between compiled graphs. torch
# 2.11 (2.12 unchecked) compiles no graph around them, so nothing runs on ORT and compare says so
# (test_a_model_with_nothing_on_ort_is_an_error_not_a_match).
needs_graphs_around_hooks = pytest.mark.skipif(
    torch_older_than(2, 13),
    reason="torch before 2.13 compiles no graph around compare's hooks (compare raises there)")


class TinyMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.act = torch.nn.Tanh()
        self.drop = torch.nn.Dropout(0.5)  # compare sets p=0: results must still match
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.drop(self.act(self.fc1(x))))


def _inputs(step: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(step))


@pytest.fixture(scope="module")
def faulty_tanh_registry():
    """A torchlib registry whose aten.tanh lowering is wrong: Tanh(x) * 1.5 (test-only fault)."""
    from onnxscript import opset18 as op
    from onnxscript.function_libs.torch_lib.tensor_typing import TFloat
    from torch.onnx._internal.exporter import _registration

    def faulty_tanh(self: TFloat) -> TFloat:
        return op.Mul(op.Tanh(self), op.CastLike(op.Constant(value_float=1.5), self))

    registry = _registration.ONNXRegistry.from_torchlib(18)
    registry.register_op(torch.ops.aten.tanh.default, faulty_tanh)
    return registry


@needs_graphs_around_hooks
def test_healthy_model_reports_no_divergence(tmp_path):
    result = compare(TinyMLP, _inputs, steps=3, save_path=str(tmp_path))
    assert not result.diverged and result.node is None
    assert len(result.eager_losses) == len(result.ort_losses) == 3
    torch.testing.assert_close(result.ort_losses, result.eager_losses, atol=1e-4, rtol=1e-4)
    # SGD steps were taken: the loss moves.
    assert result.eager_losses[0] != result.eager_losses[2]


@needs_graphs_around_hooks
def test_faulty_lowering_is_named_as_first_divergence(tmp_path, monkeypatch, faulty_tanh_registry, capsys):
    monkeypatch.setattr(export_stage, "onnx_registry", lambda opset: faulty_tanh_registry)
    torch.manual_seed(0)
    model = TinyMLP()
    result = compare(model, _inputs, steps=2, save_path=str(tmp_path))
    assert result.diverged
    assert (result.step, result.kind, result.activation) == (0, "forward", "Tanh_2_0th_output")
    node = result.node
    assert node is not None
    assert node.graph.startswith("forward_") and node.partition.startswith("fused_")
    assert (node.fx_node, node.fx_target) == ("tanh", "aten.tanh.default")
    assert (node.onnx_node, node.onnx_op) == ("node_tanh", "Mul")
    assert node.onnx_path.startswith(str(tmp_path)) and node.onnx_path.endswith(".onnx")
    # The scale shows in the difference: |1.5 tanh - tanh| = 0.5 |tanh| at the worst element.
    with torch.no_grad():
        worst = 0.5 * model.act(model.fc1(_inputs(0))).abs().max().item()
    assert node.max_abs_diff == pytest.approx(worst, rel=1e-4)
    assert result.max_abs_diff == pytest.approx(worst, rel=1e-4)
    printed = capsys.readouterr().out
    assert "first divergence: step 0, activation Tanh_2_0th_output" in printed
    assert "node_tanh (Mul)" in printed and node.onnx_path in printed


@needs_graphs_around_hooks
def test_cli_runs_a_script(tmp_path, capsys):
    script = tmp_path / "target.py"
    script.write_text(
        "import torch\n"
        "def get_model():\n    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())\n"
        "def get_inputs():\n    return (torch.randn(2, 4),)\n")
    code = main_compare([str(script), "--steps", "2", "--save-path", str(tmp_path / "onnx")])
    assert code == 0
    assert "no divergence" in capsys.readouterr().out


def test_a_model_with_nothing_on_ort_is_an_error_not_a_match(tmp_path):
    """A copy that ran eagerly would match eager: compare raises instead of reporting no divergence."""

    class Untraced(TinyMLP):
        @torch.compiler.disable
        def forward(self, x):
            return super().forward(x)

    with pytest.raises(OrtDynamoError, match="nothing of the model ran on ONNX Runtime in step 0"):
        compare(Untraced, _inputs, steps=2, save_path=str(tmp_path))


def test_bad_arguments_are_explained(tmp_path, capsys):
    with pytest.raises(ValueError, match="steps must be an int >= 1"):
        compare(TinyMLP, _inputs, steps=0)
    with pytest.raises(TypeError, match="nn.Module or a function"):
        compare(42, _inputs)
    script = tmp_path / "empty.py"
    script.write_text("x = 1\n")
    assert main_compare([str(script)]) == 2
    assert "must define get_model and get_inputs" in capsys.readouterr().err


def test_node_replay_feeds_transposed_inputs_as_the_graph_takes_them():
    """A partition takes a transposed input in its contiguous layout (export.py); replaying it
    node by node must feed that layout too, or a square input would look like a divergence."""
    from ort_dynamo.debug import _first_bad_node, _recording_runner_calls

    a, x = torch.randn(8, 8), torch.randn(4, 8)
    calls = []
    with _recording_runner_calls(calls):
        torch.compile(lambda x, w: (x @ w).tanh(), backend="ort")(x, a.t())
    (runner, args), = calls
    assert any(order is not None for order in runner.exported.input_permutations)
    assert _first_bad_node(runner, args, atol=1e-5, rtol=1e-5) is None
