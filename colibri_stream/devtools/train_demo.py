"""Train the embedded demo model: a small ``glm_moe_dsa`` MoE on the Python standard library's source.

`colibri-stream demo` needs a real trained checkpoint that ships with the repository, so the demo
shows meaningful text and a router whose expert usage is skewed the way trained routers are (random
routers spread evenly, which hides what a RAM cache of hot experts buys). The data is text every
machine has — the stdlib's ``.py`` files — so the model is remade anywhere with one command and no
download. Everything is seeded; the corpus depends on the Python version that provides the stdlib.

The model has every structural feature the engine streams: MLA, a DSA indexer that really selects
(``index_topk`` < training context; "full" and "shared" indexer layers), 32 routed experts with top-4
routing, one shared expert, and routed experts holding most of the parameters. transformers does not
train the indexer (its forward is ``no_grad``) nor ``e_score_correction_bias`` (a buffer): both keep
their initial values, which is what the checkpoint then carries.

transformers is a dev dependency, imported lazily as in ``colibri_stream.devtools.fixtures``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

BOS, EOS = 0, 1
SPECIAL_TOKENS = ["<bos>", "<eos>"]
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "dist-packages"}
HELDOUT_EVERY = 20  # every 20th file (by sorted path) is held out
# GLM-5's conversation shape, written for the demo: <|role|>\ncontent + eos per message (what the model was
# trained beside: it never saw a chat), the tools offered as JSON lines in a system turn, GLM's tool calls
# (<tool_call>NAME, <arg_key>/<arg_value> pairs: text/tool_calls.py finds the format from these markers),
# tool results as <|observation|> turns, and GLM's thinking switch: ``enable_thinking`` opens <think> in
# the generation prompt (off unless asked: the demo never learned to close it). Without tools or thinking
# a conversation renders as the first demo's template did, so its answers did not change. (A newline right
# after a block tag is written {{ '\n' }}: chat templates render with trim_blocks, which drops it.)
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>\n# Tools\nYou may call one or more functions. Their signatures, one JSON "
    "object a line:\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    "For each call, write <tool_call>{function-name}\n<arg_key>{arg-key}</arg_key>\n"
    "<arg_value>{arg-value}</arg_value>\n...</tool_call>{{ eos_token }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}<|observation|>\n<tool_response>{{ message['content'] }}"
    "</tool_response>{{ eos_token }}"
    "{% elif message['role'] == 'assistant' %}<|assistant|>\n"
    "{% if message.get('reasoning_content') %}<think>{{ message['reasoning_content'] }}</think>{% endif %}"
    "{{ message['content'] }}"
    "{% for call in message.get('tool_calls') or [] %}{{ '\n' }}<tool_call>{{ call['function']['name'] }}"
    "{% for key, value in call['function']['arguments'].items() %}{{ '\n' }}<arg_key>{{ key }}</arg_key>\n"
    "<arg_value>{{ value if value is string else value | tojson }}</arg_value>{% endfor %}{{ '\n' }}</tool_call>"
    "{% endfor %}{{ eos_token }}"
    "{% else %}<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% if enable_thinking %}<think>{% endif %}{% endif %}"
)

# The model: ~13M parameters, 73% of them in routed experts (hidden and moe_intermediate are
# multiples of the int4 group size 64, which the converter requires).
DEMO_CONFIG: dict[str, Any] = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=768,
    moe_intermediate_size=128,
    num_hidden_layers=4,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=128,
    kv_lora_rank=64,
    qk_rope_head_dim=16,
    qk_nope_head_dim=32,
    v_head_dim=32,
    n_routed_experts=32,
    num_experts_per_tok=4,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    index_topk=128,
    index_head_dim=32,
    index_n_heads=16,
    indexer_types=["full", "shared", "full", "shared"],
    max_position_embeddings=32768,  # an agent's preamble fits; trained on 256-token windows (README)
    initializer_range=0.02,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=BOS,
    eos_token_id=EOS,
)


@dataclass(frozen=True)
class TrainOptions:
    """Everything that determines the trained weights (besides the Python version's stdlib)."""

    steps: int = 1000
    batch: int = 8
    seq_len: int = 256  # > index_topk, so the indexer selects during training
    lr: float = 3e-3
    warmup: int = 100
    weight_decay: float = 0.01
    seed: int = 0
    vocab_size: int = 4096
    eval_tokens: int = 16384  # held-out tokens scored for the reported perplexity


# ------------------------------------------------------------------------------------------- data


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """The stdlib's ``.py`` files outside test and third-party directories, sorted by relative path."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not SKIP_DIRS & set(p.relative_to(root).parts[:-1])]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def split_files(files: Sequence[Path]) -> tuple[list[Path], list[Path]]:
    """(train, held-out): a fixed every-Nth-file split, so held-out text is whole unseen modules."""
    heldout = [f for i, f in enumerate(files) if i % HELDOUT_EVERY == HELDOUT_EVERY // 2]
    train = [f for i, f in enumerate(files) if i % HELDOUT_EVERY != HELDOUT_EVERY // 2]
    return train, heldout


def read_texts(files: Sequence[Path]) -> list[str]:
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def heldout_texts(root: str | Path | None = None) -> list[str]:
    """The held-out modules' source, for perplexity measurements outside training."""
    return read_texts(split_files(stdlib_files(root))[1])


def train_tokenizer(texts: Sequence[str], vocab_size: int):
    """A byte-level BPE tokenizer (<bos>=0, <eos>=1): any text encodes, no unknown token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def encode_documents(tokenizer, texts: Sequence[str]) -> torch.Tensor:
    """One long id stream: <bos> text <eos> per document, so the model learns where files start."""
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(list(texts)):
        ids += [BOS, *encoding.ids, EOS]
    return torch.tensor(ids, dtype=torch.long)


# ------------------------------------------------------------------------------------------ model


def build_model(seed: int, config_overrides: dict[str, Any] | None = None) -> torch.nn.Module:
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    config = GlmMoeDsaConfig(**{**DEMO_CONFIG, **(config_overrides or {})})
    torch.manual_seed(seed)
    return GlmMoeDsaForCausalLM(config).float()


def parameter_counts(model: torch.nn.Module) -> dict[str, int]:
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    return {"total": total, "routed_experts": routed}


def lr_at(step: int, options: TrainOptions) -> float:
    """Linear warmup then cosine decay to 10%: the usual schedule for a short run."""
    if step < options.warmup:
        return options.lr * (step + 1) / options.warmup
    progress = (step - options.warmup) / max(1, options.steps - options.warmup)
    return options.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def random_batch(ids: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    """[batch, seq_len + 1] windows at random offsets (inputs and shifted targets in one tensor)."""
    starts = torch.randint(0, len(ids) - seq_len - 1, (batch,), generator=gen)
    return torch.stack([ids[s : s + seq_len + 1] for s in starts.tolist()])


def next_token_loss(model: torch.nn.Module, window: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of window[:, 1:] given window[:, :-1] (shifted here, explicitly)."""
    logits = model(input_ids=window[:, :-1], use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), window[:, 1:].flatten())


def train(
    model: torch.nn.Module,
    ids: torch.Tensor,
    options: TrainOptions,
    log: Callable[[str], None] = print,
    max_seconds: float | None = None,
) -> dict[str, Any]:
    """AdamW on next-token cross-entropy; returns steps done, tokens seen, seconds and the last loss."""
    gen = torch.Generator().manual_seed(options.seed)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=options.lr, betas=(0.9, 0.95), weight_decay=options.weight_decay
    )
    model.train()
    start, smooth, step = time.perf_counter(), None, 0
    for step in range(options.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, options)
        window = random_batch(ids, options.batch, options.seq_len, gen)
        loss = next_token_loss(model, window)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        smooth = loss.item() if smooth is None else 0.95 * smooth + 0.05 * loss.item()
        elapsed = time.perf_counter() - start
        if step % 25 == 0 or step == options.steps - 1:
            tok_s = (step + 1) * options.batch * options.seq_len / elapsed
            log(f"step {step:5d}  loss {smooth:.3f}  lr {lr_at(step, options):.2e}  {tok_s:.0f} tok/s  {elapsed:.0f}s")
        if max_seconds is not None and elapsed > max_seconds:
            log(f"stopping early at step {step}: {max_seconds:.0f}s budget spent")
            break
    model.eval()
    done = step + 1
    return {
        "steps_done": done,
        "tokens_seen": done * options.batch * options.seq_len,
        "seconds": round(time.perf_counter() - start, 1),
        "final_smoothed_loss": round(smooth or 0.0, 4),
    }


# ----------------------------------------------------------------------------------- perplexity


def eval_windows(ids: torch.Tensor, seq_len: int, n_tokens: int) -> list[torch.Tensor]:
    """Non-overlapping [seq_len + 1] windows covering the first ``n_tokens`` targets of ``ids``.

    Every perplexity in the project (float reference, engine, int4 container) scores the same windows,
    so the numbers compare directly."""
    n = min(n_tokens, len(ids) - 1) // seq_len
    return [ids[i * seq_len : (i + 1) * seq_len + 1] for i in range(n)]


@torch.no_grad()
def reference_perplexity(model: torch.nn.Module, windows: Sequence[torch.Tensor]) -> float:
    """exp(mean next-token cross-entropy) of the transformers model over ``windows``."""
    losses = [next_token_loss(model, w[None]).item() for w in windows]
    return math.exp(sum(losses) / len(losses))


@torch.no_grad()
def engine_perplexity(loaded, windows: Sequence[torch.Tensor]) -> float:
    """The same perplexity through colibri-stream's engine (``loaded``: a checkpoint.LoadedModel),
    each window prefilled into a fresh cache — what the int4-vs-float quality claim is measured with."""
    losses = []
    for w in windows:
        tokens = w[None, :-1].to(loaded.model.device)
        logits = loaded.model(tokens, 0, loaded.model.new_cache(), loaded.experts)[0]
        losses.append(torch.nn.functional.cross_entropy(logits, w[1:].to(logits.device)).item())
    return math.exp(sum(losses) / len(losses))


def heldout_windows(model_dir: str | Path, seq_len: int = 256, n_tokens: int = 16384) -> list[torch.Tensor]:
    """Held-out windows encoded with the tokenizer saved in ``model_dir``."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    return eval_windows(encode_documents(tokenizer, heldout_texts()), seq_len, n_tokens)


def expert_counts(loaded, windows: Sequence[torch.Tensor]) -> torch.Tensor:
    """[n_moe_layers, n_routed_experts] per-token routing counts of the engine's routers over ``windows``.

    The hook replays each MoE layer's gate on that layer's input: hooking the gate itself would also
    count the router-guided prefetch guesses, which are not routing decisions. An MTP module's block
    (``mtp.*``) drafts rather than routes the model's tokens, and never runs here: it is not counted."""
    from engine.core.moe import MoE

    layers = [m for name, m in loaded.model.named_modules() if isinstance(m, MoE) and not name.startswith("mtp.")]
    counts = torch.zeros(len(layers), loaded.args.n_routed_experts, dtype=torch.long)

    def record(i: int) -> Callable:
        def hook(moe: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> None:
            counts[i] += _routed(moe, inputs[0], counts.shape[1])  # returns None: output unchanged

        return hook

    hooks = [layer.register_forward_hook(record(i)) for i, layer in enumerate(layers)]
    try:
        engine_perplexity(loaded, windows)
    finally:
        for hook in hooks:
            hook.remove()
    return counts


def _routed(moe: torch.nn.Module, x: torch.Tensor, n_experts: int) -> torch.Tensor:
    ids = moe.gate(x.reshape(-1, x.shape[-1]))[1]  # type: ignore[operator]  # [tokens, top_k]; a Module attribute
    return torch.bincount(ids.flatten().cpu(), minlength=n_experts)


# ------------------------------------------------------------------------------------------- save


def save_demo(model: torch.nn.Module, tokenizer, dst: str | Path, meta: dict[str, Any]) -> Path:
    """bfloat16 safetensors (halves the committed bytes), config, generation config, tokenizer with
    a chat template, and ``training.json`` recording how the weights were made."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(dst)  # type: ignore[operator]  # nn.Module types its attributes as Tensor | Module
    model.float()
    tokenizer.save(str(dst / "tokenizer.json"))
    write_tokenizer_config(dst)
    (dst / "training.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return dst


def write_tokenizer_config(dst: Path) -> None:
    """tokenizer_config.json (special tokens, chat template) and chat_template.jinja: what chat and
    serve read to format conversations."""
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[BOS],
        "eos_token": SPECIAL_TOKENS[EOS],
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": DEMO_CONFIG["max_position_embeddings"],
    }
    (dst / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (dst / "chat_template.jinja").write_text(CHAT_TEMPLATE + "\n")


def quality_report(model_dir: str | Path, windows: Sequence[torch.Tensor], work: str | Path) -> dict[str, Any]:
    """Held-out perplexity of the saved checkpoint (transformers and engine, float32) and of its int4
    container, plus the trained router's expert usage on the same text."""
    from colibri_stream.devtools.fixtures import load_reference
    from colibri_stream.runtime.loader import load_checkpoint, load_container

    container = Path(work) / "demo-int4.cstream"
    convert = [sys.executable, "-m", "colibri_stream", "convert", str(model_dir), str(container), "--no-progress"]
    subprocess.run(convert, check=True, stdout=subprocess.DEVNULL)  # the CLI: devtools never import convert/
    counts = expert_counts(load_checkpoint(model_dir), windows)
    per_layer = counts.max(dim=1).values.float() / counts.min(dim=1).values.clamp(min=1).float()
    return {
        "heldout_tokens": sum(len(w) - 1 for w in windows),
        "ppl_transformers_float32": round(reference_perplexity(load_reference(model_dir), windows), 4),
        "ppl_engine_float32": round(engine_perplexity(load_checkpoint(model_dir), windows), 4),
        "ppl_engine_int4": round(engine_perplexity(load_container(container), windows), 4),
        "expert_counts": counts.tolist(),
        "expert_max_over_min_per_layer": [round(x, 2) for x in per_layer.tolist()],
    }


# ------------------------------------------------------------------------------------------- main


def make_demo(dst: str | Path, options: TrainOptions, log: Callable[[str], None] = print, **kw: Any) -> dict:
    """The whole recipe: data, tokenizer, training, save, quality report (written to training.json)."""
    import platform
    import tempfile

    started = time.perf_counter()
    torch.manual_seed(options.seed)
    train_files, held_files = split_files(stdlib_files())
    train_texts = read_texts(train_files)
    tokenizer = train_tokenizer(train_texts, options.vocab_size)
    train_ids = encode_documents(tokenizer, train_texts)
    windows = eval_windows(encode_documents(tokenizer, read_texts(held_files)), options.seq_len, options.eval_tokens)
    log(f"{len(train_files)} train files ({len(train_ids)} tokens), {len(held_files)} held-out files")
    model = build_model(options.seed)
    counts = parameter_counts(model)
    log(f"parameters: {counts}")
    run = train(model, train_ids, options, log, **kw)
    meta: dict[str, Any] = {
        "options": asdict(options),
        "parameters": counts,
        "training": run,
        "data": {
            "python": platform.python_version(),
            "train_files": len(train_files),
            "heldout_files": len(held_files),
            "train_tokens_available": len(train_ids),
        },
    }
    save_demo(model, tokenizer, dst, meta)
    with tempfile.TemporaryDirectory() as work:
        meta["quality"] = quality_report(dst, windows, work)
    meta["total_minutes"] = round((time.perf_counter() - started) / 60, 1)
    (Path(dst) / "training.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return meta


# -------------------------------------------------------------------------------------------- cli


@dataclass(frozen=True)
class TrainingRun:
    """What every demo training command takes: the folder, the options (defaults with --steps/--seed
    applied) and the time cap; ``args`` has the command's own flags too."""

    dst: str
    options: TrainOptions
    max_seconds: float | None
    args: argparse.Namespace


def training_command(
    doc: str | None, defaults: TrainOptions, extra: Callable[[argparse.ArgumentParser], None] | None = None
) -> TrainingRun:
    """Parse a demo training command's arguments (DST, --steps, --seed, --threads, --max-minutes and
    ``extra``'s) and set torch's threads."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dst", nargs="?", default="colibri_stream/demo_model")
    parser.add_argument("--steps", type=int, help=f"optimizer steps (default {defaults.steps})")
    parser.add_argument("--seed", type=int, help=f"seed (default {defaults.seed})")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--max-minutes", type=float, help="stop training early after this long (safety cap)")
    if extra is not None:
        extra(parser)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    changes = {"steps": args.steps, "seed": args.seed}
    options = dataclasses.replace(defaults, **{k: v for k, v in changes.items() if v is not None})
    return TrainingRun(args.dst, options, args.max_minutes * 60 if args.max_minutes else None, args)
