"""The benchmark scripts' KEY=VALUE arguments: parsed alike, a malformed item named."""

import mmap
import os
import subprocess
import sys

import pytest
import torch

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCHMARKS)

from train_step import key_values, step_ratio_quartiles  # noqa: E402


def test_key_values_turn_integers_into_ints_and_keep_the_rest_as_text():
    assert key_values("memory_opt_level=1, max_mem=-1,providers=CPUExecutionProvider,") == {
        "memory_opt_level": 1, "max_mem": -1, "providers": "CPUExecutionProvider"}
    assert key_values("") == {}


def test_step_ratios_pair_each_steps_backends_and_report_their_quartiles():
    # ort is half of eager's step twice, equal once and 1.5x once: the median alone would hide it
    times = {"eager": [0.2, 0.4, 0.2, 0.2], "inductor": [0.1, 0.1, 0.1, 0.1], "ort": [0.1, 0.2, 0.2, 0.3]}
    spread = step_ratio_quartiles(times)
    assert spread["ort/eager"] == pytest.approx((0.5, 1.375))
    assert spread["ort/inductor"] == pytest.approx((1.25, 2.75))
    assert step_ratio_quartiles({"eager": [0.1] * 3, "ort": [0.1] * 3}) == {}  # too few steps
    assert step_ratio_quartiles({"eager": [0.1] * 5}) == {}  # no ort


@pytest.mark.parametrize("text", ["memory_opt_level", "=1"])
def test_an_item_without_a_key_and_a_value_is_named(text):
    with pytest.raises(ValueError, match=f"'{text}' is not KEY=VALUE"):
        key_values(text)


@pytest.mark.parametrize("arguments, message", [
    (["--arena", "max_mem"], "--arena: 'max_mem' is not KEY=VALUE"),
    (["--arena", "max_mem=lots"], r"--arena: \['max_mem'\] must be integers"),
    (["--arena", "max_memory=1"], r"--arena: unknown keys \['max_memory'\]"),
])
def test_memory_phases_refuses_bad_arena_settings_before_training(arguments, message):
    import re

    result = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "memory_phases.py"), *arguments],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and re.search(message, result.stderr), result.stderr[-1000:]


def test_train_step_needs_at_least_one_round_of_first_steps():
    result = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "train_step.py"), "--cache",
                             "--first-step-rounds", "0"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "--first-step-rounds must be at least 1, got 0" in result.stderr, \
        result.stderr[-1000:]


def test_gemm_refuses_a_chain_of_no_products_it_chains():
    result = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "gemm.py"), "--chain", "3"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "--chain times torch's BLAS inside ORT (add --blas) or products of few " \
        "rows (add --ours --skinny)" in result.stderr, result.stderr[-1000:]


def test_gemm_refuses_transposing_first_with_another_products_library():
    result = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "gemm.py"), "--transpose-first", "--blas"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "--transpose-first compares ORT's own float32 products" in result.stderr, \
        result.stderr[-1000:]


def test_train_step_refuses_waits_between_phases_without_a_gpu():
    result = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "train_step.py"), "--wait-phases"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "--wait-phases times CUDA steps" in result.stderr, result.stderr[-1000:]


@pytest.mark.parametrize("script", ["memory_phases.py", "compare_revision.py"])
def test_an_attention_dropout_outside_zero_to_one_is_refused_before_training(script):
    result = subprocess.run([sys.executable, os.path.join(BENCHMARKS, script), "--attention-dropout", "1"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "--attention-dropout must be in [0, 1)" in result.stderr, result.stderr[-1000:]


def test_hf_models_dynamic_batch_is_smaller_contiguous_and_keeps_a_shared_tensor_shared():
    # Anything else makes Dynamo recompile for a reason other than the sizes (a stride guard, or
    # ``input_ids is labels``), and the count of new exports would measure that instead.
    from hf_models import _smaller

    ids = torch.arange(4 * 64).reshape(4, 64)
    batch = _smaller({"input_ids": ids, "labels": ids, "pixel_values": torch.randn(4, 3, 64, 64),
                      "input_values": torch.randn(4, 4000)})
    assert batch["input_ids"] is batch["labels"] and batch["input_ids"].is_contiguous()
    assert batch["input_ids"].shape == (3, 48) and torch.equal(batch["input_ids"], ids[:3, :48])
    assert batch["pixel_values"].shape == (3, 3, 64, 64) and batch["input_values"].shape == (3, 4000)
    masks = _smaller({"labels": torch.zeros(8, 64, 64, dtype=torch.int64)})  # a label per pixel: sizes kept
    assert masks["labels"].shape == (7, 64, 64)


@pytest.mark.parametrize("variant, message", [
    ("backward_segmnts=8", r"--variant: unknown ort_dynamo option\(s\) \['backward_segmnts'\]"),
    ("backward_segments", "--variant: 'backward_segments' is not KEY=VALUE"),
])
def test_layer_ops_refuses_a_bad_variant_before_training(variant, message):
    import re

    result = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "layer_ops.py"), "--variant", variant, "lstm_16"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and re.search(message, result.stderr), result.stderr[-1000:]
    assert "eager" not in result.stdout  # nothing was timed


def test_blas_pieces_refuses_an_unknown_model_before_training():
    result = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "blas_pieces.py"), "--models", "bert,bart"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "--models: unknown ['bart']" in result.stderr, result.stderr[-1000:]
    assert "ms" not in result.stdout  # nothing was timed


def test_first_memory_needs_at_least_one_process_per_row():
    result = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "first_memory.py"), "--rounds", "0"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "--rounds must be at least 1, got 0" in result.stderr, \
        result.stderr[-1000:]


def test_first_memory_splits_resident_pages_into_allocations_and_each_librarys_own():
    import first_memory

    assert first_memory._group("[heap]") == first_memory._group("") == "allocations"
    assert first_memory._group("/v/onnxruntime/capi/onnxruntime_pybind11_state.cpython-311-x86_64-linux-gnu.so") \
        == "ONNX Runtime"
    assert first_memory._group("/v/torch/lib/libtorch_cpu.so") == "libtorch_cpu"
    assert first_memory._group("/root/.cache/ort_dynamo/kernels/pointwise_55582f470ac2.so") == "ort_dynamo's kernels"
    assert first_memory._group("/usr/lib/x86_64-linux-gnu/libm.so.6") == "other files"
    before = first_memory._rss_by_group()
    # A mapping of its own, each page written: malloc could hand back pages already resident (a
    # freed heap top that an earlier test's mallopt kept), and the growth would be less.
    block = mmap.mmap(-1, 64 * 2**20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for page in range(0, len(block), mmap.PAGESIZE):
        block[page] = 1
    after = first_memory._rss_by_group()
    assert after["allocations"] - before["allocations"] > 60, (before, after)
    with open("/proc/self/status") as fh:
        rss = next(int(line.split()[1]) / 1024 for line in fh if line.startswith("VmRSS:"))
    assert abs(sum(after.values()) - rss) < 0.02 * rss, (after, rss)  # every mapping counted once
    block.close()


def test_the_step_floor_is_products_at_peak_plus_attention_and_optimizer_over_eagers_step():
    from profile_step import step_floor

    eager = {"forward": 60.0, "backward": 120.0, "optimizer": 20.0}
    ort = {"forward": 50.0, "backward": 100.0, "optimizer": 18.0}
    floor = step_floor(product_gflop=20.0, product_ms=125.0, peak_gflops=200.0, attention_ms=12.0, ort_phases=ort,
                       eager_phases=eager)
    assert floor["products_ms"] == pytest.approx(100.0)
    assert floor["floor_ms"] == pytest.approx(130.0)
    assert floor["ratio"] == pytest.approx(130.0 / 200.0)
    assert floor["share_of_peak"] == pytest.approx(0.8)  # 160 GF/s now, of 200


def test_the_product_peak_scales_one_threads_best_rate_and_leaves_the_thread_count_as_it_was():
    from profile_step import product_peak

    before = torch.get_num_threads()
    one, two = product_peak(threads=2, seconds=0.02)
    assert one > 0 and two == pytest.approx(2 * one)
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("arguments", [["--floor", "--autocast"], ["--floor", "--phase-backends", "ort"]])
def test_profile_step_refuses_a_floor_it_cannot_compute(arguments):
    result = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "profile_step.py"), *arguments],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "--floor is for float32 CPU steps" in result.stderr, result.stderr[-1000:]


@pytest.mark.parametrize("arguments, message", [
    (["--models", "resnet,resnt"], "--models: unknown 'resnt': one of gpt2, bert"),
    (["--models", "resnet", "--attention-dropout", "0.1"], "--attention-dropout applies to gpt2, bert"),
])
def test_compare_revision_refuses_unknown_models_before_training(arguments, message):
    result = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "compare_revision.py"), *arguments],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and message in result.stderr, result.stderr[-1000:]
