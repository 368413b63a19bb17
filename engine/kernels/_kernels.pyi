"""Types of the C extension engine.kernels._kernels (engine/csrc/kernels.c and py_decode.c).

Every pointer argument is the address of a contiguous buffer (``tensor.data_ptr()``); the functions
write their results into the buffers they are given and return None.
"""

from collections.abc import Sequence
from typing import NewType

MAX_ROWS: int
ABI_VERSION: int
BF16_SIMD: int
Q8_VNNI: int
Q8_TILES_FAST: int
Q8_AMX: int
SIMD_LEVEL: int
ISA_CAP: int
ARM_FEATURES: int  # aarch64: bit 0 dot-product, bit 1 i8mm (as the CPU reports them); 0 elsewhere

# mla_weights' result: a capsule holding a layer's MLA weights for mla_project and mla_output
MlaWeights = NewType("MlaWeights", object)
# one matrix for q8_mlp and mla_weights: (w, scales, kind, scale_kind, in, group, interleaved)
Matrix = tuple[int, int, int, int, int, int, int]

def rms_norm(x: int, rows: int, dim: int, w: int, eps: float, out: int, /) -> None: ...
def route(
    x: int,
    rows: int,
    weight: int,
    bias: int,
    experts: int,
    dim: int,
    score: int,
    groups: int,
    topk_groups: int,
    topk: int,
    normalise: bool,
    scale: float,
    ids: int,
    weights: int,
    ld: int,
    /,
) -> None: ...
def attend_one(
    q_nope: int,
    q_rope: int,
    latents: int,
    rope_keys: int,
    positions: int,
    total: int,
    heads: int,
    nope: int,
    rope: int,
    value: int,
    rank: int,
    softmax_scale: float,
    kv_b: int,
    kv_b_scales: int,
    group: int,
    out: int,
    threads: int,
    /,
) -> None: ...
def bytes_read_ahead() -> int: ...
def cores_shared(max_age_ns: int) -> bool | None: ...
def split_probe(helper_ns: int, helper_sleeps: bool, fresh: bool) -> int: ...
def split_solo_ns() -> int: ...
def split_give_load(helper_share: float, yield_lost: int, solo_ns: int) -> None: ...
def split_end_solo(ago_ns: int) -> None: ...
def index_finish(
    x: int,
    rows: int,
    heads: int,
    dim: int,
    ln_weight: int,
    ln_bias: int,
    eps: float,
    rope: int,
    interleaved: bool,
    cos: int,
    sin: int,
    period: int,
    out: int,
    /,
) -> None: ...
def index_select(
    q: int,
    weights: int,
    keys: int,
    rows: int,
    heads: int,
    dim: int,
    seen: int,
    topk: int,
    scale: float,
    chosen: int,
    threads: int,
    /,
) -> None: ...
def index_tile_scores(
    q: int,
    weights: int,
    keys_t: int,
    rows: int,
    heads: int,
    dim: int,
    keys: int,
    key_stride: int,
    scale: float,
    scores: int,
    score_stride: int,
    simd: int,
    threads: int,
    /,
) -> None: ...
def index_tile_choose(
    slab: int,
    rows: int,
    width: int,
    slab_stride: int,
    first: int,
    position: int,
    topk: int,
    merged: bool,
    ranks: int,
    threads: int,
    /,
) -> None: ...
def read_ahead(ranges: Sequence[tuple[int, int]], threads: int, /) -> None: ...
def nibble_moe(
    x: int,
    rows: int,
    ids: int,
    weights: int,
    topk: int,
    expert_ids: int,
    n_experts: int,
    mats: int,
    layout: tuple[int, ...],
    clamp: bool,
    limit: float,
    out: int,
    threads: int,
    alone: bool,
    segments: int = ...,
    n_segments: int = ...,
    /,
) -> None: ...
def q8_moe(
    x: int,
    rows: int,
    dim: int,
    inter: int,
    ids: int,
    weights: int,
    topk: int,
    expert_ids: int,
    n_experts: int,
    mats: int,
    kind13: int,
    kind2: int,
    scale_kind: int,
    group13: int,
    group2: int,
    interleaved: bool,
    clamp: bool,
    limit: float,
    out: int,
    isa: int,
    threads: int,
    /,
) -> None: ...
def q8_gemm(
    w: int,
    scales: int,
    x: int,
    y: int,
    rows: int,
    in_: int,
    out: int,
    group: int,
    isa: int,
    threads: int,
    kind: int,
    scale_kind: int,
    interleaved: bool = ...,
    /,
) -> None: ...
def dequant(
    q: int, scales: int, dst: int, out: int, in_: int, group: int, code: int = ..., scale_kind: int = ..., /
) -> None: ...
def gemm(
    q: int,
    scales: int,
    x: int,
    y: int,
    rows: int,
    in_: int,
    out: int,
    group: int,
    work: int,
    isa_limit: int,
    threads: int = ...,
    code: int = ...,
    scale_kind: int = ...,
    alone: bool = ...,
    /,
) -> None: ...
def work_floats(rows: int, in_: int, group: int, /) -> int: ...
def bf16_gemm(
    w: int,
    x: int,
    y: int,
    rows: int,
    in_: int,
    out: int,
    isa_limit: int,
    threads: int = ...,
    alone: bool = ...,
    segments: int = ...,
    n_segments: int = ...,
    /,
) -> None: ...
def q8_mlp(
    w1: Matrix,
    w3: Matrix,
    w2: Matrix,
    x: int,
    rows: int,
    dim: int,
    inter: int,
    clamp: bool,
    limit: float,
    out: int,
    isa: int,
    threads: int,
    /,
) -> None: ...
def mla_weights(
    dims: tuple[int, int, int, int, int, int, int, bool],
    floats: tuple[float, float, float],
    norms: tuple[int, int, int],
    wq_a: Matrix,
    wkv_a: Matrix,
    wq_b: Matrix | None,
    wo: Matrix,
    kv_b: tuple[int, int, int],
    /,
) -> MlaWeights: ...
def mla_project(
    weights: MlaWeights,
    x: int,
    cos: int,
    sin: int,
    normed: int,
    q_latent: int,
    q_nope: int,
    q_rope: int,
    latent: int,
    rope_key: int,
    isa: int,
    threads: int,
    /,
) -> None: ...
def mla_output(
    weights: MlaWeights,
    q_nope: int,
    q_rope: int,
    latents: int,
    rope_keys: int,
    positions: int,
    total: int,
    x: int,
    out: int,
    isa: int,
    threads: int,
    /,
) -> None: ...

# layer_plan's result: a capsule holding a layer's LayerPlan for decode_layers
LayerPlanCapsule = NewType("LayerPlanCapsule", object)

def layer_plan(
    attention: MlaWeights,
    ffn_norm: int,
    ffn_eps: float,
    mlp: tuple[Matrix, Matrix, Matrix, int] | None,
    router: tuple[int, int, int, int, int, int, int, bool, float, int] | None,
    layout: tuple[int, ...] | None,
    stops: bool,
    /,
) -> LayerPlanCapsule: ...
def decode_layers(
    plans: tuple[LayerPlanCapsule, ...],
    steps: int,
    rows: int,
    x: int,
    cos: int,
    sin: int,
    ids: int,
    topk_max: int,
    carry: tuple[int, int, int, int, int, int, int, int],
    at: tuple[int, bool],
    isa: int,
    threads: int,
    /,
) -> int | None: ...
