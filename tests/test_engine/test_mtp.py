"""Multi-token prediction: MTP layers load, drafts are verified so that decoding with them gives plain
decoding's tokens (greedy: bit for bit, on every family that has MTP, resident, streamed under a small
budget, int8 activations, batched), and the verify rows hold the bits of their own decode steps."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from colibri_stream.convert.converter import Converter, ConvertOptions
from colibri_stream.devtools.mtp_fixture import add_mtp_layer, add_v4_mtp_module
from colibri_stream.devtools.steps import decode_one_token, prefill
from colibri_stream.planning.budget import StoreOptions
from colibri_stream.runtime.batching import ContinuousBatch, GenerationRequest
from colibri_stream.runtime.loader import load, load_checkpoint
from colibri_stream.runtime.mtp_governor import MTPOptions
from colibri_stream.runtime.sampling import SamplingParams
from colibri_stream.runtime.speculation import CATCH_UP_PAIRS, Speculation

# DeepSeek-V3/R1, V3.2, GLM-5 ship one MTP layer, DeepSeek-V4 its mtp.0 module
MTP_FAMILIES = ["deepseek_v3", "deepseek_v32", "glm_moe_dsa", "deepseek_v4"]
PROMPTS = [[1, 5, 9, 3, 7, 2, 11, 4, 6, 8, 10, 12, 13], [4, 4, 2], [7]]
TOKENS = 24


@pytest.fixture(scope="module")
def mtp_checkpoints(tiny_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    built = {}
    for family in MTP_FAMILIES:
        built[family] = shutil.copytree(tiny_checkpoints[family], root / family)
        (add_v4_mtp_module if family == "deepseek_v4" else add_mtp_layer)(built[family], seed=3)
    return built


@pytest.fixture(scope="module", params=MTP_FAMILIES)
def mtp_family(request):
    return request.param


@pytest.fixture(scope="module")
def mtp_loaded(mtp_checkpoints, mtp_family):
    return load_checkpoint(mtp_checkpoints[mtp_family])


def generate_all(loaded, prompts, speculation=None, sampling=None, tokens=TOKENS, drafter_model=None):
    """Every prompt in one batch (each computed as alone): ids per prompt, and the generations."""
    batch = ContinuousBatch(loaded.model, loaded.experts, speculation=speculation)
    gens = [batch.add(GenerationRequest(p, tokens, sampling or SamplingParams())) for p in prompts]
    while batch:
        batch.step()
    for g in gens:
        assert g.error is None, g.error
    return [g.result.ids for g in gens], gens


def test_the_mtp_layer_loads_and_leaves_the_main_model_alone(mtp_loaded, tiny_checkpoints, mtp_family):
    args = mtp_loaded.args
    assert len(mtp_loaded.model.mtp) == 1 and args.mtp_layers == (args.n_layers,)
    assert args.moe_layers[-1] == args.n_layers  # the MTP block's experts are streamed like any layer's
    assert mtp_loaded.experts.routed.table()[-1] == [0] * args.n_routed_experts  # counted, none used yet
    plain = load_checkpoint(tiny_checkpoints[mtp_family])
    assert len(plain.model.mtp) == 0
    for prompt in PROMPTS:
        a = prefill(mtp_loaded.model, prompt, mtp_loaded.model.new_cache(), mtp_loaded.experts)
        b = prefill(plain.model, prompt, plain.model.new_cache(), plain.experts)
        assert torch.equal(a, b)


@pytest.mark.parametrize("depth", [1, 3])
def test_forced_drafts_give_the_plain_greedy_tokens(mtp_loaded, depth):
    plain, _ = generate_all(mtp_loaded, PROMPTS)
    speculation = Speculation(mtp_loaded.drafter, MTPOptions("on", depth))
    drafted, gens = generate_all(mtp_loaded, PROMPTS, speculation)
    assert drafted == plain
    report = speculation.governor.report()
    assert report["drafted"] > 0 and report["on_share"] > 0.5
    for g, prompt in zip(gens, PROMPTS, strict=True):
        assert g.cache.length == len(prompt) + len(g.result.ids) - 1  # the rejected rows were trimmed


class ProphetDrafter:
    """The real model verifying, drafts read from the known greedy continuation with every third one
    wrong: the accept, reject and finish paths all run, with real forward passes."""

    def __init__(self, loaded, prompt, continuation):
        self.model, self.known, self.calls = loaded.model, list(prompt) + continuation, 0

    def forward_rows_hidden(self, tokens, caches, experts):
        return self.model.forward_rows_hidden(tokens, caches, experts)

    def new_draft_cache(self):
        return self.model.new_draft_cache()

    def draft(self, hidden, tokens, position, cache, experts, depth):
        after = position + len(tokens) + 1  # the position of the first drafted token
        self.calls += 1
        truth = self.known[after : after + depth]
        return [(t + 1) % 50 if (i + self.calls) % 3 == 0 else t for i, t in enumerate(truth)] + [0] * (
            depth - len(truth)
        )


@pytest.mark.parametrize("depth", [2, 4])
def test_accepted_drafts_keep_tokens_and_cache_exact(mtp_loaded, depth):
    prompt = PROMPTS[0]
    (plain,), _ = generate_all(mtp_loaded, [prompt], tokens=TOKENS + 6)
    _, (plain_gen,) = generate_all(mtp_loaded, [prompt], tokens=TOKENS)  # (a V4 cache cannot be trimmed far back)
    prophet = ProphetDrafter(mtp_loaded, prompt, plain)
    speculation = Speculation(prophet, MTPOptions("on", depth))  # type: ignore[arg-type]
    (ids,), (gen,) = generate_all(mtp_loaded, [prompt], speculation, tokens=TOKENS)
    assert ids == plain[:TOKENS]
    stats = gen.result.stats
    assert stats.accepted > 0 and stats.decode_steps < TOKENS - 1  # several tokens per step
    assert stats.accepted < stats.drafted  # and rejections too
    # the cache holds the bits plain decoding wrote: the next step's logits are identical
    assert gen.cache.length == len(prompt) + TOKENS - 1
    assert plain_gen.cache.length == gen.cache.length
    a = decode_one_token(mtp_loaded.model, ids[-1], gen.cache, mtp_loaded.experts)
    b = decode_one_token(mtp_loaded.model, ids[-1], plain_gen.cache, mtp_loaded.experts)
    assert torch.equal(a, b)


def test_verify_rows_hold_their_decode_steps_bits(mtp_loaded):
    """Rows on one cache (a verify step) give each position the logits its own decode step gives."""
    model, experts = mtp_loaded.model, mtp_loaded.experts
    prompt, steps = PROMPTS[0], [5, 8, 13, 2]
    solo_cache = model.new_cache()
    prefill(model, prompt, solo_cache, experts)
    solo = [decode_one_token(model, t, solo_cache, experts) for t in steps]
    cache = model.new_cache()
    prefill(model, prompt, cache, experts)
    logits, hidden = model.forward_rows_hidden(steps, [cache] * len(steps), experts)
    v4 = mtp_loaded.args.v4
    streams = () if v4 is None else (v4.hc_mult,)  # DeepSeek-V4 drafts from its hyper-connection streams
    assert hidden.shape == (len(steps), *streams, mtp_loaded.args.dim)
    for a, b in zip(solo, logits, strict=True):
        assert torch.equal(a, b)


def test_drafted_batches_give_each_request_its_solo_tokens(mtp_loaded):
    solo = [generate_all(mtp_loaded, [p])[0][0] for p in PROMPTS]
    speculation = Speculation(mtp_loaded.drafter, MTPOptions("on", 2))
    together, _ = generate_all(mtp_loaded, PROMPTS, speculation)
    assert together == solo


def test_plain_steps_keep_each_position_s_pair_for_the_next_draft(mtp_loaded, monkeypatch):
    """Steps the governor runs plain keep (h_i, t_{i+1}) of each new position, the latest CATCH_UP_PAIRS of
    them, as a drafting step's rows would: the hidden state the step computed, at its own position."""
    returned = []
    forward = mtp_loaded.model.forward_rows_hidden

    def recording(tokens, caches, experts):
        logits, hidden = forward(tokens, caches, experts)
        returned.append(hidden.clone())
        return logits, hidden

    monkeypatch.setattr(mtp_loaded.model, "forward_rows_hidden", recording)
    speculation = Speculation(mtp_loaded.drafter, MTPOptions("auto", 1))
    batch = ContinuousBatch(mtp_loaded.model, mtp_loaded.experts, speculation=speculation)
    prompts = PROMPTS[:2]
    gens = [batch.add(GenerationRequest(p, 20)) for p in prompts]
    batch.step()  # both prompts
    steps = CATCH_UP_PAIRS + 3  # below PROBE_EVERY: the governor's first steps are plain
    for _ in range(steps):
        batch.step()
    assert speculation.governor.drafting_steps == 0 and len(returned) == steps
    for row, (prompt, g) in enumerate(zip(prompts, gens, strict=True)):
        state = g.drafting
        assert state.first == len(prompt) + steps - CATCH_UP_PAIRS
        assert state.first + len(state.hidden) == g.cache.length  # up to the newest position fed
        assert state.tokens == g.result.ids[steps - CATCH_UP_PAIRS + 1 : steps + 1]
        for kept, step_hidden in zip(state.hidden, returned[-CATCH_UP_PAIRS:], strict=True):
            assert torch.equal(kept, step_hidden[row])


@pytest.fixture(scope="module")
def mtp_container(mtp_checkpoints, tmp_path_factory):
    dst = tmp_path_factory.mktemp("mtp-container") / "glm"
    Converter(mtp_checkpoints["glm_moe_dsa"], dst, ConvertOptions(experts="int4", dense="int8"), progress=False).run()
    return dst


@pytest.fixture(scope="module")
def mtp_bf16_container(mtp_checkpoints, tmp_path_factory):
    """bf16 dense records: the default container, whose resident decode steps run the float32 path in C."""
    dst = tmp_path_factory.mktemp("mtp-bf16-container") / "glm"
    Converter(mtp_checkpoints["glm_moe_dsa"], dst, ConvertOptions(experts="int4", dense="bf16"), progress=False).run()
    return dst


@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_streamed_under_a_small_budget_drafts_change_no_token(mtp_container, activations):
    resident = load(mtp_container, activations=activations)
    assert len(resident.model.mtp) == 1
    plain, _ = generate_all(resident, PROMPTS)
    streamed = load(mtp_container, store=StoreOptions(ram="30%"), activations=activations)
    for mode in ("on", "auto"):
        speculation = Speculation(streamed.drafter, MTPOptions(mode, 3), streamed.experts.snapshot)
        ids, _ = generate_all(streamed, PROMPTS, speculation)
        assert ids == plain, mode
    assert streamed.experts.snapshot().misses > 0  # the budget streamed: the MTP block's experts too


@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_resident_experts_draft_in_the_one_call_step(mtp_container, mtp_bf16_container, monkeypatch, activations):
    """Every expert resident, on the exact path (bf16 dense, float32 x) and with int8 activations: the
    verify steps and the MTP block's drafts run as one C call each (the block as its own one-layer step,
    its experts those of layer n_layers; several pairs as rows of one call), a one-pair draft is the
    module path's bit for bit, and the tokens are plain decoding's."""
    from engine.mla import fused_decode

    loaded = load(mtp_bf16_container if activations == "float32" else mtp_container, activations=activations)
    model, experts = loaded.model, loaded.experts
    plain, _ = generate_all(loaded, PROMPTS)
    steps: list[list[int]] = []
    real_step = fused_decode.FusedDecode.step

    def counted(self, *args):
        steps.append(self.layer_ids)
        return real_step(self, *args)

    monkeypatch.setattr(fused_decode.FusedDecode, "step", counted)
    speculation = Speculation(loaded.drafter, MTPOptions("on", 3), experts.snapshot)
    assert generate_all(loaded, PROMPTS, speculation)[0] == plain
    mtp_layer = model.args.n_layers
    assert [mtp_layer] in steps and list(range(mtp_layer)) in steps
    cache = model.new_cache()
    prefill(model, PROMPTS[0], cache, experts)
    hidden = torch.randn(1, model.args.dim, generator=torch.Generator().manual_seed(5))
    before = len(steps)
    fused = model.draft(hidden, [7], cache.length, model.new_draft_cache(), experts, 3)
    assert steps[before:] == [[mtp_layer]] * 3  # the pair, then each draft re-applied
    with fused_decode.module_path():
        assert model.draft(hidden, [7], cache.length, model.new_draft_cache(), experts, 3) == fused
    pairs = torch.randn(3, model.args.dim, generator=torch.Generator().manual_seed(6))
    before = len(steps)
    model.draft(pairs, [7, 8, 9], cache.length, model.new_draft_cache(), experts, 2)
    assert steps[before:] == [[mtp_layer]] * 2  # three pairs in one call, then the draft re-applied


def test_sampling_with_drafts_keeps_the_distribution(mtp_loaded):
    """The rejection rule at temperature 0.7, top-p 0.9 on the tiny model's logits, a fixed draft: over
    many seeds the chosen token's frequencies match the model's own distribution (a chi-square test over
    its likeliest tokens)."""
    from colibri_stream.runtime.sampling import distribution, sample_against

    model, experts = mtp_loaded.model, mtp_loaded.experts
    params = SamplingParams(temperature=0.7, top_p=0.9)
    cache = model.new_cache()
    logits = prefill(model, PROMPTS[0], cache, experts)
    probs = distribution(logits, params)
    probs = probs / probs.sum()  # top-p leaves weights summing to the kept mass
    draft = int(probs.argsort(descending=True)[1])  # a plausible but not the likeliest token
    draws = 4000
    counts = torch.zeros_like(probs)
    for seed in range(draws):
        counts[sample_against(logits, params, torch.Generator().manual_seed(seed), draft)] += 1
    top = probs.argsort(descending=True)[:6]
    expected = torch.cat([probs[top], (1 - probs[top].sum()).clamp(min=0)[None]]) * draws
    observed = torch.cat([counts[top], (draws - counts[top].sum())[None]])
    keep = expected > 5
    chi2 = float((((observed - expected) ** 2)[keep] / expected[keep]).sum())
    assert chi2 < 22.5, (chi2, observed, expected)  # p ~ 0.001 at 6 degrees of freedom


def test_mtp_on_without_a_module_is_refused(tiny_checkpoints):
    from colibri_stream.errors import ColibriError
    from colibri_stream.runtime.turn import speculation_for

    plain = load_checkpoint(tiny_checkpoints["deepseek_v3"])
    assert speculation_for(plain, MTPOptions("auto")) is None
    with pytest.raises(ColibriError, match="no multi-token-prediction module"):
        speculation_for(plain, MTPOptions("on"))


def test_a_drafting_turn_logs_its_session_as_plain_decoding_does(mtp_checkpoints, tmp_path):
    """Sessions synced after every token while whole drafts are accepted: the log holds the records of
    plain decoding, a restarted runtime resumes from it, and a stop id inside an accepted run ends there."""
    from colibri_stream.runtime.turn import RuntimeOptions, TurnOptions, load_runtime, run_turn

    path, prompt = mtp_checkpoints["deepseek_v3"], PROMPTS[0]

    def runtime(kv: str, mode: str):
        return load_runtime(path, RuntimeOptions(text=False, kv_dir=tmp_path / kv, mtp=MTPOptions(mode, 3)))

    plain_rt = runtime("plain", "off")
    assert plain_rt.speculation is None
    plain = run_turn(plain_rt, prompt, TurnOptions(max_new_tokens=TOKENS + 8, session="s", sync_every=1)).ids
    drafting = runtime("mtp", "on")
    prophet = ProphetDrafter(drafting.loaded, prompt, plain)
    drafting.speculation = Speculation(prophet, MTPOptions("on", 3))  # type: ignore[arg-type]
    first = run_turn(drafting, prompt, TurnOptions(max_new_tokens=TOKENS, session="s", sync_every=1))
    assert first.ids == plain[:TOKENS]
    assert first.stats["mtp"]["accepted"] > 0 and first.stats["mtp"]["tokens_per_step"] > 1
    stop = plain[TOKENS + 3]
    follow = prompt + first.ids + [3, 1]
    restarted = runtime("mtp", "on")  # the session's log, read back
    restarted.speculation = Speculation(ProphetDrafter(restarted.loaded, follow, []), MTPOptions("on", 3))  # type: ignore[arg-type]
    again = run_turn(restarted, follow, TurnOptions(max_new_tokens=12, session="s", stop_ids=(stop,), sync_every=1))
    plain_rt = runtime("ref", "off")
    run_turn(plain_rt, prompt, TurnOptions(max_new_tokens=TOKENS, session="s", sync_every=1))
    reference = run_turn(runtime("ref", "off"), follow, TurnOptions(max_new_tokens=12, session="s", stop_ids=(stop,)))
    assert again.stats["reused_tokens"] == reference.stats["reused_tokens"] >= len(prompt) + TOKENS - 1
    assert again.ids == reference.ids and again.finish_reason == reference.finish_reason


def test_run_cli_drafts_reports_mtp_and_refuses_on_without_a_module(mtp_container, tiny_checkpoints, capsys):
    from colibri_stream import cli

    argv = ["run", str(mtp_container), "--ids", "5,6,7", "--max-new-tokens", "12", "--ram", "60%", "--json"]
    outputs = {}
    for mode in ("off", "on"):
        assert cli.main([*argv, "--mtp", mode, "--mtp-depth", "3", "--no-prefix-cache"]) == 0
        outputs[mode] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert outputs["on"]["ids"] == outputs["off"]["ids"]
    assert "mtp" not in outputs["off"]["stats"]
    mtp = outputs["on"]["stats"]["mtp"]
    assert mtp["mode"] == "on" and mtp["max_depth"] == 3 and mtp["drafted"] > 0 and mtp["on_share"] > 0.5
    plain = ["run", str(tiny_checkpoints["deepseek_v3"]), "--ids", "5,6", "--max-new-tokens", "2", "--mtp", "on"]
    assert cli.main(plain) != 0
    assert "no multi-token-prediction module" in capsys.readouterr().err
