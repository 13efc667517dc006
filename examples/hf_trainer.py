#!/usr/bin/env python3
"""HuggingFace Trainer on ONNX Runtime: one flag, ``torch_compile_backend="onnxrt"``.

A tiny GPT-2 built from a config (no download) learns a small made-up dataset. Options go
through ORT_DYNAMO_* environment variables, e.g.

    ORT_DYNAMO_FALLBACK_POLICY=DISABLE python examples/hf_trainer.py --fused-adam

See docs/huggingface.md.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import ort_dynamo
from ort_dynamo.integrations import huggingface as ort_hf


class CountingDataset(torch.utils.data.Dataset):
    """Sequences that count up from a random start modulo the vocabulary: easy to learn."""

    def __init__(self, size: int = 256, length: int = 16, vocab: int = 64) -> None:
        starts = torch.randint(0, vocab, (size, 1), generator=torch.Generator().manual_seed(0))
        self.ids = (starts + torch.arange(length)) % vocab

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--fused-adam", action="store_true", help="ort_dynamo.optim.FusedAdam instead of AdamW")
    parser.add_argument("--eager", action="store_true", help="leave the flag off, for comparison")
    args = parser.parse_args()

    ort_hf.enable()  # not needed once ort_dynamo is pip-installed (its entry point names "onnxrt")
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=64, n_positions=32,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    training_args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="hf_trainer_"),
        torch_compile_backend=None if args.eager else "onnxrt",  # <- the flag
        max_steps=args.steps, per_device_train_batch_size=8, learning_rate=3e-3,
        logging_steps=10, save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available())
    trainer = Trainer(
        model=model, args=training_args, train_dataset=CountingDataset(),
        optimizer_cls_and_kwargs=ort_hf.fused_adam(training_args) if args.fused_adam else None)
    result = trainer.train()
    print(f"final training loss {result.training_loss:.4f}")
    if not args.eager:
        print(ort_dynamo.report())


if __name__ == "__main__":
    main()
