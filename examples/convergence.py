"""Convergence investigation, end to end, on a tiny GPT-2 (see docs/convergence.md).

    python examples/convergence.py [OUTPUT_DIR]

1. dumps per-step activation statistics of an eager run and of a ``backend="ort"`` run,
2. merges them per step (merge_activation_summary),
3. lets ``ort_dynamo.debug.compare`` find the first divergence.

``python -m ort_dynamo compare examples/convergence.py`` runs step 3 alone: it uses
``get_model`` and ``get_inputs`` below.
"""

import os
import sys
import tempfile

import torch

STEPS = 2


def get_model() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    # Randomness removed: dropouts 0 (and the same seed for both runs).
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def get_inputs() -> dict:
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def train(model, steps: int) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        loss = model(**get_inputs()).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(round(loss.item(), 6))
    return losses


def main(out: str) -> None:
    import ort_dynamo
    from ort_dynamo.debug import compare
    from ort_dynamo.utils.hooks import GlobalSubscriberManager, StatisticsSubscriber
    from ort_dynamo.utils.hooks.merge_activation_summary import merge

    # 1a. the PyTorch baseline
    model = get_model()
    GlobalSubscriberManager.subscribe(model, [StatisticsSubscriber(os.path.join(out, "pt_out"),
                                                                   override_output_dir=True)])
    print("eager losses:", train(model, STEPS))

    # 1b. the same model on ONNX Runtime (subscribing before or after torch.compile both work)
    model = torch.compile(get_model(), backend="ort",
                          options={"deterministic_compute": True, "enable_compute_optimizer": False})
    GlobalSubscriberManager.subscribe(model, [StatisticsSubscriber(os.path.join(out, "ort_out"),
                                                                   override_output_dir=True)])
    print("ort losses:  ", train(model, STEPS))
    GlobalSubscriberManager.unsubscribe()
    print(f"graphs compiled with hooks: {len(ort_dynamo.report().graphs)}")

    # 2. one file per step, PyTorch's order, both runs side by side
    written = merge(os.path.join(out, "pt_out"), os.path.join(out, "ort_out"),
                    os.path.join(out, "merged"), overwrite=True)
    print(f"merged summaries: {len(written)} files, e.g. {written[-1]}")

    # 3. let compare find the first diverging step / activation / ONNX node
    result = compare(get_model, get_inputs(), steps=STEPS, save_path=os.path.join(out, "onnx"))
    sys.exit(1 if result.diverged else 0)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="ort_dynamo_convergence_"))
