"""More architectures than train_step.py's three, small: does each train on ORT, with eager's
gradients, how fast against eager, and which index-driven ONNX ops (Scatter*, Gather*) its
graphs use.

    .venv/bin/python benchmarks/hf_models.py              # every model below
    .venv/bin/python benchmarks/hf_models.py gptj t5      # some
    .venv/bin/python benchmarks/hf_models.py --backend inductor segformer   # another backend's ratio
    .venv/bin/python benchmarks/hf_models.py --float64 mobilenet_v2  # each side against float64
    .venv/bin/python benchmarks/hf_models.py --profile 12 segformer  # and ORT's 12 heaviest nodes, ms per op type
    .venv/bin/python benchmarks/hf_models.py --dynamic      # dynamic=True, and a second batch of other sizes

Each model (random weights from a config: nothing is downloaded; 2 layers, hidden 128, 4 heads,
batch 4 x 64 tokens; the vision models 8 images of 3 x 64 x 64; no dropout) runs forward and
backward, eager and ``backend="ort"`` interleaved in one process, after a warm-up step and the
generated kernels' build; prints the median of the steps' ratio ort/eager (no optimizer step),
the eager step's ms, the parity of one step (the loss's difference, and the largest gradient
difference over the largest gradient of the model), nodes left in PyTorch, Dynamo graph breaks,
and the count of each index-driven op in the forward and backward models. Such ops take an
index per element: right where the indices are data, slow where a copy would do (see
tools/idiom_scan.py). A model whose compile fails prints FAILED and the error.
"""

from __future__ import annotations

import argparse
import collections
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


def _tokens(model) -> dict:
    ids = torch.randint(0, SIZE["vocab"], (SIZE["batch"], SIZE["seq"]))
    return {"input_ids": ids, "labels": ids}


def _images(classes: int = 10):
    return lambda model: {"pixel_values": torch.randn(8, 3, 64, 64), "labels": torch.randint(0, classes, (8,))}


def _configs() -> dict:
    """name -> (model builder, batch builder)."""
    import transformers as tf

    s = SIZE
    h, layers, heads, ffn, seq = s["hidden"], s["layers"], s["heads"], s["intermediate"], s["seq"]
    common = dict(vocab_size=s["vocab"])
    no_dropout = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    decoder = dict(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=ffn,
                   max_position_embeddings=seq, **common)
    seq2seq = dict(d_model=h, encoder_layers=layers, decoder_layers=layers, encoder_attention_heads=heads,
                   decoder_attention_heads=heads, encoder_ffn_dim=ffn, decoder_ffn_dim=ffn, dropout=0.0,
                   attention_dropout=0.0, **common)
    return {
        "gptj": (lambda: tf.GPTJForCausalLM(tf.GPTJConfig(
            n_embd=h, n_layer=layers, n_head=heads, n_positions=seq, rotary_dim=16,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common)), _tokens),
        "gpt_neox": (lambda: tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**decoder)), _tokens),
        "mistral": (lambda: tf.MistralForCausalLM(tf.MistralConfig(num_key_value_heads=2, **decoder)), _tokens),
        "qwen2": (lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(num_key_value_heads=2, **decoder)), _tokens),
        "gemma": (lambda: tf.GemmaForCausalLM(tf.GemmaConfig(num_key_value_heads=1, head_dim=32, **decoder)), _tokens),
        "phi": (lambda: tf.PhiForCausalLM(tf.PhiConfig(resid_pdrop=0.0, embd_pdrop=0.0, **decoder)), _tokens),
        "falcon": (lambda: tf.FalconForCausalLM(tf.FalconConfig(
            hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads, max_position_embeddings=seq,
            hidden_dropout=0.0, attention_dropout=0.0, **common)), _tokens),
        "bloom": (lambda: tf.BloomForCausalLM(tf.BloomConfig(
            hidden_size=h, n_layer=layers, n_head=heads, hidden_dropout=0.0, attention_dropout=0.0, **common)), _tokens),
        "mixtral": (lambda: tf.MixtralForCausalLM(tf.MixtralConfig(
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, **decoder)), _tokens),
        "mamba": (lambda: tf.MambaForCausalLM(tf.MambaConfig(
            hidden_size=h, num_hidden_layers=layers, state_size=8, **common)), _tokens),
        "opt": (lambda: tf.OPTForCausalLM(tf.OPTConfig(
            hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads, ffn_dim=ffn,
            max_position_embeddings=seq, word_embed_proj_dim=h, dropout=0.0, attention_dropout=0.0,
            **common)), _tokens),
        "xlnet": (lambda: tf.XLNetLMHeadModel(tf.XLNetConfig(
            d_model=h, n_layer=layers, n_head=heads, d_inner=ffn, dropout=0.0, **common)), _tokens),
        "bert_cls": (lambda: tf.BertForSequenceClassification(tf.BertConfig(
            hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=ffn,
            max_position_embeddings=seq, num_labels=3, **no_dropout, **common)),
            lambda model: {"input_ids": _tokens(model)["input_ids"], "labels": torch.randint(0, 3, (s["batch"],))}),
        "distilbert": (lambda: tf.DistilBertForMaskedLM(tf.DistilBertConfig(
            dim=h, n_layers=layers, n_heads=heads, hidden_dim=ffn,
            max_position_embeddings=seq, dropout=0.0, attention_dropout=0.0, **common)), _tokens),
        "albert": (lambda: tf.AlbertForMaskedLM(tf.AlbertConfig(
            embedding_size=64, **decoder, **no_dropout)), _tokens),
        "deberta_v2": (lambda: tf.DebertaV2ForMaskedLM(tf.DebertaV2Config(
            relative_attention=True, pos_att_type=["p2c", "c2p"], **decoder, **no_dropout)), _tokens),
        "t5": (lambda: tf.T5ForConditionalGeneration(tf.T5Config(
            d_model=h, num_layers=layers, num_heads=heads, d_ff=ffn, d_kv=32,
            dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, **common)), _tokens),
        "bart": (lambda: tf.BartForConditionalGeneration(tf.BartConfig(
            max_position_embeddings=seq, **seq2seq)), _tokens),
        # Speech: 16 mel bins x 128 frames (Whisper), 4000 samples (wav2vec2, weight-normed conv).
        "whisper": (lambda: tf.WhisperForConditionalGeneration(tf.WhisperConfig(
            num_mel_bins=16, max_source_positions=64, max_target_positions=seq, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, **seq2seq)),
            lambda model: {"input_features": torch.randn(s["batch"], 16, 128), "labels": _tokens(model)["labels"]}),
        "wav2vec2": (lambda: tf.Wav2Vec2ForCTC(tf.Wav2Vec2Config(
            hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=ffn,
            conv_dim=(32, 32, 32), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3), num_conv_pos_embeddings=16,
            num_conv_pos_embedding_groups=4, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
            feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0, vocab_size=32)),
            lambda model: {"input_values": torch.randn(s["batch"], 4000), "labels": torch.randint(1, 32, (s["batch"], 20))}),
        # Vision: 8 images of 3 x 64 x 64, 10 classes (segmentation: 5 classes per pixel).
        "resnet": (lambda: tf.ResNetForImageClassification(tf.ResNetConfig(
            embedding_size=32, hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 1, 1], num_labels=10)), _images()),
        "convnext": (lambda: tf.ConvNextForImageClassification(tf.ConvNextConfig(
            hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 1, 1], num_labels=10)), _images()),
        "efficientnet": (lambda: tf.EfficientNetForImageClassification(tf.EfficientNetConfig(
            image_size=64, width_coefficient=0.25, depth_coefficient=0.25, hidden_dim=320, num_labels=10,
            dropout_rate=0.0, drop_connect_rate=0.0)), _images()),
        "mobilenet_v2": (lambda: tf.MobileNetV2ForImageClassification(tf.MobileNetV2Config(
            image_size=64, depth_multiplier=0.35, num_labels=10, classifier_dropout_prob=0.0)), _images()),
        "vit": (lambda: tf.ViTForImageClassification(tf.ViTConfig(
            hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
            intermediate_size=ffn, image_size=64, patch_size=8, num_labels=10)), _images()),
        "swin": (lambda: tf.SwinForImageClassification(tf.SwinConfig(
            image_size=64, patch_size=4, embed_dim=32, depths=[1, 1], num_heads=[2, 4], window_size=4,
            num_labels=10, drop_path_rate=0.0, **no_dropout)), _images()),
        "segformer": (lambda: tf.SegformerForSemanticSegmentation(tf.SegformerConfig(
            num_encoder_blocks=2, depths=[1, 1], sr_ratios=[4, 2], hidden_sizes=[32, 64], num_attention_heads=[1, 2],
            decoder_hidden_size=64, num_labels=5, patch_sizes=[7, 3], strides=[4, 2], mlp_ratios=[4, 4],
            drop_path_rate=0.0, classifier_dropout_prob=0.0, **no_dropout)),
            lambda model: {"pixel_values": torch.randn(8, 3, 64, 64), "labels": torch.randint(0, 5, (8, 64, 64))}),
        "clip": (lambda: tf.CLIPModel(tf.CLIPConfig(
            text_config=dict(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                             intermediate_size=ffn, max_position_embeddings=seq, vocab_size=s["vocab"]),
            vision_config=dict(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                               intermediate_size=ffn, image_size=64, patch_size=8))),
            lambda model: {"input_ids": _tokens(model)["input_ids"], "pixel_values": torch.randn(s["batch"], 3, 64, 64),
                           "return_loss": True}),
    }


def _gradients(model) -> dict:
    return {name.removeprefix("_orig_mod."): p.grad.clone() for name, p in model.named_parameters()
            if p.grad is not None}


def _difference(got: dict, want: dict) -> float:
    """The largest gradient difference over the largest gradient of the model."""
    if want.keys() != got.keys():
        raise AssertionError(f"gradients of different parameters: {sorted(want.keys() ^ got.keys())[:5]}")
    scale = max(g.abs().max().item() for g in want.values())
    return max((got[n].double() - want[n].double()).abs().max().item() for n in want) / scale


def _float64_gradients(model, batch: dict) -> dict:
    wide = copy.deepcopy(model).double()
    wide.zero_grad(set_to_none=True)
    wide(**{k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
            for k, v in batch.items()}).loss.backward()
    return _gradients(wide)


def _smaller(batch: dict) -> dict:
    """The batch with one sample fewer and 16 tokens fewer in its token tensors (2-d integer
    ones: ids, labels), contiguous as a loader gives them: other sizes for ``--dynamic``."""
    def cut(value):
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return value
        value = value[:-1]
        tokens = value.dim() == 2 and not value.is_floating_point()
        return (value[:, :-16] if tokens else value).contiguous()

    cuts: dict[int, object] = {}  # a tensor given twice (input_ids is labels) stays one tensor
    return {key: cuts.setdefault(id(value), cut(value)) for key, value in batch.items()}


def measure(name: str, build, make_batch, steps: int, backend: str = "ort", float64: bool = False,
            autocast: bool = False, dynamic: bool = False) -> str:
    torch.manual_seed(0)
    model = build().train()
    batch = make_batch(model)
    ort_dynamo.reset()
    torch._dynamo.reset()
    with tempfile.TemporaryDirectory() as folder:
        options = {"save_onnx": True, "save_path": folder} if backend == "ort" else None
        compiled = torch.compile(copy.deepcopy(model), backend=backend, options=options, dynamic=dynamic or None)

        def step(fn, bfloat16: bool = autocast) -> tuple[float, float]:
            fn.zero_grad(set_to_none=True)
            start = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bfloat16):
                loss = fn(**batch).loss
            loss.backward()
            return time.perf_counter() - start, loss.item()

        step(compiled)
        ort_dynamo.wait_for_kernels()
        _, loss = step(compiled)
        _, eager_loss = step(model)
        want, got = _gradients(model), _gradients(compiled)
        parity = f"loss diff {abs(loss - eager_loss):.0e}  grad diff {_difference(got, want):.0e}"
        if autocast:  # the scale of bfloat16's rounding: eager under autocast against eager in float32
            step(model, bfloat16=False)
            parity += f" (eager bf16 vs float32 {_difference(want, _gradients(model)):.0e})"
        if float64:  # how far each float32 run is from the float64 one, and how far eager moves
            wide = _float64_gradients(model, batch)  # when its float inputs move by 1e-6
            nudged = {k: v * (1 + 1e-6 * torch.randn(v.shape, generator=torch.Generator().manual_seed(1)))
                      if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in batch.items()}
            shaken = copy.deepcopy(model)
            shaken.zero_grad(set_to_none=True)
            shaken(**nudged).loss.backward()
            parity += (f" (vs float64: eager {_difference(want, wide):.0e}, {backend} {_difference(got, wide):.0e},"
                       f" eager on inputs x (1 + 1e-6 noise) {_difference(_gradients(shaken), wide):.0e})")
        if dynamic:  # other sizes: eager's gradients, and no new graph or export
            from torch._dynamo.utils import counters

            exports = ort_dynamo.report().exports if backend == "ort" else 0
            graphs = counters["stats"]["unique_graphs"]
            smaller = _smaller(batch)
            for fn in (model, compiled):
                fn.zero_grad(set_to_none=True)
                fn(**smaller).loss.backward()
            parity += (f"  other sizes: grad diff {_difference(_gradients(compiled), _gradients(model)):.0e}, "
                       f"new Dynamo graphs {counters['stats']['unique_graphs'] - graphs}")
            if backend == "ort":
                parity += f", new exports {ort_dynamo.report().exports - exports}"
        ratios, eager_ms = [], []
        for _ in range(steps):
            eager = step(model)[0]
            ratios.append(step(compiled)[0] / eager)
            eager_ms.append(eager * 1e3)
        counts: dict[str, dict[str, int]] = {}
        for path in sorted(glob.glob(os.path.join(folder, "*.onnx"))):
            kind = "backward" if "backward" in os.path.basename(path) else "forward"
            for node in onnx.load(path).graph.node:
                op = "Bf16MatMul" if node.op_type.startswith("Bf16MatMul") else node.op_type
                if op in INDEXED_OPS or (autocast and op in ("Bf16MatMul", "MatMul", "Gemm")):
                    ops = counts.setdefault(kind, {})
                    ops[op] = ops.get(op, 0) + 1
    line = (f"{name:12s} {backend}/eager {statistics.median(ratios):.2f}  eager {statistics.median(eager_ms):6.1f} ms  "
            f"{parity}")
    if backend != "ort":
        return line
    report = ort_dynamo.report()
    indexed = "; ".join(f"{kind}: " + ", ".join(f"{n} {op}" for op, n in sorted(ops.items()))
                        for kind, ops in counts.items()) or "none"
    return (f"{line}  fallback nodes {report.fallback_nodes}  graph breaks {sum(report.graph_breaks.values())}  "
            f"{'indexed ops and products' if autocast else 'indexed ops'}: {indexed}")


def heaviest_model_nodes(build, make_batch, top: int | None, dynamic: bool = False) -> list[tuple[float, str]]:
    """ORT's ``top`` heaviest nodes (None: all) in a forward and backward of the model (profile_step.py's),
    compiled with ``dynamic=True`` where ``dynamic``."""
    from profile_step import heaviest_ort_nodes

    def step():
        torch.manual_seed(0)
        model = build().train()
        batch = make_batch(model)
        model(**batch)  # transformers installs its output-capturing hooks in the first call
        compiled = torch.compile(model, backend="ort", dynamic=dynamic or None)
        return lambda: compiled(**batch).loss.backward()

    return heaviest_ort_nodes(step, top=top)


def main() -> None:
    configs = _configs()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("models", nargs="*", metavar="MODEL", help=f"any of {', '.join(configs)} (default: all)")
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--backend", default="ort", help="the compiled side (default ort; e.g. inductor)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also print ORT's kernel ms per op type and its N heaviest nodes in a training "
                             "step (ORT's profiler)")
    parser.add_argument("--float64", action="store_true",
                        help="also compare both sides' gradients with a float64 eager run's, and eager's "
                             "on inputs moved by 1e-6 (how sensitive the model's gradient is)")
    parser.add_argument("--autocast", action="store_true",
                        help="both sides under torch.autocast(cpu, bfloat16); also counts the bfloat16 products "
                             "and gives eager's bfloat16-against-float32 gradient difference for scale")
    parser.add_argument("--dynamic", action="store_true",
                        help="compile with dynamic=True; after the parity step, one more step on a batch with "
                             "one sample fewer (and 16 tokens fewer): its gradient difference, new Dynamo graphs "
                             "(any backend) and new exports")
    args = parser.parse_args()
    unknown = [name for name in args.models if name not in configs]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; known: {', '.join(configs)}")
    warnings.simplefilter("ignore")
    print(f"torch {torch.__version__}, {os.cpu_count()} cores; sizes {SIZE}; forward + backward, median of "
          f"{args.steps} interleaved steps{'; bfloat16 autocast' if args.autocast else ''}")
    for name in args.models or configs:
        try:
            print(measure(name, *configs[name], args.steps, args.backend, args.float64, args.autocast, args.dynamic),
                  flush=True)
            if args.profile:
                nodes = heaviest_model_nodes(*configs[name], None, args.dynamic)  # every node, heaviest first
                by_op = collections.Counter()
                for ms, node in nodes:
                    by_op[node.split()[0]] += ms
                print(f"      ORT's kernels {sum(by_op.values()):.2f} ms a step; by op type: "
                      + ", ".join(f"{op} {ms:.2f}" for op, ms in by_op.most_common(6)), flush=True)
                for ms, node in nodes[:args.profile]:
                    print(f"      {ms:6.2f} ms  {node[:150]}", flush=True)
        except Exception as exc:  # noqa: BLE001 - one model's failure is a result, not the end
            print(f"{name:11s} FAILED {type(exc).__name__}: {' '.join(str(exc).split())[:200]}", flush=True)


if __name__ == "__main__":
    main()
