"""More architectures than train_step.py's three, small: does each train on ORT, how fast against
eager, and which index-driven ONNX ops (Scatter*, Gather*) its graphs use.

    .venv/bin/python benchmarks/hf_models.py              # every model below
    .venv/bin/python benchmarks/hf_models.py gptj t5      # some

Each model (random weights from a config: nothing is downloaded; 2 layers, hidden 128, 4 heads,
batch 4 x 64 tokens; the vision models 8 images of 3 x 64 x 64) runs forward and backward, eager and ``backend="ort"`` interleaved in one
process, after a warm-up step and the generated kernels' build; prints the median of the steps'
ratio ort/eager (no optimizer step), the eager step's ms, nodes left in PyTorch, Dynamo graph
breaks, and the count of each index-driven op in the forward and backward models. Such ops take
an index per element: right where the indices are data, slow where a copy would do (see
tools/idiom_scan.py).
"""

from __future__ import annotations

import argparse
import copy
import glob
import os
import statistics
import tempfile
import time
import warnings

import onnx
import torch

import ort_dynamo

INDEXED_OPS = {"ScatterElements", "ScatterND", "GatherElements", "GatherND"}
SIZE = dict(hidden=128, layers=2, heads=4, intermediate=512, vocab=1024, seq=64, batch=4)
VISION = ("resnet", "convnext", "vit")


def _configs() -> dict:
    import transformers as tf

    s = SIZE
    common = dict(vocab_size=s["vocab"])
    return {
        "gptj": lambda: tf.GPTJForCausalLM(tf.GPTJConfig(
            n_embd=s["hidden"], n_layer=s["layers"], n_head=s["heads"], n_positions=s["seq"], rotary_dim=16,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common)),
        "gpt_neox": lambda: tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(
            hidden_size=s["hidden"], num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
            intermediate_size=s["intermediate"], max_position_embeddings=s["seq"], **common)),
        "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(
            hidden_size=s["hidden"], num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
            num_key_value_heads=2, intermediate_size=s["intermediate"], max_position_embeddings=s["seq"], **common)),
        "opt": lambda: tf.OPTForCausalLM(tf.OPTConfig(
            hidden_size=s["hidden"], num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
            ffn_dim=s["intermediate"], max_position_embeddings=s["seq"], word_embed_proj_dim=s["hidden"],
            dropout=0.0, attention_dropout=0.0, **common)),
        "bert_cls": lambda: tf.BertForSequenceClassification(tf.BertConfig(
            hidden_size=s["hidden"], num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
            intermediate_size=s["intermediate"], max_position_embeddings=s["seq"], hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, num_labels=3, **common)),
        "distilbert": lambda: tf.DistilBertForMaskedLM(tf.DistilBertConfig(
            dim=s["hidden"], n_layers=s["layers"], n_heads=s["heads"], hidden_dim=s["intermediate"],
            max_position_embeddings=s["seq"], dropout=0.0, attention_dropout=0.0, **common)),
        # Vision: 8 images of 3 x 64 x 64, 10 classes.
        "resnet": lambda: tf.ResNetForImageClassification(tf.ResNetConfig(
            embedding_size=32, hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 1, 1], num_labels=10)),
        "convnext": lambda: tf.ConvNextForImageClassification(tf.ConvNextConfig(
            hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 1, 1], num_labels=10)),
        "vit": lambda: tf.ViTForImageClassification(tf.ViTConfig(
            hidden_size=s["hidden"], num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
            intermediate_size=s["intermediate"], image_size=64, patch_size=8, num_labels=10)),
        "t5": lambda: tf.T5ForConditionalGeneration(tf.T5Config(
            d_model=s["hidden"], num_layers=s["layers"], num_heads=s["heads"], d_ff=s["intermediate"], d_kv=32,
            dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, **common)),
    }


def measure(name: str, build, steps: int) -> str:
    torch.manual_seed(0)
    model = build().train()
    if name in VISION:
        batch = {"pixel_values": torch.randn(8, 3, 64, 64), "labels": torch.randint(0, 10, (8,))}
    else:
        ids = torch.randint(0, SIZE["vocab"], (SIZE["batch"], SIZE["seq"]))
        labels = torch.randint(0, 3, (SIZE["batch"],)) if name == "bert_cls" else ids
        batch = {"input_ids": ids, "labels": labels}
    ort_dynamo.reset()
    torch._dynamo.reset()
    with tempfile.TemporaryDirectory() as folder:
        compiled = torch.compile(copy.deepcopy(model), backend="ort", options={"save_onnx": True, "save_path": folder})

        def step(fn) -> float:
            start = time.perf_counter()
            fn(**batch).loss.backward()
            return time.perf_counter() - start

        step(compiled)
        ort_dynamo.wait_for_kernels()
        step(compiled)
        step(model)
        ratios, eager_ms = [], []
        for _ in range(steps):
            eager = step(model)
            ratios.append(step(compiled) / eager)
            eager_ms.append(eager * 1e3)
        counts: dict[str, dict[str, int]] = {}
        for path in sorted(glob.glob(os.path.join(folder, "*.onnx"))):
            kind = "backward" if "backward" in os.path.basename(path) else "forward"
            for node in onnx.load(path).graph.node:
                if node.op_type in INDEXED_OPS:
                    ops = counts.setdefault(kind, {})
                    ops[node.op_type] = ops.get(node.op_type, 0) + 1
    report = ort_dynamo.report()
    indexed = "; ".join(f"{kind}: " + ", ".join(f"{n} {op}" for op, n in sorted(ops.items()))
                        for kind, ops in counts.items()) or "none"
    return (f"{name:11s} ort/eager {statistics.median(ratios):.2f}  eager {statistics.median(eager_ms):6.1f} ms  "
            f"fallback nodes {report.fallback_nodes}  graph breaks {sum(report.graph_breaks.values())}  "
            f"indexed ops: {indexed}")


def main() -> None:
    configs = _configs()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("models", nargs="*", metavar="MODEL", help=f"any of {', '.join(configs)} (default: all)")
    parser.add_argument("--steps", type=int, default=9)
    args = parser.parse_args()
    unknown = [name for name in args.models if name not in configs]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; known: {', '.join(configs)}")
    warnings.simplefilter("ignore")
    print(f"torch {torch.__version__}, {os.cpu_count()} cores; sizes {SIZE}; forward + backward, median of "
          f"{args.steps} interleaved steps")
    for name in args.models or configs:
        try:
            print(measure(name, configs[name], args.steps), flush=True)
        except Exception as exc:  # noqa: BLE001 - one model's failure is a result, not the end
            print(f"{name:11s} FAILED {type(exc).__name__}: {' '.join(str(exc).split())[:200]}", flush=True)


if __name__ == "__main__":
    main()
