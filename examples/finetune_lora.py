"""LoRA fine-tuning of Inkling2 with PEFT, offline, on a small English corpus that ships with Python.

The corpus is CPython's `pydoc_data.topics`: the text `help()` prints for keywords and topics, about 465,000
characters of the Python language reference, present in every CPython install. It is tokenized with the model's
tokenizer and cut into fixed-length blocks; the last few blocks are held out to measure the loss.

    python examples/finetune_lora.py                      # the embedded Inkling-2-Nano (NVFP4 + MXFP8), attention LoRA
    python examples/finetune_lora.py --expert-lora        # the random tiny model, LoRA on attention and its BF16 experts
    python examples/finetune_lora.py --quantized          # an NVFP4 + MXFP8 copy of the tiny model, attention-only LoRA
    python examples/finetune_lora.py --model PATH --device cuda --steps 1000 --seq-len 2048 --gradient-checkpointing

The adapter is written with `save_pretrained` (default folder `inkling2-lora/`). Load it onto the same base model
with `PeftModel.from_pretrained(model, "inkling2-lora")` or `model.load_adapter("inkling2-lora")`, or merge it with
`merge_and_unload()`. After fine-tuning, realign the DSpark drafter: save the merged model and run
`inkling2 train-dspark --model MERGED --output REALIGNED`. See docs/finetuning.md and docs/dspark.md.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

import transformers_inkling2  # noqa: F401  (registers the Inkling2 classes with transformers)
from transformers_inkling2.finetuning import (
    DEFAULT_LORA_TARGET_MODULES,
    EXPERT_LORA_TARGET_PARAMETERS,
    refuse_lora_on_quantized_experts,
)
from transformers_inkling2.nano import NANO_CHECKPOINT, NANO_LABEL
from transformers_inkling2.processing.tokenization_inkling2 import build_inkling2_tokenizer
from transformers_inkling2.quantization.quantize import quantize_checkpoint
from transformers_inkling2.tiny import TINY_MODEL_LABEL, build_tiny_causal_lm


def corpus_blocks(tokenizer, seq_len: int) -> torch.Tensor:
    """[blocks, seq_len] token ids of the pydoc topics, concatenated in a fixed order."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[name] for name in sorted(topics))
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
    blocks = len(ids) // seq_len
    return ids[: blocks * seq_len].view(blocks, seq_len)


def uses_tiny_model(args) -> bool:
    """`--expert-lora` and `--quantized` without `--model` need BF16 experts, which Inkling-2-Nano (shipped quantized)
    has not: they take the random tiny model."""
    return args.model is None and (args.expert_lora or args.quantized)


def load_model(args, workdir: Path):
    """`--model`, the embedded Inkling-2-Nano, or (`uses_tiny_model`) the random tiny model; with `--quantized`, a
    mixed NVFP4 / MXFP8 copy of the tiny model."""
    if not uses_tiny_model(args):  # --model, or Nano
        print(f"model: {args.model or NANO_LABEL}")
        return AutoModelForCausalLM.from_pretrained(args.model or NANO_CHECKPOINT, dtype=args.dtype,
                                                    device_map=args.device)  # fmt: skip
    print(f"model: {TINY_MODEL_LABEL}")
    model = build_tiny_causal_lm(seed=args.seed)
    if not args.quantized:
        return model.to(args.device)
    # the official mix: NVFP4 experts in the first 40 of 48 layers, MXFP8 after (here 5 of 6, then 1)
    mxfp8_from = model.config.num_hidden_layers * 40 // 48
    model.save_pretrained(workdir / "bf16")
    quantize_checkpoint(workdir / "bf16", workdir / "quantized", mxfp8_from=mxfp8_from)
    print(f"quantized its experts: layers < {mxfp8_from} NVFP4, the others MXFP8")
    model = AutoModelForCausalLM.from_pretrained(workdir / "quantized")
    model.name_or_path = ""  # a temporary folder: not a base model to record in the adapter's config
    return model.to(args.device)


def lora_model(model, args):
    """Wraps `model` in a PEFT LoRA model: attention projections, plus the BF16 experts with `--expert-lora`."""
    target_parameters = EXPERT_LORA_TARGET_PARAMETERS if args.expert_lora else None
    try:
        refuse_lora_on_quantized_experts(model, target_parameters)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    config = LoraConfig(
        task_type="CAUSAL_LM",
        r=args.rank,
        lora_alpha=2 * args.rank,
        lora_dropout=0.0,  # PEFT's expert (parameter) LoRA does not support dropout
        target_modules=DEFAULT_LORA_TARGET_MODULES,
        target_parameters=target_parameters,
    )
    return get_peft_model(model, config)


@torch.no_grad()
def held_out_loss(model, blocks: torch.Tensor, batch_size: int, device) -> float:
    model.eval()
    losses = [
        model(input_ids=batch.to(device), labels=batch.to(device), use_cache=False).loss.item()
        for batch in blocks.split(batch_size)
    ]
    return sum(losses) / len(losses)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a checkpoint folder or Hub id (default: the embedded Inkling-2-Nano)")
    parser.add_argument("--quantized", action="store_true",
                        help="fine-tune an NVFP4 + MXFP8 copy of the tiny model (attention-only LoRA)")
    parser.add_argument("--expert-lora", action="store_true",
                        help="also adapt the routed experts (BF16 experts only: --model, or the random tiny model)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help='"cpu", "cuda", "cuda:N", or "auto" to spread --model over the visible GPUs')
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float,
                        help="default: 1e-2 for the tiny random model, 1e-3 for Inkling-2-Nano, 1e-4 for --model")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--held-out-blocks", type=int, default=8)
    parser.add_argument("--output", default="inkling2-lora", help="where the adapter is saved")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quantized and args.model is not None:
        parser.error("--quantized makes a quantized copy of the embedded tiny model; to fine-tune a quantized "
                     "checkpoint, pass it as --model (make one from BF16 with `inkling2 quantize`)")
    if args.device == "auto" and args.model is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    args.lr = args.lr or (1e-4 if args.model else 1e-2 if uses_tiny_model(args) else 1e-3)
    torch.manual_seed(args.seed)
    # PEFT 0.21 reads transformers' deprecated `is_gradient_checkpointing` alias: noise, not a problem of this run
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)

    started = time.perf_counter()
    nano = args.model is None and not uses_tiny_model(args)
    tokenizer = AutoTokenizer.from_pretrained(NANO_CHECKPOINT) if nano else build_inkling2_tokenizer()
    blocks = corpus_blocks(tokenizer, args.seq_len)
    train, held_out = blocks[: -args.held_out_blocks], blocks[-args.held_out_blocks :]
    print(f"corpus: pydoc_data.topics, {blocks.numel():,} tokens in {len(blocks)} blocks of {args.seq_len}")

    with tempfile.TemporaryDirectory() as workdir:
        model = load_model(args, Path(workdir))
    device = model.get_input_embeddings().weight.device
    if args.gradient_checkpointing:
        model.activation_checkpointing_enable()  # non-reentrant, the default: the layers pass a list of blocks
    model = lora_model(model, args)
    model.print_trainable_parameters()

    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(args.seed)
    print(f"held-out loss before: {held_out_loss(model, held_out, args.batch_size, device):.4f}")
    model.train()
    for step in range(1, args.steps + 1):
        batch = train[torch.randint(len(train), (args.batch_size,), generator=generator)].to(device)
        # use_cache=False: training keeps no cache, and gradient checkpointing must not write one twice
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step == 1 or step % args.log_every == 0 or step == args.steps:
            print(f"step {step:5d}  loss {loss.item():.4f}  {time.perf_counter() - started:6.1f}s")
    print(f"held-out loss after:  {held_out_loss(model, held_out, args.batch_size, device):.4f}")

    model.save_pretrained(args.output)
    print(f"adapter saved to {args.output}/ (load it with PeftModel.from_pretrained(model, {args.output!r}))")
    print("to realign the DSpark drafter: merge_and_unload(), save_pretrained(MERGED), then "
          "`inkling2 train-dspark --model MERGED --output REALIGNED`")


if __name__ == "__main__":
    main()
