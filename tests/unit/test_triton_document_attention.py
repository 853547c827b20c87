"""Document-masked (packed, varlen) attention in the Triton kernel, under the interpreter.

In scope: the kernel's output, log-sum-exp and q/k/v gradients against a float64 softmax written
out here with the mask `same document & (causal: key not after query, bottom-right)`, for short
and long documents, GQA, partial tiles, causal or not, another block's keys (queries that see
nothing: output 0, lse -inf, finite gradients) and ids out of order; that the walks skip the
tiles no query may see (counted by the kernels themselves); and that tuned tiles and the tuning
key know about documents. Shapes are tiny and tiles 16 wide, so that tiles end mid-document.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

from tests.unit.triton_interpreter import interpreted_only

pytestmark = [pytest.mark.triton, interpreted_only]

triton = pytest.importorskip("triton")

from plait.plugins.kernels_triton import attention as attention_module  # noqa: E402
from plait.plugins.kernels_triton.attention import attention, tiles_visited  # noqa: E402
from plait.plugins.kernels_triton.tuning import Tile, TileStore, tuning  # noqa: E402

BLOCK = 16
TOLERANCE = {"atol": 2e-5, "rtol": 2e-4}


def _document_ids(lengths: Sequence[Sequence[int]], first: int = 0) -> torch.Tensor:
    """(rows, seq) int32 ids of documents laid end to end, numbered across the whole batch."""
    rows, next_id = [], first
    for row in lengths:
        ids: list[int] = []
        for length in row:
            ids += [next_id] * length
            next_id += 1
        rows.append(ids)
    return torch.tensor(rows, dtype=torch.int32)


def _reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    query_ids: torch.Tensor | None,
    key_ids: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(QKᵀ/√d, masked) V and the natural lse in float64; a row that sees no key: 0, -inf."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    seq_q, seq_k = scores.shape[-2:]
    allowed = torch.ones(q.shape[0], 1, seq_q, seq_k, dtype=torch.bool)
    if query_ids is not None:
        keys = query_ids if key_ids is None else key_ids
        allowed = query_ids[:, None, :, None] == keys[:, None, None, :]
    if causal:
        allowed = allowed & ~torch.ones(seq_q, seq_k, dtype=torch.bool).triu(1 + seq_k - seq_q)
    blind = ~allowed.any(-1, keepdim=True)
    # Rows that see nothing are computed on zeros and zeroed, so their gradient is 0, not NaN.
    scores = scores.masked_fill(~allowed, float("-inf")).masked_fill(blind, 0.0)
    lse = torch.logsumexp(scores, -1)
    out = (torch.exp(scores - lse[..., None]).masked_fill(blind, 0.0)) @ v
    return out, lse.masked_fill(blind.squeeze(-1), float("-inf"))


def _loss(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    # Weights make every element of both outputs matter; a -inf lse (no key seen) adds nothing.
    w_out = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    w_lse = torch.linspace(1, -2, lse.numel(), dtype=out.dtype).view_as(lse)
    finite_lse = torch.where(lse.isfinite(), lse.to(out.dtype), 0.0)
    return (out * w_out).sum() + (finite_lse * w_lse).sum()


def _inputs(
    batch: int, heads: int, kv_heads: int, seq_q: int, seq_k: int | None = None, seed: int = 0
) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    seq_k = seq_q if seq_k is None else seq_k
    shapes = ((batch, heads, seq_q, 16), (batch, kv_heads, seq_k, 16), (batch, kv_heads, seq_k, 16))
    return [torch.randn(s, generator=generator).requires_grad_() for s in shapes]


def _check(
    inputs: list[torch.Tensor],
    causal: bool,
    query_ids: torch.Tensor | None,
    key_ids: torch.Tensor | None = None,
    *,
    blocks: tuple[int, int] = (BLOCK, BLOCK),
    kernel: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """The kernel's output, lse and gradients against the float64 reference; returns them."""
    q, k, v = inputs

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        return attention(
            q, k, v, causal, block_m=blocks[0], block_n=blocks[1], return_lse=True,
            document_ids=query_ids, key_document_ids=key_ids,
        )  # fmt: skip

    out, lse = (kernel or run)(q, k, v)
    grads = torch.autograd.grad(_loss(out, lse), (q, k, v))
    expected_out, expected_lse = _reference(q, k, v, causal, query_ids, key_ids)
    expected_grads = torch.autograd.grad(_loss(expected_out, expected_lse), (q, k, v))
    torch.testing.assert_close(out, expected_out.float(), **TOLERANCE, msg="output")
    torch.testing.assert_close(lse, expected_lse.float(), **TOLERANCE, msg="lse")
    for name, got, want in zip("qkv", grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want.float(), **TOLERANCE, msg=f"gradient of {name}")
    return out, lse, grads


# Rows of 37 tokens: tiles of 16 end mid-document and the last tile is partial.
SHORT_DOCUMENTS = [[1, 2, 3, 5, 7, 11, 8], [2, 2, 13, 3, 17]]
SPANNING = [[37], [37]]
LENGTHS_OF_ONE = [[1] * 37, [30, 1, 1, 5]]


@pytest.mark.parametrize(
    ("lengths", "heads", "kv_heads", "causal"),
    [
        pytest.param(SHORT_DOCUMENTS, 2, 2, True, id="short-documents"),
        pytest.param(SPANNING, 2, 2, True, id="one-document-per-row"),
        pytest.param(LENGTHS_OF_ONE, 2, 2, True, id="documents-of-one-token"),
        pytest.param(SHORT_DOCUMENTS, 4, 1, True, id="gqa"),
        pytest.param(SHORT_DOCUMENTS, 2, 1, False, id="not-causal"),
    ],
)
def test_self_attention_matches_the_masked_softmax(
    lengths: list[list[int]], heads: int, kv_heads: int, causal: bool
) -> None:
    ids = _document_ids(lengths)
    _check(_inputs(2, heads, kv_heads, ids.shape[1]), causal, ids)


@pytest.mark.parametrize("blocks", [(32, 16), (16, 32)], ids=["tall-queries", "tall-keys"])
def test_unequal_tiles_plan_each_side_by_its_own_block(blocks: tuple[int, int]) -> None:
    """Query blocks and key blocks of different sizes: the forward and dQ plan key ranges per
    query block, dK/dV query ranges per key block, each by its own size."""
    ids = _document_ids(SHORT_DOCUMENTS)
    _check(_inputs(2, 2, 1, ids.shape[1], seed=9), True, ids, blocks=blocks)


def test_documents_change_the_result() -> None:
    """The reference is not trivially satisfied: the same inputs without documents differ."""
    ids = _document_ids(SHORT_DOCUMENTS)
    q, k, v = _inputs(2, 2, 2, ids.shape[1])
    with_documents = attention(q, k, v, True, block_m=BLOCK, block_n=BLOCK, document_ids=ids)
    without = attention(q, k, v, True, block_m=BLOCK, block_n=BLOCK)
    assert not torch.allclose(with_documents, without, atol=1e-3)
    # A row that is one document is plain causal attention.
    spanning = attention(
        q, k, v, True, block_m=BLOCK, block_n=BLOCK, document_ids=_document_ids(SPANNING)
    )
    torch.testing.assert_close(spanning, without, atol=0.0, rtol=0.0)


# Queries: the tail of document 5 and documents 6-8 (21 tokens) of one stretch of the row.
RING_QUERIES = [5] * 4 + [6] * 9 + [7] * 3 + [8] * 5


@pytest.mark.parametrize(
    ("key_ids", "causal", "blind_documents"),
    [
        # Keys of an earlier stretch (documents 3-6), all before the queries: no causal mask.
        pytest.param([3] * 6 + [4] * 2 + [5] * 11 + [6] * 5, False, {7, 8}, id="earlier-block"),
        # 24 keys, bottom-right causal: each query sees its document's keys up to 3 past it.
        pytest.param([5] * 5 + [6] * 6 + [7] * 13, True, {8}, id="causal-block"),
    ],
)
def test_another_blocks_keys_leave_some_queries_blind(
    key_ids: list[int], causal: bool, blind_documents: set[int]
) -> None:
    """Ring attention's block: queries of one stretch of the row, keys of another. Queries whose
    document has no visible key in the block see nothing: output 0, lse -inf, no gradient, and
    nothing NaN anywhere."""
    query_ids = torch.tensor([RING_QUERIES, [i + 100 for i in RING_QUERIES]], dtype=torch.int32)
    keys = torch.tensor([key_ids, [i + 100 for i in key_ids]], dtype=torch.int32)
    inputs = _inputs(2, 2, 1, query_ids.shape[1], keys.shape[1], seed=4)
    out, lse, grads = _check(inputs, causal, query_ids, keys)
    blind = torch.isin(query_ids % 100, torch.tensor(sorted(blind_documents)))
    blind = blind[:, None, :].expand_as(lse)
    assert torch.isneginf(lse[blind]).all() and torch.isfinite(lse[~blind]).all()
    assert (out[blind] == 0).all() and (out[~blind] != 0).all()
    assert all(torch.isfinite(g).all() for g in grads)
    assert (grads[0][blind] == 0).all(), "a blind query takes no gradient"


def test_keys_fewer_than_queries_align_causal_bottom_right() -> None:
    """Without documents, 21 queries over 13 keys: the last query sees every key, the first 8
    see none (output 0, lse -inf)."""
    inputs = _inputs(1, 2, 2, 21, 13, seed=5)
    _, lse, _ = _check(inputs, True, None)
    assert torch.isneginf(lse[..., :8]).all() and torch.isfinite(lse[..., 8:]).all()
    _check(_inputs(1, 2, 2, 13, 21, seed=6), True, None)


def test_ids_out_of_order_stay_exact() -> None:
    """The tile plan assumes ids never decrease; a row that breaks it is walked whole, so the
    element mask still gives the masked softmax (only slower)."""
    ids = _document_ids(SHORT_DOCUMENTS)
    ids[0] = ids[0].flip(0)  # documents in reverse order in row 0
    ids[1, 20:25] = ids[1, 0]  # row 1: the first document again, mid-row
    _check(_inputs(2, 2, 2, ids.shape[1], seed=7), True, ids)


def _planned_tiles(lengths: list[int], causal: bool, block: int = BLOCK) -> tuple[int, int]:
    """Tiles a walk over only the documents' own keys needs, counted from the lengths: per query
    block, the keys from its first document's start to its last's end (and the diagonal); per
    key block, the queries likewise. (forward or dQ tiles, dK/dV tiles) for one head."""
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    document_of = [i for i, length in enumerate(lengths) for _ in range(length)]
    seq = len(document_of)

    def span(position: int) -> tuple[int, int]:
        document = document_of[position]
        return starts[document], starts[document] + lengths[document]

    forward = backward = 0
    for first in range(0, seq, block):
        last = min(first + block, seq) - 1
        lo, hi = span(first)[0], span(last)[1]
        forward += triton.cdiv((min(hi, last + 1) if causal else hi) - lo, block)
        backward += triton.cdiv(hi - (max(lo, first) if causal else lo), block)
    return forward, backward


def test_walks_skip_the_tiles_no_query_sees() -> None:
    """A row of 128 tokens in documents of 8: every program walks one tile where causal
    attention over the whole row walks up to the diagonal (36 of 8·8 tiles)."""
    lengths = [8] * 16
    ids = _document_ids([lengths])
    inputs = _inputs(1, 1, 1, ids.shape[1])
    sparse = tiles_visited(*inputs, True, block_m=BLOCK, block_n=BLOCK, document_ids=ids)
    dense = tiles_visited(*inputs, True, block_m=BLOCK, block_n=BLOCK)
    planned_forward, planned_dkdv = _planned_tiles(lengths, True)
    assert int(sparse["forward"].sum()) == planned_forward == 8
    assert int(sparse["backward_dq"].sum()) == planned_forward
    assert int(sparse["backward_dkdv"].sum()) == planned_dkdv == 8
    assert int(dense["forward"].sum()) == int(dense["backward_dkdv"].sum()) == 36
    assert int(dense["backward_dq"].sum()) == 36


@pytest.mark.parametrize("causal", [True, False])
def test_walks_follow_the_documents_of_each_block(causal: bool) -> None:
    """Uneven documents (some across tile edges, one longer than a tile): every kernel walks
    exactly the tiles the documents need, no more (skipping) and no fewer (exactness)."""
    lengths = [3, 17, 1, 2, 29, 5, 7]
    ids = _document_ids([lengths, lengths[::-1]])
    visits = tiles_visited(
        *_inputs(2, 2, 1, ids.shape[1]), causal, block_m=BLOCK, block_n=BLOCK, document_ids=ids
    )
    for row, row_lengths in enumerate((lengths, lengths[::-1])):
        forward, dkdv = _planned_tiles(row_lengths, causal)
        for kernel, heads, expected in (
            ("forward", 2, forward), ("backward_dq", 2, forward), ("backward_dkdv", 1, dkdv)
        ):  # fmt: skip
            # Programs are ordered batch-major; dK/dV walk each of the group's 2 query heads.
            walked = visits[kernel][row * heads : (row + 1) * heads].sum()
            group = 2 if kernel == "backward_dkdv" else 1
            assert int(walked) == expected * heads * group, f"{kernel}, row {row}"


class _Prefer:
    """A bench that ranks the wanted tile of each kernel fastest and launches only it."""

    def __init__(self, wanted: dict[str, Tile]) -> None:
        self.wanted = wanted

    def __call__(self, kernel: str, candidate: Tile, run: Callable[[], object]) -> float:
        if candidate != self.wanted[kernel]:
            return 1.0
        run()
        return 0.0


def test_tuned_tiles_of_unequal_sizes_keep_documents_exact(tmp_path) -> None:
    """The ranges are planned per chosen block size: forward, dQ and dK/dV each take another
    tile here. And the tuning key tells a document walk from a full one."""
    tuners = (attention_module.FORWARD_TILES, attention_module.DQ_TILES,
              attention_module.DKDV_TILES)  # fmt: skip
    wanted = {
        tuner.kernel: tuner.candidates[index]
        for tuner, index in zip(tuners, (1, 4, 1), strict=True)
    }
    assert len({(t["BLOCK_M"], t["BLOCK_N"]) for t in wanted.values()}) == 3
    ids = _document_ids(SHORT_DOCUMENTS)
    inputs = _inputs(2, 2, 1, ids.shape[1], seed=8)

    def tuned(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        return attention(q, k, v, True, return_lse=True, document_ids=ids)

    with tuning(bench=_Prefer(wanted), store=TileStore(tmp_path / "tiles.json")):
        _check(inputs, True, ids, kernel=tuned)
        # The same problem without documents is tuned apart.
        attention(*inputs, True).sum().backward()
        for tuner in tuners:
            keys = [key for _, key in tuner.chosen()]
            assert sorted(key[-1] for key in keys) == [False, True], tuner.kernel
            assert tuner.chosen()[("cpu", next(k for k in keys if k[-1]))] == wanted[tuner.kernel]


def test_the_provider_takes_document_ids_and_checks_them() -> None:
    import plait.plugins.kernels_triton as kernels_triton

    kernel = kernels_triton.load_kernel("attention")
    ids = _document_ids(SHORT_DOCUMENTS)
    q, k, v = (t.detach() for t in _inputs(2, 2, 2, ids.shape[1]))
    expected, _ = _reference(q, k, v, True, ids, None)
    torch.testing.assert_close(kernel(q, k, v, document_ids=ids), expected.float(), **TOLERANCE)
    with pytest.raises(ValueError, match="key_document_ids given without document_ids"):
        kernel(q, k, v, key_document_ids=ids)
    with pytest.raises(ValueError, match=r"document_ids must be an integer tensor"):
        kernel(q, k, v, document_ids=ids[:, :-1])
    with pytest.raises(ValueError, match=r"key_document_ids must be an integer tensor"):
        kernel(q, k, v, document_ids=ids, key_document_ids=ids.float())


def test_cu_seqlens_name_the_same_documents_as_ids() -> None:
    """The varlen entry point: offsets over the flattened rows, as `Documents` keeps them."""
    from plait.core.documents import Documents
    from plait.plugins.kernels_triton.attention import varlen_attention
    from plait.plugins.kernels_triton.varlen_attention import ids_from_cu_seqlens

    documents = Documents.from_positions(
        torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1, 2, 3], [4, 5, 0, 1, 2, 3, 4, 5, 6, 0]])
    )
    ids = ids_from_cu_seqlens(documents.cu_seqlens, 2, 10)
    assert ids.dtype == torch.int32
    assert torch.equal(ids, documents.document_ids)
    ids = _document_ids(SHORT_DOCUMENTS)
    starts = [0] + [int(i) for i in (ids.flatten()[1:] != ids.flatten()[:-1]).nonzero() + 1]
    cu_seqlens = torch.tensor([*starts, ids.numel()], dtype=torch.int32)
    inputs = _inputs(2, 2, 1, ids.shape[1], seed=10)
    _check(
        inputs, True, ids,
        kernel=lambda q, k, v: varlen_attention(
            q, k, v, cu_seqlens, block_m=BLOCK, block_n=BLOCK, return_lse=True
        ),
    )  # fmt: skip


# The document walks compiled for a Hopper GPU without one: Triton's front end and the CUDA back
# end run on a CPU, in a process of its own with the interpreter off (as
# tests/unit/test_triton_float_scalars.py does for the plain kernels). The scale arrives as
# float64, as torch.compile hands it over; pointers the launch leaves out are None constexprs.
COMPILE_WITH_DOCUMENTS = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.errors import CompilationError
from plait.plugins.kernels_triton import attention

CONSTEXPRS = {"CAUSAL": True, "DOCUMENTS": True, "COUNT_VISITS": False, "BLOCK_M": 64,
              "BLOCK_N": 64, "BLOCK_D": 64, "EVEN_D": False, "PRECISION": "tf32",
              "visits_ptr": None}
IDS = ("q_doc_ptr", "k_doc_ptr", "key_lo_ptr", "key_hi_ptr", "query_lo_ptr", "query_hi_ptr")
found = {}
for name in sys.argv[1:]:
    kernel = getattr(attention, name)
    signature, constexprs = {}, {}
    for index, arg in enumerate(kernel.arg_names):
        if arg in CONSTEXPRS:
            signature[arg], constexprs[(index,)] = "constexpr", CONSTEXPRS[arg]
        elif arg.endswith("_ptr"):
            signature[arg] = ("*i32" if arg in IDS else
                              "*fp32" if arg in ("lse_ptr", "delta_ptr") else "*bf16")
        else:
            signature[arg] = "fp64" if arg in ("qk_scale", "sm_scale") else "i32"
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    try:
        triton.compile(source, target=GPUTarget("cuda", 90, 32))
        found[name] = "compiled"
    except CompilationError as error:
        found[name] = "refused: " + str(error)[-600:]
    except Exception as error:  # the CUDA back end's tools missing from this Triton install
        found[name] = f"unavailable: {type(error).__name__}: {error}"[:400]
print("RESULT " + json.dumps(found))
"""
KERNELS = ("_attn_fwd", "_attn_bwd_dq", "_attn_bwd_dkdv")


@pytest.fixture(scope="module")
def compiled_with_documents() -> dict[str, str]:
    import json
    import os
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", COMPILE_WITH_DOCUMENTS, *KERNELS],
        capture_output=True, text=True, env=dict(os.environ, TRITON_INTERPRET="0"),
        timeout=240, check=True,
    )  # fmt: skip
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line[len("RESULT ") :])


@pytest.mark.parametrize("kernel", KERNELS)
def test_document_walks_compile_for_hopper(kernel: str, compiled_with_documents) -> None:
    outcome = compiled_with_documents[kernel]
    if outcome.startswith("unavailable"):
        pytest.skip(f"Triton cannot compile for cuda:90 here: {outcome}")
    assert outcome == "compiled", f"{kernel} with documents: {outcome}"
