"""Layers of convolutional, audio and recurrent models (padding, ``Tensor.unfold``, spectrograms,
upsampling, pooling, normalization, layout, LSTM/GRU),
forward and backward, eager against ``backend="ort"``, on the shapes those models give them.

    .venv/bin/python benchmarks/layer_ops.py
    .venv/bin/python benchmarks/layer_ops.py reflect2d unfold_frames    # some cases only
    .venv/bin/python benchmarks/layer_ops.py --profile max_pool2d          # and ORT's heaviest nodes
    .venv/bin/python benchmarks/layer_ops.py --first-step lstm_64          # and aot_eager's first step
    .venv/bin/python benchmarks/layer_ops.py --dynamic depthwise_conv      # compiled with dynamic=True
    .venv/bin/python benchmarks/layer_ops.py --variant backward_segments=8 lstm_16  # and ort with these options

Each case is ``(op(x) * 1.5).square().sum()`` and its backward, timed interleaved with eager
after the generated kernels are built, with glibc malloc's thresholds fixed as in
train_step.py; prints the median ms of 20 steps, ort/eager and ort's first step in seconds
(compile included, the kernels' build not: it runs in the background). ``--profile`` then compiles the
case again into profiled sessions and prints the heaviest ORT nodes, each its median ms over
10 steps (ORT's profiler; the sessions the kernels replaced left out). ``--first-step`` also
times the case's first step under ``aot_eager`` (before ort's, after one warm-up compile of
each backend) and prints ort/aot_eager. ``--variant KEY=VALUE[,KEY=VALUE...]`` adds a second
ort copy compiled with those options, its steps interleaved with the others, and prints its ms
and its time over the default ort's.
"""

from __future__ import annotations

import os
import sys
import time
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from train_step import _steady_malloc, interleaved_ms, key_values  # noqa: E402

import ort_dynamo  # noqa: E402

CASES = {
    # name: (op, input shape, where models do it)
    "reflect1d": (lambda x: F.pad(x, (3, 3), mode="reflect"), (8, 64, 4096), "HiFi-GAN's vocoder convolutions"),
    "reflect2d": (lambda x: F.pad(x, (1, 1, 1, 1), mode="reflect"), (8, 64, 64, 64), "CycleGAN's ReflectionPad2d"),
    "replicate2d": (lambda x: F.pad(x, (1, 1, 1, 1), mode="replicate"), (8, 64, 64, 64), "edge padding"),
    "unfold_frames": (lambda x: x.unfold(-1, 400, 160), (8, 16000), "audio frames: 25 ms every 10 ms"),
    "unfold_patches": (lambda x: x.unfold(-1, 16, 16), (8, 64, 4096), "patches that touch"),
    "unfold_overlap": (lambda x: x.unfold(-1, 4, 2), (8, 64, 4096), "windows of 4 every 2"),
    "spectrogram": (lambda x, w=torch.hann_window(400): torch.stft(x, 400, 160, window=w, return_complex=True).abs()
                    .pow(2), (8, 16000), "audio models' power spectrogram: 25 ms every 10 ms"),
    "upsample_nearest": (lambda x: F.interpolate(x, scale_factor=2, mode="nearest"), (8, 64, 32, 32),
                         "U-Net and diffusion decoders"),
    "upsample_bilinear": (lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"), (8, 64, 32, 32),
                          "segmentation decoders, FPNs"),
    "upsample_bilinear_64": (lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"), (4, 32, 64, 64),
                             "the same on larger maps"),
    "upsample_bilinear_128": (lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"), (2, 32, 128, 128),
                              "the same, larger still"),
    "upsample_bilinear_ac": (lambda x: F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=True),
                             (8, 64, 32, 32), "the same, align_corners=True"),
    "max_pool2d": (lambda x: F.max_pool2d(x, 3, 2, 1), (8, 64, 64, 64), "ResNet's stem"),
    "adaptive_avg": (lambda x: F.adaptive_avg_pool2d(x, 7), (8, 64, 56, 56), "windows that tile the input"),
    "adaptive_avg_head": (lambda x: F.adaptive_avg_pool2d(x, 1), (32, 512, 7, 7), "ResNet's and MobileNet's pooler"),
    "adaptive_avg_3d": (lambda x: F.adaptive_avg_pool3d(x, 4), (4, 32, 16, 32, 32), "video models' pooling"),
    "adaptive_max": (lambda x: F.adaptive_max_pool2d(x, 7), (8, 64, 56, 56), "max pooling to a fixed grid"),
    "adaptive_max_uneven": (lambda x: F.adaptive_max_pool2d(x, 6), (8, 64, 56, 56), "windows that overlap"),
    "pixel_shuffle": (lambda x: F.pixel_shuffle(x, 2), (8, 256, 32, 32), "super-resolution upsampling"),
    "group_norm": (lambda x: F.group_norm(x, 32), (8, 64, 64, 64), "diffusion U-Nets' normalization"),
    "group_norm_affine": (lambda x, w=torch.rand(64) + 0.5, b=torch.randn(64): F.group_norm(x, 32, w, b),
                          (8, 64, 64, 64), "the same with nn.GroupNorm's weight and bias"),
    "group_norm_layer": (lambda x, m=torch.nn.GroupNorm(32, 64): m(x), (8, 64, 64, 64),
                         "an nn.GroupNorm layer: its weight fixes the channels under --dynamic, as in models"),
    "batch_norm": (lambda x, w=torch.rand(64, requires_grad=True), b=torch.randn(64, requires_grad=True):
                   F.batch_norm(x, None, None, w, b, training=True), (8, 64, 56, 56), "ResNet's BatchNorm2d, training"),
    "conv_transpose": (lambda x, w=torch.randn(64, 32, 2, 2, requires_grad=True): F.conv_transpose2d(x, w, stride=2),
                       (8, 64, 32, 32), "U-Net decoders' 2x2 up-convolution"),
    "avg_pool2d": (lambda x: F.avg_pool2d(x, 2), (8, 64, 64, 64), "DenseNet's transitions"),
    "channels_last_norm": (lambda x, w=torch.rand(96, requires_grad=True): F.layer_norm(
        x.permute(0, 2, 3, 1), (96,), w).permute(0, 3, 1, 2), (8, 96, 56, 56), "ConvNeXt's LayerNorm over channels"),
    "roll": (lambda x: torch.roll(x, (-3, -3), (1, 2)), (8, 56, 56, 96), "Swin's shifted windows"),
    "window_partition": (lambda x: x.view(8, 8, 7, 8, 7, 96).permute(0, 1, 3, 2, 4, 5).reshape(-1, 49, 96),
                         (8, 56, 56, 96), "Swin's windows of 7x7 tokens"),
    "im2col": (lambda x: F.unfold(x, 3, padding=1), (8, 64, 32, 32), "F.unfold's patches"),
    "instance_norm": (lambda x: F.instance_norm(x), (8, 64, 64, 64), "style transfer's InstanceNorm2d"),
    "avg_pool_whole": (lambda x: F.avg_pool2d(x, 320, ceil_mode=True), (8, 320, 4, 4),
                       "one window larger than the map: HF EfficientNet's pooler"),
    "seg_cross_entropy": (lambda x, y=torch.randint(0, 21, (8, 128, 128)): F.cross_entropy(x, y, reduction="none"),
                          (8, 21, 128, 128), "segmentation loss: log-softmax over the channels"),
    "channel_softmax": (lambda x: F.softmax(x, dim=1), (8, 64, 32, 32), "softmax over channels (attention maps)"),
    "depthwise_conv": (lambda x, w=torch.randn(96, 1, 7, 7, requires_grad=True): F.conv2d(x, w, padding=3, groups=96),
                       (8, 96, 56, 56), "ConvNeXt's 7x7 depthwise convolution, weight gradient included"),
    "depthwise_conv_14": (lambda x, w=torch.randn(384, 1, 7, 7, requires_grad=True): F.conv2d(x, w, padding=3, groups=384),
                          (8, 384, 14, 14), "the same in ConvNeXt's third stage"),
    "pointwise_conv": (lambda x, w=torch.randn(192, 64, 1, 1, requires_grad=True): F.conv2d(x, w),
                       (8, 64, 28, 28), "MobileNet's and ResNet's 1x1 convolution, weight gradient included"),
    "shortcut_conv": (lambda x, w=torch.randn(128, 64, 1, 1, requires_grad=True): F.conv2d(x, w, stride=2),
                      (8, 64, 56, 56), "ResNet's stride-2 1x1 shortcut, weight gradient included"),
    "conv3x3": (lambda x, w=torch.randn(64, 64, 3, 3, requires_grad=True): F.conv2d(x, w, padding=1),
                (8, 64, 32, 32), "U-Nets' and ResNets' 3x3 convolution, weight gradient included"),
    "conv3x3_64": (lambda x, w=torch.randn(64, 64, 3, 3, requires_grad=True): F.conv2d(x, w, padding=1),
                   (4, 64, 64, 64), "the same on a diffusion U-Net's 64x64 latents"),
    "conv3x3_deep": (lambda x, w=torch.randn(256, 256, 3, 3, requires_grad=True): F.conv2d(x, w, padding=1),
                     (8, 256, 14, 14), "ResNet's third stage: 256 channels at 14x14"),
    "conv3x3_s2": (lambda x, w=torch.randn(128, 64, 3, 3, requires_grad=True): F.conv2d(x, w, stride=2, padding=1),
                   (8, 64, 32, 32), "a stride-2 3x3 downsampling"),
    "conv_transpose_4x4": (lambda x, w=torch.randn(128, 64, 4, 4, requires_grad=True): F.conv_transpose2d(
        x, w, stride=2, padding=1), (8, 128, 16, 16), "DCGAN's generator: a 4x4 stride-2 up-convolution"),
    "conv_4x4_s2": (lambda x, w=torch.randn(128, 64, 4, 4, requires_grad=True): F.conv2d(x, w, stride=2, padding=1),
                    (8, 64, 32, 32), "DCGAN's discriminator: a 4x4 stride-2 convolution"),
    "conv1d_k3": (lambda x, w=torch.randn(256, 256, 3, requires_grad=True): F.conv1d(x, w, padding=1),
                  (8, 256, 256), "audio and sequence models' 1-D convolution"),
    "grouped_conv": (lambda x, w=torch.randn(128, 4, 3, 3, requires_grad=True): F.conv2d(x, w, padding=1, groups=32),
                     (8, 128, 32, 32), "ResNeXt's 3x3 convolution in 32 groups of 4 channels"),
    "stem_conv": (lambda x, w=torch.randn(64, 3, 7, 7, requires_grad=True): F.conv2d(x, w, stride=2, padding=3),
                  (8, 3, 112, 112), "ResNet's 7x7 stride-2 stem, weight gradient included"),
    # Recurrent layers: Dynamo captures them only with its allow_rnn switch (set in main);
    # ORT runs them unrolled over the sequence.
    "lstm_16": (lambda x, m=torch.nn.LSTM(128, 256, num_layers=2, batch_first=True): m(x)[0], (16, 16, 128),
                "a 2-layer LSTM tagger over 16 steps"),
    "lstm_64": (lambda x, m=torch.nn.LSTM(128, 256, num_layers=2, batch_first=True): m(x)[0], (16, 64, 128),
                "the same over 64 steps"),
    "gru_64": (lambda x, m=torch.nn.GRU(128, 256, num_layers=2, batch_first=True): m(x)[0], (16, 64, 128),
               "a 2-layer GRU over 64 steps"),
    # Attention at the CPU benchmark models' shapes (one layer): eager runs torch's flash attention
    # for CPU, ort ort_dynamo's attention kernels (ORT_DYNAMO_CPU_ATTENTION_KERNEL=0: its products
    # and softmax written out, the probabilities recomputed in backward).
    "attention": (lambda x: F.scaled_dot_product_attention(x, x, x), (8, 4, 128, 64),
                  "BERT's attention: 4 heads of 64, 128 tokens"),
    "attention_causal": (lambda x: F.scaled_dot_product_attention(x, x, x, is_causal=True), (8, 4, 128, 64),
                         "GPT-2's and Llama's, causal"),
    "attention_causal_mask": (lambda x, m=torch.full((128, 128), float("-inf")).triu(1):
                              F.scaled_dot_product_attention(x, x, x, attn_mask=m), (8, 4, 128, 64),
                              "causal as a mask of -inf above the diagonal, as HF's GPT-2 gives it"),
    "attention_long": (lambda x: F.scaled_dot_product_attention(x, x, x), (2, 4, 1024, 64),
                       "1024 tokens: [batch, heads, 1024, 1024] scores written out"),
    "attention_long_causal": (lambda x: F.scaled_dot_product_attention(x, x, x, is_causal=True),
                              (2, 4, 1024, 64), "1024 tokens, causal"),
}


def heaviest_nodes(op, x, steps: int = 10, top: int = 6, dynamic: bool = False) -> list[tuple[float, str]]:
    """(median ms, "op output-shape") of ORT's heaviest nodes in a step of the case."""
    from profile_step import heaviest_ort_nodes

    def step():
        compiled = torch.compile(lambda t: (op(t) * 1.5).square().sum(), backend="ort", dynamic=dynamic or None)
        return lambda: compiled(x).backward()

    return heaviest_ort_nodes(step, steps, top)


def aot_eager_first_step(op, x) -> float:
    """Seconds of the case's first step under ``aot_eager``: AOTAutograd without ORT, what ort's
    first step adds its export and sessions to."""
    torch._dynamo.reset()
    start = time.perf_counter()
    torch.compile(lambda t: (op(t) * 1.5).square().sum(), backend="aot_eager")(x).backward()
    return time.perf_counter() - start


def _variant(text: str) -> dict:
    """``KEY=VALUE,...`` as ORT options (train_step.py's parser), checked before any training."""
    try:
        options = key_values(text)
        ort_dynamo.OrtOptions.from_mapping(options)
    except (ValueError, ort_dynamo.OptionsError) as exc:
        raise SystemExit(f"--variant: {exc}") from None
    return options


def _options_text(options: dict) -> str:
    return ",".join(f"{key}={value}" for key, value in options.items())


def main(names: list[str]) -> None:
    variant = None
    if "--variant" in names:
        at = names.index("--variant")
        if at + 1 == len(names):
            raise SystemExit("--variant takes KEY=VALUE[,KEY=VALUE...]")
        variant = _variant(names[at + 1])
        names = names[:at] + names[at + 2:]
    profile, first_steps, dynamic = "--profile" in names, "--first-step" in names, "--dynamic" in names
    names = [name for name in names if name not in ("--profile", "--first-step", "--dynamic")]
    warnings.simplefilter("ignore")
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
    torch.manual_seed(0)
    torch._dynamo.config.allow_rnn = True  # the recurrent cases; no other case has an RNN
    _steady_malloc()  # as train_step.py: neither side pays page faults for the other's frees
    print(f"torch {torch.__version__}; forward + backward, median of 20 interleaved steps"
          + ("; compiled with dynamic=True" if dynamic else ""))
    if first_steps:  # the process's one-time costs (imports, first traces) go to neither side
        warm = torch.randn(4, 4, requires_grad=True)
        aot_eager_first_step(torch.sin, warm)
        interleaved_ms(torch.sin, (warm,), 1, loss=lambda out: out.sum())
    for name in names or CASES:
        op, shape, where = CASES[name]
        x = torch.randn(*shape, requires_grad=True)
        if first_steps:
            aot_first = aot_eager_first_step(op, x)
        e, o, first, *other = interleaved_ms(lambda t, op=op: (op(t) * 1.5).square().sum(), (x,), 20,
                                             dynamic=dynamic, variant=variant)
        print(f"{name:20s} {str(tuple(shape)):19s} eager {e:7.2f} ms  ort {o:7.2f} ms  ort/eager {o / e:5.2f}  "
              f"ort first step {first:5.1f} s  fallback nodes {ort_dynamo.report().fallback_nodes}  ({where})",
              flush=True)
        if other:
            print(f"{'':40s} with {_options_text(variant)}: {other[0]:7.2f} ms, {other[0] / e:5.2f} of eager's, "
                  f"{other[0] / o:5.2f} of the default ort's", flush=True)
        if first_steps:
            print(f"{'':40s} first step: aot_eager {aot_first:5.1f} s, ort {first:5.1f} s, "
                  f"ort/aot_eager {first / aot_first:.2f}", flush=True)
        if profile:
            for ms, node in heaviest_nodes(op, x, dynamic=dynamic):
                print(f"    {ms:6.2f} ms  {node[:100]}")


if __name__ == "__main__":
    main(sys.argv[1:])
