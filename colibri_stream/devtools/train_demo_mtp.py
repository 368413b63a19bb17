"""Train the demo model's multi-token-prediction (MTP) layer, the main model frozen.

DeepSeek-V3 report §2.2, as engine/mla/mtp.py runs it: at position i, with h_i the main model's hidden state
before the final norm (the last decoder layer's output) and t_{i+1} the next token,

    x = eh_proj([enorm(embed(t_{i+1})) ; hnorm(h_i)]);  x = block_N(x) at RoPE position i, causal over
    the MTP positions;  logits = lm_head(shared_head.norm(x)) predicts t_{i+2}

with ``embed`` and ``lm_head`` the main model's (frozen). ``block_N`` is transformers' own
``GlmMoeDsaDecoderLayer`` with ``layer_idx = num_hidden_layers``: a MoE block running its own DSA indexer,
as the engine builds it (``ModelArgs.is_moe``/``has_indexer`` past the last layer), so its tensors are
``model.layers.N.*`` under the names the engine loads. It starts as a copy of the last layer (the indexer
from the last "full" layer; transformers trains neither the indexer nor ``e_score_correction_bias``, so
those keep the copied values), ``eh_proj`` as [I | I] (the block first sees the sum of both normed inputs),
the norms as ones but ``shared_head.norm`` as the main model's final norm.

The engine's drafter attends only over the positions decoded since drafting began (a fresh draft cache
starts at the last prompt position), so training mixes both contexts in one pass: per window a random
start s, positions before s attend causally from 0, positions from s on attend only to [s, i].

Same data, tokenizer (the saved one) and held-out split as ``train_demo``. The layer goes into
``model-mtp.safetensors`` beside ``model.safetensors`` (untouched), with ``model.safetensors.index.json``
naming both and ``num_nextn_predict_layers: 1`` in config.json; training.json gets an ``mtp`` record.

``--distill`` trains on the main model's own next distribution (soft cross-entropy against its logits at
i + 1) instead of the data's t_{i+2}: what a draft is accepted on is the main model's choice, not the text's.
Tried once (2026-12-06, same data, steps and rates, one thread, 7 minutes): held-out agreement with the main
argmax 54.9% -> 68.9%, greedy acceptance at depth 1 over 128 tokens of six code prompts 0.748 -> 0.838 (the
bench's prompt 0.636 -> 0.575); the shipped layer is the plain recipe's (docs/benchmarks-log.md, issue #40).

    python -m colibri_stream.devtools.train_demo_mtp [DST] [--steps N] [--threads T] [--max-minutes M] [--distill]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from colibri_stream.devtools.train_demo import (
    TrainOptions,
    encode_documents,
    lr_at,
    random_batch,
    read_texts,
    split_files,
    stdlib_files,
    training_command,
)

MTP_SHARD = "model-mtp.safetensors"
INDEX = "model.safetensors.index.json"
MTP_OPTIONS = TrainOptions(steps=600, lr=3e-3, warmup=50)  # the main run's rate: 3e-3 beat 1e-3 at 80 steps


class SharedHead(nn.Module):
    """``shared_head.norm``: the MTP layer's own final norm (the head itself is the main model's)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaRMSNorm

        self.norm = GlmMoeDsaRMSNorm(dim, eps)


class MTPLayer(nn.Module):
    """enorm, hnorm, eh_proj, the decoder block and shared_head.norm, in transformers' classes."""

    def __init__(self, config: Any):
        super().__init__()
        from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaDecoderLayer, GlmMoeDsaRMSNorm

        n, dim, eps = config.num_hidden_layers, config.hidden_size, config.rms_norm_eps
        block_config = copy.deepcopy(config)  # one more layer: a MoE block with its own indexer
        block_config.num_hidden_layers = n + 1
        block_config.mlp_layer_types = [*config.mlp_layer_types, "sparse"]
        block_config.indexer_types = [*config.indexer_types, "full"]
        self.enorm = GlmMoeDsaRMSNorm(dim, eps)
        self.hnorm = GlmMoeDsaRMSNorm(dim, eps)
        self.eh_proj = nn.Linear(2 * dim, dim, bias=False)
        self.block = GlmMoeDsaDecoderLayer(block_config, layer_idx=n)
        self.shared_head = SharedHead(dim, eps)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, rope: tuple, mask: torch.Tensor) -> torch.Tensor:
        """h_i, embed(t_{i+1}) [B, S, dim] -> shared_head.norm(x) [B, S, dim] (the head's input)."""
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        x, _ = self.block(x, attention_mask=mask, position_embeddings=rope, past_key_values=None)
        return self.shared_head.norm(x)

    def checkpoint_tensors(self, n_layers: int) -> dict[str, torch.Tensor]:
        """model.layers.N.* names as DeepSeek-V3/GLM-5 checkpoints (and save_pretrained) spell them: routed
        experts one by one; no embed/head copies (the engine uses the main model's)."""
        prefix = f"model.layers.{n_layers}."
        out = {}
        for name, t in self.state_dict().items():
            name, t = prefix + name.removeprefix("block."), t.detach()
            if name.endswith(".mlp.experts.gate_up_proj"):  # transformers' fused [E, 2I, dim]: gate rows first
                stem = name.removesuffix("gate_up_proj")
                for e, (gate, up) in enumerate(zip(*t.chunk(2, dim=1), strict=True)):
                    out[f"{stem}{e}.gate_proj.weight"], out[f"{stem}{e}.up_proj.weight"] = gate, up
            elif name.endswith(".mlp.experts.down_proj"):  # [E, dim, I]
                stem = name.removesuffix("down_proj")
                out |= {f"{stem}{e}.down_proj.weight": d for e, d in enumerate(t)}
            else:
                out[name] = t
        return out


def init_from_main(mtp: MTPLayer, main: Any) -> None:
    """The block from the last layer (the indexer from the last layer that has one), eh_proj = [I | I],
    shared_head.norm = the final norm, enorm/hnorm ones."""
    layers = main.model.layers
    state = {k: v for k, v in layers[-1].state_dict().items()}
    if not any(".indexer." in k for k in state):
        donor = next(layer for layer in reversed(layers) if layer.self_attn.indexer is not None)
        state |= {k: v for k, v in donor.state_dict().items() if ".indexer." in k}
    mtp.block.load_state_dict(state, strict=True)
    dim = mtp.eh_proj.weight.shape[0]
    with torch.no_grad():
        mtp.eh_proj.weight.copy_(torch.cat([torch.eye(dim), torch.eye(dim)], dim=1))
        mtp.shared_head.norm.weight.copy_(main.model.norm.weight)
        mtp.enorm.weight.fill_(1.0)
        mtp.hnorm.weight.fill_(1.0)


def mtp_mask(batch: int, seq_len: int, starts: torch.Tensor) -> torch.Tensor:
    """Additive [B, 1, S, S] mask: causal; query i >= starts[b] sees only keys in [starts[b], i]."""
    i = torch.arange(seq_len)
    allowed = i[None, :, None] >= i[None, None, :]  # [1, S(q), S(k)]
    s = starts[:, None, None]
    allowed = allowed & ((i[None, None, :] >= s) | (i[None, :, None] < s))
    mask = torch.zeros(batch, 1, seq_len, seq_len)
    return mask.masked_fill(~allowed[:, None], torch.finfo(torch.float32).min)


def mtp_logits(main: Any, mtp: MTPLayer, window: torch.Tensor, starts: torch.Tensor) -> tuple:
    """window [B, S + 2] -> (MTP logits [B, S, V] predicting window[:, 2:], main logits [B, S, V] predicting
    window[:, 1:S+1]). h_i is caught by a hook on the last decoder layer: the model's last_hidden_state
    (and its last output_hidden_states entry) is after the final norm."""
    caught: list[torch.Tensor] = []
    hook = main.model.layers[-1].register_forward_hook(lambda m, i, out: caught.append(out[0]))
    inputs = window[:, :-2]
    try:
        with torch.no_grad():
            normed = main.model(input_ids=inputs, use_cache=False).last_hidden_state
    finally:
        hook.remove()
    hidden = caught[0].detach()
    b, s = inputs.shape
    positions = torch.arange(s)[None].expand(b, s)
    rope = main.model.rotary_emb(hidden, position_ids=positions)
    with torch.no_grad():
        embedded = main.model.embed_tokens(window[:, 1:-1])
    x = mtp(hidden, embedded, rope, mtp_mask(b, s, starts))
    return main.lm_head(x), main.lm_head(normed).detach()


def mtp_loss(logits: torch.Tensor, main_logits: torch.Tensor, window: torch.Tensor, distill: bool) -> torch.Tensor:
    """Cross-entropy of the MTP logits [B, S, V] against the data's next-next tokens, or (``distill``) against
    the main model's own next distribution: its logits at i + 1 predict what the MTP's at i do."""
    if not distill:
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), window[:, 2:].flatten())
    target = torch.softmax(main_logits[:, 1:].float(), dim=-1)
    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), target.flatten(0, 1))


def train_mtp(
    main: Any,
    mtp: MTPLayer,
    ids: torch.Tensor,
    options: TrainOptions,
    log: Callable[[str], None] = print,
    max_seconds: float | None = None,
    distill: bool = False,
) -> dict[str, Any]:
    """AdamW on ``mtp_loss``, only the MTP layer's parameters (the indexer and the correction bias are
    no_grad/buffers in transformers and stay as initialised)."""
    gen = torch.Generator().manual_seed(options.seed)
    params = [p for p in mtp.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=options.lr, betas=(0.9, 0.95), weight_decay=options.weight_decay)
    main.eval()
    mtp.train()
    start, smooth, step = time.perf_counter(), None, 0
    for step in range(options.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, options)
        window = random_batch(ids, options.batch, options.seq_len + 1, gen)  # [B, S + 2]
        starts = torch.randint(0, options.seq_len, (options.batch,), generator=gen)
        logits, main_logits = mtp_logits(main, mtp, window, starts)
        loss = mtp_loss(logits, main_logits, window, distill)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        smooth = loss.item() if smooth is None else 0.95 * smooth + 0.05 * loss.item()
        elapsed = time.perf_counter() - start
        if step % 25 == 0 or step == options.steps - 1:
            tok_s = (step + 1) * options.batch * options.seq_len / elapsed
            rate = lr_at(step, options)
            log(f"step {step:5d}  mtp loss {smooth:.3f}  lr {rate:.2e}  {tok_s:.0f} tok/s  {elapsed:.0f}s")
        if max_seconds is not None and elapsed > max_seconds:
            log(f"stopping early at step {step}: {max_seconds:.0f}s budget spent")
            break
    mtp.eval()
    done = step + 1
    return {
        "steps_done": done,
        "tokens_seen": done * options.batch * options.seq_len,
        "seconds": round(time.perf_counter() - start, 1),
        "final_smoothed_loss": round(smooth or 0.0, 4),
        "loss": "soft cross-entropy against the main model's next distribution" if distill else "next-next token",
    }


def mtp_windows(ids: torch.Tensor, seq_len: int, n_tokens: int) -> list[torch.Tensor]:
    """Non-overlapping [seq_len + 2] windows (stride seq_len) over the first ``n_tokens`` positions."""
    n = min(n_tokens, len(ids) - 2) // seq_len
    return [ids[i * seq_len : (i + 1) * seq_len + 2] for i in range(n)]


@torch.no_grad()
def evaluate(main: Any, mtp: MTPLayer, windows: Sequence[torch.Tensor]) -> dict[str, Any]:
    """Held-out next-next-token loss/accuracy of the MTP layer (each window from position 0, full causal
    context), beside the main model's next-token accuracy on the same positions, and how often the draft
    at i is the main model's own argmax at i + 1 (a greedy draft's acceptance on real text)."""
    loss = correct = main_correct = agree = total = 0.0
    for w in windows:
        logits, main_logits = mtp_logits(main, mtp, w[None], torch.zeros(1, dtype=torch.long))
        loss += nn.functional.cross_entropy(logits[0].float(), w[2:], reduction="sum").item()
        correct += (logits[0].argmax(-1) == w[2:]).sum().item()
        main_correct += (main_logits[0].argmax(-1) == w[1:-1]).sum().item()
        agree += (logits[0, :-1].argmax(-1) == main_logits[0, 1:].argmax(-1)).sum().item()
        total += len(w) - 2
    return {
        "mtp_agrees_with_main_argmax": round(agree / (total - len(windows)), 4),
        "heldout_positions": int(total),
        "mtp_loss": round(loss / total, 4),
        "mtp_ppl": round(math.exp(loss / total), 3),
        "mtp_next_next_token_accuracy": round(correct / total, 4),
        "main_next_token_accuracy": round(main_correct / total, 4),
    }


def save_mtp(mtp: MTPLayer, dst: Path, n_layers: int) -> list[str]:
    """model-mtp.safetensors (bfloat16), the index naming both shards, num_nextn_predict_layers = 1."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in mtp.checkpoint_tensors(n_layers).items()}
    save_file(tensors, str(dst / MTP_SHARD), metadata={"format": "pt"})
    (dst / MTP_SHARD).chmod(0o644)  # save_file makes it private; it ships as package data
    with safe_open(dst / "model.safetensors", framework="pt") as f:
        weight_map = dict.fromkeys(f.keys(), "model.safetensors")  # noqa: SIM118 - not a mapping
    weight_map |= dict.fromkeys(tensors, MTP_SHARD)
    index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
    (dst / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    config = json.loads((dst / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return sorted(tensors)


def load_main(model_dir: Path) -> Any:  # transformers' model: untyped
    """The frozen main model, float32 (its weights are the bf16 checkpoint's), MTP tensors ignored."""
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    config = GlmMoeDsaConfig.from_pretrained(model_dir)
    main = GlmMoeDsaForCausalLM.from_pretrained(model_dir, config=config, dtype=torch.float32).eval()
    for p in main.parameters():
        p.requires_grad_(False)
    return main


def make_mtp(
    dst: str | Path, options: TrainOptions = MTP_OPTIONS, log: Callable[[str], None] = print, **kw: Any
) -> dict:
    """Train the MTP layer of the demo model in ``dst`` and write it there (see the module docstring)."""
    from tokenizers import Tokenizer

    dst = Path(dst)
    started = time.perf_counter()
    torch.manual_seed(options.seed)
    tokenizer = Tokenizer.from_file(str(dst / "tokenizer.json"))
    train_files, held_files = split_files(stdlib_files())
    train_ids = encode_documents(tokenizer, read_texts(train_files))
    windows = mtp_windows(encode_documents(tokenizer, read_texts(held_files)), options.seq_len, options.eval_tokens)
    main = load_main(dst)
    n_layers = main.config.num_hidden_layers
    torch.manual_seed(options.seed)
    mtp = MTPLayer(main.config).float()
    init_from_main(mtp, main)
    log(f"MTP layer: {sum(p.numel() for p in mtp.parameters())} parameters; {len(train_ids)} train tokens")
    before = evaluate(main, mtp, windows)
    log(f"held-out before training: {before}")
    run = train_mtp(main, mtp, train_ids, options, log, **kw)
    with torch.no_grad():  # score what the checkpoint holds: bfloat16 weights
        for p in mtp.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    after = evaluate(main, mtp, windows)
    log(f"held-out after training: {after}")
    names = save_mtp(mtp, dst, n_layers)
    record = {
        "options": dataclasses.asdict(options),
        "init": f"block = layer {n_layers - 1} (indexer of the last full layer), eh_proj = [I | I], "
        "shared_head.norm = final norm",
        "context": "random start per window: positions from it attend only from it (the engine's draft cache)",
        "parameters": sum(p.numel() for p in mtp.parameters()),
        "tensors": len(names),
        "training": run,
        "heldout_before": before,
        "heldout": after,
        "total_minutes": round((time.perf_counter() - started) / 60, 1),
    }
    meta_path = dst / "training.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    meta["mtp"] = record
    meta_path.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return record


def main() -> None:
    def distill_flag(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--distill", action="store_true", help="train on the main model's next distribution")

    run = training_command(__doc__, MTP_OPTIONS, distill_flag)
    print(json.dumps(make_mtp(run.dst, run.options, max_seconds=run.max_seconds, distill=run.args.distill), indent=1))


if __name__ == "__main__":
    main()
