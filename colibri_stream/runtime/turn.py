"""One model with its text side (``Runtime``), and the one turn every command runs (``run_turn``):
`run`, `demo`, `chat` and `serve` all generate through it and report the same stats schema.

A turn's KV goes through one door (runtime/kv/front.py): ``KVState.restore`` gives the cache holding the
longest reusable prefix of the prompt (the session's, else the shared prefix cache's), ``commit`` persists
the turn's positions. A session's log is open, and its lock held, only while the turn runs, so a session
is never open twice in one process; the session's own lock (runtime/kv/lock.py) keeps other processes out
for as long as the caller holds it (a chat: its whole run). After every turn the store persists its
usage history and flushes its routing trace.

The stats schema (README "Stats"): generation (prefill_tokens, decode_tokens, prefill_s, decode_s,
ttft_s, decode_tok_per_s, wall_s), session (reused_tokens, kv_load_s), experts over the turn
(expert_requests, hits {ram, vram}, hit_rate, misses, reads, expert_bytes_read, io_wait_s,
io_service_s, prefetch {issued, useful, wasted}, prefetch_recall, store, direct_io, page_cache_bypass),
decode_phase (the same expert counters from the first token on, plus disk_read_bytes: null where the OS does
not count it), memory (peak_rss_bytes, peak_uss_bytes).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from colibri_stream.checkpoint.fingerprint import model_fingerprint
from colibri_stream.errors import ColibriError, RequestError, TokenizerError
from colibri_stream.experts.cluster.group import ClusterOptions
from colibri_stream.experts.store import ExpertStore
from colibri_stream.planning.budget import StoreOptions, planned_context
from colibri_stream.runtime.batching import ContinuousBatch, GenerationRequest, GenerationResult, GenerationStats
from colibri_stream.runtime.constraint import TokenConstraint
from colibri_stream.runtime.kv.front import (
    KVState,
    Persistence,
    PrefixCache,
    RestoredPrefix,
    SessionPool,
    default_kv_dir,
)
from colibri_stream.runtime.loader import LoadedModel, load
from colibri_stream.runtime.memory import (
    PeakWatch,
    SharedPeakSampler,
    disk_read_bytes,
    disk_reads_counted,
    peak_rss_bytes,
)
from colibri_stream.runtime.mtp_governor import MTPOptions
from colibri_stream.runtime.sampling import SamplingParams
from colibri_stream.runtime.speculation import Speculation
from colibri_stream.text.chat_format import ChatFormat, PromptEncoder, load_chat_format, load_tokenizer
from engine.core.interfaces import Cache
from engine.kernels.read_ahead import stop_read_ahead
from storage.files.safe_read import check_output_dir
from storage.kv.prefix_store import PrefixConfig
from storage.tiers.stats import StoreStats


@dataclass(frozen=True)
class RuntimeOptions:
    dtype: str = "float32"  # compute dtype: float32 (token-exact) or bfloat16
    activations: str = "float32"  # int8: quantised matmul inputs (engine/kernels/q8.py; lossy, opt-in); int8-tiles
    store: StoreOptions = field(default_factory=StoreOptions)
    kv_dir: str | Path | None = None  # default: the user cache, per model fingerprint
    kv_dtype: str = "float32"  # KV log record dtype
    model_id: str | None = None  # the name clients send (default: the directory's name)
    text: bool = True  # load tokenizer.json and the chat template (False: token ids only)
    cluster: ClusterOptions = field(default_factory=ClusterOptions)  # routed experts held by worker processes
    prefix: PrefixConfig = field(default_factory=PrefixConfig)  # the shared prefix cache (runtime/kv/prefix_cache.py)
    mtp: MTPOptions = field(default_factory=MTPOptions)  # drafting with the model's MTP module, if it has one


@dataclass
class Runtime:
    """A loaded model, its tokenizer and chat format (when loaded) and where its sessions live."""

    loaded: LoadedModel
    tokenizer: Tokenizer | None
    chat: ChatFormat | None
    kv: Persistence  # its sessions' logs and the prefix cache shared by every turn
    model_id: str = "model"
    context: int | None = None  # positions a turn may fill (budget.planned_context; None: the model's)
    speculation: Speculation | None = None  # decode drafts with the model's MTP module (runtime/speculation.py)

    @property
    def kv_dir(self) -> Path:
        return self.kv.kv_dir

    @property
    def fingerprint(self) -> str:
        return self.kv.fingerprint

    @property
    def prefix(self) -> PrefixCache | None:
        return self.kv.prefix

    @property
    def context_size(self) -> int:
        """Positions a turn may fill, prompt and answer: what KV and activations were sized for."""
        return self.loaded.args.max_position_embeddings if self.context is None else self.context

    @property
    def context_source(self) -> str:
        """Where ``context_size`` comes from, as the refusals name it."""
        return (
            "max_position_embeddings" if self.context_size == self.loaded.args.max_position_embeddings else "--context"
        )

    @property
    def vocab_size(self) -> int:
        return self.loaded.args.vocab_size

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return tuple(self.chat.stop_ids) if self.chat is not None else ()

    def text_side(self) -> tuple[Tokenizer, ChatFormat]:
        if self.tokenizer is None or self.chat is None:
            raise TokenizerError(f"{self.loaded.path}: loaded without its tokenizer (token ids only)")
        return self.tokenizer, self.chat

    @cached_property
    def prompt_encoder(self) -> PromptEncoder:
        return PromptEncoder(self.text_side()[0])

    def encode(self, text: str) -> list[int]:
        """Special tokens written in the text (the template's <bos>, <|im_start|>, ...) become their ids."""
        return self.prompt_encoder.encode(text)

    def encode_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """The conversation through the chat template; special-token strings inside message content are
        encoded as text, never as their ids (a user cannot type the eos token)."""
        return self.prompt_encoder.encode_chat(self.text_side()[1], messages, add_generation_prompt)

    def close(self) -> None:
        self.loaded.experts.close()
        stop_read_ahead()  # the helper's last request may name this model's arrays


def load_runtime(path: str | Path, options: RuntimeOptions | None = None) -> Runtime:
    """The model at ``path`` (container or HF directory) with its text side and session directory."""
    options = options or RuntimeOptions()
    if options.kv_dir:  # a file there is refused before the (slow) load, not at the first turn
        check_output_dir(options.kv_dir, "--kv-dir")
    tokenizer = load_tokenizer(path) if options.text else None
    chat = load_chat_format(path) if options.text else None
    beside = options.prefix.ram_bytes if options.prefix.enabled else 0  # `auto` RAM leaves it room
    store = dataclasses.replace(options.store, beside_store_bytes=beside)
    loaded = load(path, options.dtype, store, options.activations, options.cluster)
    fingerprint = model_fingerprint(path)
    kv_dir = Path(options.kv_dir) if options.kv_dir else default_kv_dir(fingerprint)
    check_output_dir(kv_dir, "the session directory")
    model_id = options.model_id or Path(path).resolve().name
    model = loaded.model
    # what stored values depend on, with the dtype (a prompt's tile GEMMs sum in another order: kept apart)
    activations = "int8-tiles" if model.prompt_tiles else "int8" if model.int8_activations else "float32"
    kv = Persistence.of(
        kv_dir, fingerprint, loaded.args, model.new_cache, model.dtype, options.kv_dtype, activations, options.prefix
    )
    context = planned_context(options.store, loaded.args)  # refused beyond max_position_embeddings
    speculation = speculation_for(loaded, options.mtp)
    return Runtime(loaded, tokenizer, chat, kv, model_id, context, speculation)


def speculation_for(loaded: LoadedModel, options: MTPOptions) -> Speculation | None:
    """Drafting for a model with an MTP module, unless ``options`` turn it off; ``on`` for a model without
    one is refused (the user asked for something that cannot happen)."""
    drafter = loaded.drafter
    if drafter is None:
        if options.mode == "on":
            raise ColibriError(f"{loaded.path}: --mtp on, but the model has no multi-token-prediction module loaded")
        return None
    return None if options.mode == "off" else Speculation(drafter, options, loaded.experts.snapshot)


@dataclass(frozen=True)
class TurnOptions:
    max_new_tokens: int = 32
    sampling: SamplingParams = field(default_factory=SamplingParams)
    session: str | None = None  # continue (or start) this named conversation
    reset: bool = False  # forget the session's stored positions first
    stop_ids: tuple[int, ...] = ()  # e.g. Runtime.stop_ids for chat; run generates max_new_tokens
    sync_every: int = 0  # also persist the session every N generated tokens (0: at the end only)
    on_token: Callable[[int], None] | None = None  # sees each generated id as it is sampled
    should_stop: Callable[[], bool] | None = None  # polled after each token: a client gone, Ctrl-C
    logprobs: int | None = None  # record each generated token's logprob, with this many alternatives
    # also every prompt token's (GenerationRequest.prompt_logprobs): the whole prompt must be computed,
    # so no stored or cached prefix may be reused for such a turn
    prompt_logprobs: int | None = None
    constraint: TokenConstraint | None = None  # what the answer may be (runtime/constraint.py); one turn's own
    tenant: str | None = None  # whose prefix-cache blocks the turn sees (serve: derived from the API key)


@dataclass
class TurnResult:
    ids: list[int]
    finish_reason: str  # "stop" (a stop id), "length" (max tokens) or "cancelled"
    prompt_tokens: int
    stats: dict[str, Any] = field(default_factory=dict)


def check_prompt(runtime: Runtime, prompt_ids: list[int]) -> None:
    if not prompt_ids:
        raise RequestError("the prompt is empty (0 tokens)")
    if bad := [i for i in prompt_ids if not 0 <= i < runtime.vocab_size]:
        raise RequestError(f"prompt ids {bad[:5]} are outside the vocabulary (size {runtime.vocab_size})")
    if len(prompt_ids) >= runtime.context_size:
        raise RequestError(
            f"the prompt has {len(prompt_ids)} tokens; the context is {runtime.context_size} tokens "
            f"({runtime.context_source}) and an answer needs at least one more"
        )


def fit_to_context(runtime: Runtime, prompt_tokens: int, max_new_tokens: int) -> int:
    """``max_new_tokens`` cut so prompt + answer fit the context (--context: what the KV and activations
    were sized for; without it max_position_embeddings, past which positions were never trained: the
    model would run on, silently wrong)."""
    return max(0, min(max_new_tokens, runtime.context_size - prompt_tokens))


USS_SAMPLER = SharedPeakSampler()  # every turn's peak USS, one sampling thread however many turns overlap


@dataclass
class OpenTurn:
    """A turn between ``begin_turn`` and ``finish_turn``/``abort_turn``: its KV state (the session, locked),
    the restored prefix (its cache is the request's), the store's counters at its start and its generation
    request."""

    runtime: Runtime
    prompt_ids: list[int]
    kv: KVState  # its session (locked), if any
    restored: RestoredPrefix
    recorder: PhaseRecorder
    request: GenerationRequest
    uss: PeakWatch
    started: float = field(default_factory=time.perf_counter)


def begin_turn(
    runtime: Runtime, prompt_ids: list[int], options: TurnOptions, pool: SessionPool | None = None
) -> OpenTurn:
    """Check the prompt, open (or take from ``pool``) the session and restore the longest reusable prefix;
    the returned turn's ``request`` is ready for a ContinuousBatch."""
    check_prompt(runtime, prompt_ids)
    # prompt logprobs: every position of a turn without a session is computed
    reuse = options.session is not None or options.prompt_logprobs is None
    kv = runtime.kv.open(options.session, options.reset, pool, reuse_prefix=reuse, tenant=options.tenant)
    try:
        restored = kv.restore(prompt_ids)
        cache = restored.cache
        recorder = PhaseRecorder(runtime.loaded.experts)
        request = GenerationRequest(
            prompt_ids,
            fit_to_context(runtime, len(prompt_ids), options.max_new_tokens),
            options.sampling,
            options.stop_ids,
            cache,
            recorder.wrap(with_periodic_sync(options, kv, cache, prompt_ids)),
            options.should_stop,
            kv.prompt_chunk_hook(cache, prompt_ids),
            logprobs=options.logprobs,
            prompt_logprobs=options.prompt_logprobs,
            constraint=options.constraint,
        )
    except BaseException:
        kv.abort()
        raise
    return OpenTurn(runtime, prompt_ids, kv, restored, recorder, request, USS_SAMPLER.watch())


def finish_turn(turn: OpenTurn, result: GenerationResult, pool: SessionPool | None = None) -> TurnResult:
    """Commit the turn's positions (blocks to the prefix cache, the session's log appended and fsynced, the
    session kept in its pool or closed) and report the stats schema."""
    wall = time.perf_counter() - turn.started
    turn.uss.stop()
    try:
        turn.kv.commit(turn.restored.cache, turn.prompt_ids + result.ids, pool, prompt=len(turn.prompt_ids))
    finally:
        turn.runtime.loaded.experts.end_turn()  # a failed turn's routings and trace are kept too
    stats = turn_stats(result, turn.restored, wall, turn.recorder.report(), turn.uss.peak)
    if turn.runtime.speculation is not None:
        stats["mtp"] = mtp_stats(result.stats, turn.runtime.speculation)
    return TurnResult(result.ids, finish_reason(result), len(turn.prompt_ids), stats)


def abort_turn(turn: OpenTurn) -> None:
    """A turn whose generation failed: nothing of it is persisted (its cache may be half-appended)."""
    turn.uss.stop()
    turn.kv.abort()
    turn.runtime.loaded.experts.end_turn()


def run_turn(runtime: Runtime, prompt_ids: list[int], options: TurnOptions | None = None) -> TurnResult:
    """Generate one answer to ``prompt_ids``, continuing ``options.session``'s stored KV when given."""
    turn = begin_turn(runtime, prompt_ids, options or TurnOptions())
    model, store = runtime.loaded.model, runtime.loaded.experts
    batch = ContinuousBatch(model, store, speculation=runtime.speculation)
    generation = batch.add(turn.request)
    try:
        while batch:
            batch.step()
        if generation.error is not None:
            raise generation.error
    except BaseException:
        abort_turn(turn)
        raise
    return finish_turn(turn, generation.result)


def finish_reason(result: GenerationResult) -> str:
    return "stop" if result.stopped_on is not None else "cancelled" if result.cancelled else "length"


def turn_stats(
    result: GenerationResult, restored: RestoredPrefix, wall: float, experts: dict[str, Any], peak_uss: int
) -> dict[str, Any]:
    """The stats schema, key by key as documented above and in the README."""
    return {
        **result.stats.as_dict(),
        "wall_s": round(wall, 6),
        "reused_tokens": restored.reused_tokens,
        "prompt_sources": restored.sources(result.stats.prefill_tokens),
        "kv_load_s": round(restored.kv_load_s, 6),
        **experts,
        "peak_rss_bytes": peak_rss_bytes(),
        "peak_uss_bytes": peak_uss,
    }


def mtp_stats(stats: GenerationStats, speculation: Speculation) -> dict[str, Any]:
    """The stats' ``mtp`` object: this turn's drafts, and the governor's state (since the model loaded)."""
    return {
        **speculation.governor.report(),
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "acceptance_rate": round(stats.accepted / stats.drafted, 4) if stats.drafted else None,
        "tokens_per_step": round(stats.decode_tokens / stats.decode_steps, 4) if stats.decode_steps else None,
    }


class PhaseRecorder:
    """The store's counters over one turn, and over its decode phase: a copy is taken when the first
    token arrives, so everything after it is decode (hit rates and bytes per token without the
    prompt's reads)."""

    def __init__(self, store: ExpertStore):
        self.store = store
        self.at_start = store.snapshot()
        self.at_first_token: tuple[StoreStats, int | None] | None = None

    def wrap(self, on_token: Callable[[int], None] | None) -> Callable[[int], None]:
        def first_token_aware(token: int) -> None:
            if self.at_first_token is None:
                self.at_first_token = (self.store.snapshot(), disk_read_bytes() if disk_reads_counted() else None)
            if on_token is not None:
                on_token(token)

        return first_token_aware

    def report(self) -> dict[str, Any]:
        now = self.store.snapshot()
        turn = now.minus(self.at_start)
        hits = turn.hits_ram + turn.hits_vram
        report = {
            **self.store.report(),
            **turn.as_dict(),
            "hit_rate": round(hits / turn.requests, 4) if turn.requests else None,
        }
        if self.at_first_token is not None:
            then, disk_then = self.at_first_token
            read = None if disk_then is None else disk_read_bytes() - disk_then  # None: the OS does not count it
            report["decode_phase"] = {**now.minus(then).as_dict(), "disk_read_bytes": read}
        return report


def with_periodic_sync(
    options: TurnOptions, kv: KVState, cache: Cache, prompt_ids: list[int]
) -> Callable[[int], None] | None:
    """The per-token callback: the caller's, and every ``sync_every`` tokens the session persisted so far."""
    if kv.session is None or options.sync_every <= 0:
        return options.on_token
    generated: list[int] = []

    def on_token(token: int) -> None:
        generated.append(token)
        if options.on_token is not None:
            options.on_token(token)
        if len(generated) % options.sync_every == 0:
            kv.sync(cache, prompt_ids + generated)  # positions computed so far; fsynced

    return on_token
