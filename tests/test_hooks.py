"""Activation statistics (GlobalSubscriberManager + StatisticsSubscriber) and their merge."""

import io
import os

import pytest
import torch

from ort_dynamo.utils.hooks import GlobalSubscriberManager, StatisticsSubscriber, inspect_activation, summarize_tensor
from ort_dynamo.utils.hooks import merge_activation_summary


@pytest.fixture(autouse=True)
def unsubscribe():
    yield
    GlobalSubscriberManager.unsubscribe()


def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def _train(model, steps, ids):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _stat(path, key):
    text = open(path).read()
    return float(text.split(f"{key}: ")[1].split()[0])


def _listing(run_dir):
    return {step: sorted(os.listdir(os.path.join(run_dir, step))) for step in sorted(os.listdir(run_dir))}


def test_eager_and_ort_dumps_match_and_merge(tmp_path):
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    eager = _tiny_gpt2()
    GlobalSubscriberManager.subscribe(eager, [StatisticsSubscriber(str(tmp_path / "pt_out"))])
    eager_losses = _train(eager, 2, ids)

    compiled = torch.compile(_tiny_gpt2(), backend="ort")
    # Subscribed after compiling, as the guide allows.
    GlobalSubscriberManager.subscribe(compiled, [StatisticsSubscriber(str(tmp_path / "ort_out"))])
    ort_losses = _train(compiled, 2, ids)
    import ort_dynamo
    assert ort_dynamo.report().ort_nodes > 0 and ort_dynamo.report().fallback_nodes == 0

    pt, ort = _listing(tmp_path / "pt_out"), _listing(tmp_path / "ort_out")
    assert list(pt) == ["step_0", "step_1"] and pt == ort
    for step in pt:
        assert open(tmp_path / "pt_out" / step / "order.txt").read() == \
            open(tmp_path / "ort_out" / step / "order.txt").read()
    names = pt["step_0"]
    assert "GPT2LMHeadModel_0_0th_output_forward" in names  # the loss
    assert "NewGELUActivation_17_0th_output_backward" in names  # a gradient
    # The loss statistics are the runs' losses, step by step.
    for step, (eager_loss, ort_loss) in enumerate(zip(eager_losses, ort_losses)):
        pt_file = tmp_path / "pt_out" / f"step_{step}" / "GPT2LMHeadModel_0_0th_output_forward"
        ort_file = tmp_path / "ort_out" / f"step_{step}" / "GPT2LMHeadModel_0_0th_output_forward"
        assert _stat(pt_file, "mean") == pytest.approx(eager_loss, rel=1e-6)
        assert _stat(ort_file, "mean") == pytest.approx(ort_loss, rel=1e-6)
        assert ort_loss == pytest.approx(eager_loss, rel=1e-4)

    out = tmp_path / "merged"
    code = merge_activation_summary.main(["--pt_dir", str(tmp_path / "pt_out"), "--ort_dir",
                                          str(tmp_path / "ort_out"), "--output_dir", str(out)])
    assert code == 0
    for sub in ("merge_pt", "merge_ort", "side_by_side"):
        assert sorted(os.listdir(out / sub)) == ["step_0_.txt", "step_1_.txt"]
    order = open(tmp_path / "pt_out" / "step_0" / "order.txt").read().split()
    merged = open(out / "merge_ort" / "step_0_.txt").read()
    positions = [merged.index(name[: -len("_forward")] + " forward") for name in order if name.endswith("_forward")]
    assert positions == sorted(positions)  # PyTorch's order
    side = open(out / "side_by_side" / "step_0_.txt").read().splitlines()
    left, right = side[0].split(" | ")
    assert left.startswith(">>>Embedding_2_0th_output forward shape: [2, 8, 32]")
    assert right.startswith(">>>Embedding_2_0th_output forward shape: [2, 8, 32]")
    assert all(" | " in line for line in side if line.strip())
    # A second merge into the same folder needs --overwrite.
    assert merge_activation_summary.main(["--pt_dir", str(tmp_path / "pt_out"), "--ort_dir",
                                          str(tmp_path / "ort_out"), "--output_dir", str(out)]) == 2


class TwoLayer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 6)
        self.fc2 = torch.nn.Linear(6, 2)

    def forward(self, x):
        hidden = inspect_activation("hidden", torch.relu(self.fc1(x)))
        return self.fc2(hidden)


def test_subscribe_before_compile_with_inspected_intermediate(tmp_path):
    x = torch.randn(3, 4)
    dumps = {}
    for label in ("eager", "ort"):
        torch.manual_seed(0)
        model = TwoLayer()
        GlobalSubscriberManager.subscribe(model, [StatisticsSubscriber(str(tmp_path / label))])
        runner = torch.compile(model, backend="ort") if label == "ort" else model
        runner(x).sum().backward()
        dumps[label] = _listing(tmp_path / label)
        hidden = torch.relu(model.fc1(x))
        path = tmp_path / label / "step_0" / "hidden_forward"
        assert _stat(path, "max") == pytest.approx(hidden.max().item(), rel=1e-6)
        assert _stat(path, "zero") == (hidden == 0).sum().item()
    assert dumps["eager"] == dumps["ort"] == {"step_0": sorted([
        "order.txt", "Linear_1_0th_output_forward", "Linear_1_0th_output_backward", "hidden_forward",
        "hidden_backward", "Linear_2_0th_output_forward", "Linear_2_0th_output_backward",
        "TwoLayer_0_0th_output_forward", "TwoLayer_0_0th_output_backward"])}
    # d(sum)/d(output) is all ones.
    grad = tmp_path / "ort" / "step_0" / "TwoLayer_0_0th_output_backward"
    assert (_stat(grad, "min"), _stat(grad, "max"), _stat(grad, "pos")) == (1.0, 1.0, 6)


def test_duplicate_inspect_names_are_rejected(tmp_path):
    class Twice(torch.nn.Module):
        def forward(self, x):
            return inspect_activation("same", x) + inspect_activation("same", x * 2)

    model = Twice()
    GlobalSubscriberManager.subscribe(model, [StatisticsSubscriber(str(tmp_path / "out"))])
    with pytest.raises(ValueError, match="activation name 'same' was already recorded in step 0"):
        model(torch.ones(2))


def test_statistics_are_exact_across_buckets():
    values = torch.tensor([-3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, float("nan"), float("inf")])
    out = io.StringIO()
    finite = values[:10]
    summarize_tensor("t forward", finite, out, depth=2, bucket_size=3)
    text = out.getvalue()
    assert text.startswith(">>t forward shape: [10] dtype: torch.float32 numel: 10\n")
    assert "min: -3 max: 6 mean: 1.5 std: " in text
    assert float(text.split("std: ")[1].split()[0]) == pytest.approx(finite.std().item(), rel=1e-6)
    assert "neg: 3 zero: 1 pos: 6" in text and "nan: 0 inf: 0" in text
    assert "-3 -2 -1 0 1 2 3 4\n5 6\n" in text
    out = io.StringIO()
    summarize_tensor("t forward", values, out, bucket_size=5)
    assert "nan: 1 inf: 1" in out.getvalue()


def test_step_window_and_output_dir_rules(tmp_path):
    model = torch.nn.Linear(2, 2)
    GlobalSubscriberManager.subscribe(model, [StatisticsSubscriber(str(tmp_path / "w"), start_step=1, end_step=3)])
    for _ in range(4):
        model(torch.ones(1, 2)).sum().backward()
    assert sorted(os.listdir(tmp_path / "w")) == ["step_1", "step_2"]
    with pytest.raises(FileExistsError, match="override_output_dir=True"):
        StatisticsSubscriber(str(tmp_path / "w"))
    with pytest.warns(UserWarning, match="replacing"):
        StatisticsSubscriber(str(tmp_path / "w"), override_output_dir=True)
    assert not os.path.exists(tmp_path / "w")
    with pytest.raises(ValueError, match="end_step"):
        StatisticsSubscriber(str(tmp_path / "x"), start_step=2, end_step=2)
    with pytest.raises(ValueError, match="SubscriberBase"):
        GlobalSubscriberManager.subscribe(model, ["not a subscriber"])


def test_each_rank_writes_its_own_folder(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = torch.nn.Linear(2, 2)
        GlobalSubscriberManager.subscribe(model, [StatisticsSubscriber(str(tmp_path / "pt"))])
        model(torch.ones(1, 2)).sum().backward()
        GlobalSubscriberManager.subscribe(model, [StatisticsSubscriber(str(tmp_path / "ort"))])
        model(torch.ones(1, 2)).sum().backward()
    finally:
        dist.destroy_process_group()
    assert os.listdir(tmp_path / "pt") == ["rank_0"]
    assert sorted(os.listdir(tmp_path / "pt" / "rank_0" / "step_0")) == [
        "Linear_0_0th_output_backward", "Linear_0_0th_output_forward", "order.txt"]
    written = merge_activation_summary.merge(str(tmp_path / "pt"), str(tmp_path / "ort"), str(tmp_path / "m"))
    assert sorted(os.path.relpath(p, tmp_path / "m") for p in written) == [
        "rank_0/merge_ort/step_0_.txt", "rank_0/merge_pt/step_0_.txt", "rank_0/side_by_side/step_0_.txt"]
