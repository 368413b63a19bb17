"""Fine-tune the demo model to answer a chat turn in one sentence and end it (``chat_corpus`` says why).

Starts from the shipped weights (``model.safetensors``, read as float32) and trains every parameter the
main run trained on a mix, per step, of one synthetic agent conversation (a preamble of up to
``max_preamble_chars`` characters, so the answers are learned at the distances an agent's prompt puts them)
whose loss counts only the answer ids, and a batch of plain stdlib windows (the original objective, so
the model keeps its Python). Same tokenizer, same training files; the held-out split is untouched, and
the quality report of ``train_demo`` is redone on the result. ``model.safetensors`` is replaced (bfloat16);
the MTP shard is not touched (retrain it after: ``python -m colibri_stream.devtools.train_demo_mtp``).

    python -m colibri_stream.devtools.train_demo_chat [DST] [--steps N] [--seed S] [--threads T] [--max-minutes M]
"""

from __future__ import annotations

import dataclasses
import json
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from colibri_stream.devtools.chat_corpus import IGNORE, ChatExample, ConversationMaker, documented, encode_conversation
from colibri_stream.devtools.train_demo import (
    TrainOptions,
    encode_documents,
    eval_windows,
    next_token_loss,
    quality_report,
    random_batch,
    read_texts,
    split_files,
    stdlib_files,
    training_command,
)
from colibri_stream.devtools.train_demo_mtp import load_main
from colibri_stream.text.chat_format import PromptEncoder, load_chat_format

CHAT_OPTIONS = TrainOptions(steps=240, batch=4, seq_len=256, lr=1e-3, warmup=20)
MAX_PREAMBLE_CHARS = 4000  # ~1.1k tokens (+ a tool list): distances past the 256-token windows of the main run


def lr_at(step: int, options: TrainOptions) -> float:
    """Linear warmup, then linear decay to 10%: a short fine-tune."""
    if step < options.warmup:
        return options.lr * (step + 1) / options.warmup
    return options.lr * (1 - 0.9 * (step - options.warmup) / max(1, options.steps - options.warmup))


def answer_loss(model: Any, example: ChatExample) -> torch.Tensor:
    ids = torch.tensor(example.ids)[None]
    logits = model(input_ids=ids, use_cache=False).logits[0]
    return torch.nn.functional.cross_entropy(logits.float(), torch.tensor(example.targets), ignore_index=IGNORE)


def examples(maker: ConversationMaker, model_dir: Path, count: int) -> list[ChatExample]:
    chat = load_chat_format(model_dir)
    encoder = PromptEncoder(chat_tokenizer(model_dir))
    made: list[ChatExample] = []
    while len(made) < count:
        preamble = 0 if maker.rng.random() < 0.1 else maker.rng.randint(200, MAX_PREAMBLE_CHARS)
        example = encode_conversation(chat, encoder, *maker.conversation(preamble))
        if example is not None:
            made.append(example)
    return made


def chat_tokenizer(model_dir: Path) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def fine_tune(
    model: Any,
    chats: list[ChatExample],
    lm_ids: torch.Tensor,
    options: TrainOptions,
    log: Callable[[str], None],
    max_seconds: float | None,
) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(options.seed)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=options.lr, betas=(0.9, 0.95), weight_decay=options.weight_decay
    )
    model.train()
    start, step, smooth = time.perf_counter(), 0, (0.0, 0.0)
    for step in range(options.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, options)
        chat = answer_loss(model, chats[step % len(chats)])
        text = next_token_loss(model, random_batch(lm_ids, options.batch, options.seq_len, gen))
        optimizer.zero_grad(set_to_none=True)
        (chat + text).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        smooth = (
            (chat.item(), text.item())
            if step == 0
            else (0.9 * smooth[0] + 0.1 * chat.item(), 0.9 * smooth[1] + 0.1 * text.item())
        )
        elapsed = time.perf_counter() - start
        if step % 10 == 0 or step == options.steps - 1:
            log(f"step {step:4d}  answer loss {smooth[0]:.3f}  text loss {smooth[1]:.3f}  {elapsed:.0f}s")
        if max_seconds is not None and elapsed > max_seconds:
            log(f"stopping early at step {step}: {max_seconds:.0f}s budget spent")
            break
    model.eval()
    return {
        "steps_done": step + 1,
        "seconds": round(time.perf_counter() - start, 1),
        "final_smoothed_answer_loss": round(smooth[0], 4),
        "final_smoothed_text_loss": round(smooth[1], 4),
    }


@torch.no_grad()
def heldout_answer_loss(model: Any, chats: list[ChatExample]) -> float:
    return sum(answer_loss(model, c).item() for c in chats) / len(chats)


def save_main(model: Any, dst: Path) -> None:
    """model.safetensors only (bfloat16): config, tokenizer, the MTP shard and its index stay as they are."""
    with tempfile.TemporaryDirectory() as tmp:
        model.to(torch.bfloat16).save_pretrained(tmp)
        model.float()
        (Path(tmp) / "model.safetensors").replace(dst / "model.safetensors")
    (dst / "model.safetensors").chmod(0o644)


def make_chat(
    dst: str | Path,
    options: TrainOptions = CHAT_OPTIONS,
    log: Callable[[str], None] = print,
    max_seconds: float | None = None,
) -> dict:
    """Fine-tune the demo in ``dst`` (see the module docstring), save it and record the run in training.json."""
    dst = Path(dst)
    started = time.perf_counter()
    torch.manual_seed(options.seed)
    root = Path(sysconfig.get_paths()["stdlib"])
    train_files, held_files = split_files(stdlib_files(root))
    lm_ids = encode_documents(chat_tokenizer(dst), read_texts(train_files))
    chats = examples(ConversationMaker(documented(train_files, root), options.seed), dst, options.steps)
    held = examples(ConversationMaker(documented(held_files, root), options.seed + 1), dst, 32)
    tokens = [len(c.ids) for c in chats]
    log(f"{len(chats)} conversations, {min(tokens)}-{max(tokens)} tokens (mean {sum(tokens) / len(tokens):.0f})")
    model = load_main(dst)
    for p in model.parameters():
        p.requires_grad_(True)
    before = heldout_answer_loss(model, held)
    log(f"held-out answer loss before: {before:.3f}")
    run = fine_tune(model, chats, lm_ids, options, log, max_seconds)
    after = heldout_answer_loss(model, held)
    log(f"held-out answer loss after: {after:.3f}")
    save_main(model, dst)
    meta_path = dst / "training.json"
    meta = json.loads(meta_path.read_text())
    meta["chat"] = {
        "options": dataclasses.asdict(options),
        "max_preamble_chars": MAX_PREAMBLE_CHARS,
        "conversation_tokens": {"min": min(tokens), "max": max(tokens), "mean": round(sum(tokens) / len(tokens))},
        "training": run,
        "heldout_answer_loss": {"before": round(before, 4), "after": round(after, 4), "conversations": len(held)},
    }
    windows = eval_windows(encode_documents(chat_tokenizer(dst), read_texts(held_files)), 256, 16384)
    with tempfile.TemporaryDirectory() as work:
        meta["quality"] = quality_report(dst, windows, work)
    meta["chat"]["total_minutes"] = round((time.perf_counter() - started) / 60, 1)
    meta_path.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return meta["chat"] | {"quality": {k: v for k, v in meta["quality"].items() if k.startswith("ppl")}}


def main() -> None:
    run = training_command(__doc__, CHAT_OPTIONS)
    print(json.dumps(make_chat(run.dst, run.options, max_seconds=run.max_seconds), indent=1))


if __name__ == "__main__":
    main()
