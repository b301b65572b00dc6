"""Host-free tests of ToDo's ``window`` method on DiTs (``tokenreduce/peak_window.py``, issue #50):
each query tile's window exact, the strided far field with log counts, the heavy (sink) keys,
against plain full attention (torch's SDPA over every key) on the CPU."""

from __future__ import annotations

import pytest
import torch

from tokenreduce.downsample import grid_keep_index
from tokenreduce.peak_window import heavy_keys, sdpa, tile_side, window_call, window_plan

B, HEADS, D = 2, 3, 8


def plan_of(grid, factors=(1, 2, 2), before=0, after=0, tile=(1, 4, 4), halo=(0, 2, 2)):
    target = tuple(max(1, -(-n // f)) if f == int(f) else int(-(-n // f)) for n, f in zip(grid, factors))
    tokens = grid[0] * grid[1] * grid[2]
    return window_plan(before + tokens + after, before, grid, target, factors, "cpu", tile, halo)


def rand(generator, length, dim=D):
    return torch.randn(B, HEADS, length, dim, generator=generator)


def full(q, k, v):
    return sdpa(q, k, v, None)


def windowed(q, k, v, plan, heavy=0):
    return window_call(q, k, v, HEADS, 2, plan, sdpa, heavy, heads_out=True)


def as_cells(x, plan):
    """``x`` with every grid token replaced by its cell's kept token: each cell's tokens alike."""
    grid = x.narrow(2, plan.start, plan.tokens)
    alike = grid.index_select(2, plan.far).index_select(2, plan.cell)
    end = plan.start + plan.tokens
    return torch.cat([x.narrow(2, 0, plan.start), alike, x.narrow(2, end, x.shape[2] - end)], 2)


def test_plan_shapes_cover_every_query_once_and_its_halo():
    plan = plan_of((1, 13, 10))  # sides not multiples of the tile: the last tiles are clamped inside
    assert torch.equal(plan.queries[plan.back], torch.arange(plan.tokens))
    assert plan.windows.numel() == plan.tiles * 8 * 8  # every tile the same window
    coords, low, high = plan.coords, plan.low, plan.high
    owner = plan.back // (plan.queries.numel() // plan.tiles)
    # every query's window holds every token within the halo of it (where the grid has them)
    assert ((coords[:, 1:] - 2).clamp(min=0) >= low[owner][:, 1:]).all()
    assert ((coords[:, 1:] + 3).minimum(torch.tensor([13, 10])) <= high[owner][:, 1:]).all()
    # the far field: nearest ToDo's kept positions
    assert torch.equal(plan.far, grid_keep_index((1, 13, 10), (1, 7, 5), (1, 2, 2)))


def test_tile_side_keeps_the_window_a_small_share():
    assert tile_side(32, 32) == 4  # the Flux fixture
    assert tile_side(64, 64) == 8  # Flux.1 at 1024 px
    assert tile_side(128, 128) == 16


def _local(grid, steepness):
    """q, k whose logits are -steepness * squared grid distance: attention on the query's nearest
    tokens, and below e^-18 outside its window (3 or more tokens away in space, 2 in time). The
    coordinates are centred: each logit is a difference of terms of size |c|^2, and uncentred ones
    (logits of size ~1000, far beyond a model's) round to 1e-4 in float32, differently in any two
    kernels; the fused path takes a cell's share away from the kernel's sum with its own product."""
    t, h, w = grid
    c = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"), -1)
    c = c.reshape(-1, 3).float()
    c = c - c.mean(0)
    square = (c * c).sum(1, keepdim=True)
    ones = torch.ones_like(square)
    k = torch.cat([c, square, ones, torch.zeros(len(c), D - 5)], 1)
    q = steepness * D ** 0.5 * torch.cat([2 * c, -ones, -square, torch.zeros(len(c), D - 5)], 1)
    return q.expand(B, HEADS, -1, -1).contiguous(), k.expand(B, HEADS, -1, -1).contiguous()


@pytest.mark.parametrize("grid, tile, halo", [((1, 16, 12), (1, 4, 4), (0, 2, 2)),
                                              ((1, 13, 11), (1, 8, 8), (0, 2, 2)),
                                              ((4, 8, 8), (1, 4, 4), (1, 2, 2))])
def test_exactly_local_attention_is_reproduced(grid, tile, halo):
    plan = plan_of(grid, tile=tile, halo=halo)
    q, k = _local(grid, steepness=2.0 if grid[0] == 1 else 5.0)
    v = rand(torch.Generator().manual_seed(1), plan.tokens)
    for heavy in (0, 4):
        assert (windowed(q, k, v, plan, heavy) - full(q, k, v)).abs().max() < 1e-5


@pytest.mark.parametrize("grid, factors", [((1, 12, 10), (1, 2, 2)), ((1, 9, 7), (1, 1.5, 1.5)),
                                           ((3, 8, 8), (1, 2, 2)), ((4, 6, 6), (2, 2, 2))])
def test_cells_of_identical_keys_pooled_with_their_count_give_full_attention(grid, factors):
    plan = plan_of(grid, factors, before=5, after=3)
    generator = torch.Generator().manual_seed(0)
    q = rand(generator, plan.length)
    k, v = as_cells(rand(generator, plan.length), plan), as_cells(rand(generator, plan.length), plan)
    reference = full(q, k, v)
    for heavy in (0, 6):  # heavy keys come out of their cells' counts: still exact
        assert (windowed(q, k, v, plan, heavy) - reference).abs().max() < 1e-5


def _sink(plan, position, strength=12.0):
    """Every grid key alike except one at ``position`` that every query's logit favours."""
    generator = torch.Generator().manual_seed(2)
    q = rand(generator, plan.length).abs() + 0.5  # every query leans the same way
    k = torch.zeros(B, HEADS, plan.length, D)
    v = torch.zeros(B, HEADS, plan.length, D)
    k[:, :, plan.start + position] = strength / D
    v[:, :, plan.start + position] = 1.0
    return q, k, v


def test_a_sink_off_the_stride_is_lost_by_plain_nearest_and_kept_by_the_heavy_keys():
    plan = plan_of((1, 16, 16), before=4)
    position = 5 * 16 + 3  # odd row and column: no kept position of nearest ToDo
    assert position not in plan.far
    q, k, v = _sink(plan, position)
    reference = full(q, k, v)
    assert reference.mean() > 0.3  # the sink holds much of every query's attention
    kept = torch.cat([torch.arange(plan.start), grid_keep_index((1, 16, 16), (1, 8, 8), (1, 2, 2)) + plan.start])
    nearest = full(q, k.index_select(2, kept), v.index_select(2, kept))
    assert (nearest - reference).abs().max() > 0.1  # plain nearest ToDo: gone
    assert (windowed(q, k, v, plan, heavy=0) - reference).abs().max() > 0.1  # far tiles miss it, window alone
    assert (windowed(q, k, v, plan, heavy=16) - reference).abs().max() < 1e-3
    assert (heavy_keys(q, k, plan, 1) == position).all()  # found from the sampled queries


def test_text_tokens_stay_full_for_every_query():
    plan = plan_of((1, 12, 12), before=6, after=2)
    generator = torch.Generator().manual_seed(3)
    q, k, v = (rand(generator, plan.length) for _ in range(3))
    q.abs_().add_(0.5)
    k.abs_().add_(1.0).mul_(10.0)  # every query's logits: high on the text keys ...
    k.narrow(2, plan.start, plan.tokens).neg_()  # ... and far below on the grid's
    reference = full(q, k, v)
    assert (windowed(q, k, v, plan, 4) - reference).abs().max() < 1e-5


def test_reruns_are_bit_identical_and_layouts_agree():
    plan = plan_of((1, 12, 10), before=5)
    generator = torch.Generator().manual_seed(4)
    q, k, v = (rand(generator, plan.length) for _ in range(3))
    first = windowed(q, k, v, plan, 4)
    assert torch.equal(first, windowed(q, k, v, plan, 4))
    flat = [x.transpose(1, 2).flatten(2) for x in (q, k, v)]  # [B, N, H*D], as Wan's calls hand them
    out = window_call(*flat, HEADS, 1, plan, sdpa, 4)
    assert torch.equal(out, first.transpose(1, 2).flatten(2))


def test_at_batch_one_the_plan_is_not_written_and_reruns_agree():
    """Flux at CFG 1 calls with batch 1: the heavy keys' count corrections must go to a copy of
    the plan's counts (an expanded batch of one is contiguous already), not into the plan."""
    plan = plan_of((1, 16, 16), before=4)
    counts, sizes = plan.counts.clone(), plan.sizes.clone()
    generator = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, HEADS, plan.length, D, generator=generator) for _ in range(3))
    first = window_call(q, k, v, HEADS, 2, plan, sdpa, 4, heads_out=True)
    assert torch.equal(plan.counts, counts) and torch.equal(plan.sizes, sizes)
    assert torch.equal(first, window_call(q, k, v, HEADS, 2, plan, sdpa, 4, heads_out=True))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_runs(dtype):
    plan = plan_of((1, 12, 10), before=5)
    generator = torch.Generator().manual_seed(5)
    q, k, v = (rand(generator, plan.length) for _ in range(3))
    reference = windowed(q, k, v, plan, 4)
    out = windowed(q.to(dtype), k.to(dtype), v.to(dtype), plan, 4)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert (out.float() - reference).abs().max() < 5e-2


# --- through ToDo's DiT override (todo_dit.py), as ComfyUI calls it --------------------------------

def _attention(q, k, v, heads, mask=None, skip_reshape=False, skip_output_reshape=False, **kwargs):
    """ComfyUI's attention_pytorch in short: [B, N, H*D] out unless skip_output_reshape."""
    if not skip_reshape:
        q, k, v = (x.unflatten(2, (heads, -1)).transpose(1, 2) for x in (q, k, v))
    out = sdpa(q, k, v, mask)
    return out if skip_output_reshape else out.transpose(1, 2).flatten(2)


def test_the_override_runs_the_window_on_flux_and_reports_what_each_query_sees():
    from test_core_dit import Call, flux_model, image_latent, make_patch

    patch = make_patch("Flux.1", flux_model(), method="window")
    call = Call(patch, image_latent(24, 20), torch.zeros(B, 5, 8))  # 12x10 grid after 2x2 patches
    generator = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 2, 5 + 120, 4, generator=generator) for _ in range(3))
    out = patch.override(_attention, q, k, v, 2, skip_reshape=True, mask=None, transformer_options=call.options)
    plan = call.context["windows"][("joint", 125)]
    expected = window_call(q, k, v, 2, 2, plan, sdpa, patch.heavy_keys)
    assert out.shape == (2, 125, 8) and torch.allclose(out, expected, atol=1e-6)
    (grid, (level, stages)), = call.notes.items()
    assert grid == (12, 10) and stages == {"q": (120, 120), "k/v": (120, round(plan.seen * 120))}
    # a call with a mask: plain nearest selection, as the nearest method gives
    masked = patch.override(_attention, q, k, v, 2, skip_reshape=True, mask=torch.zeros(1, 1, 125),
                            transformer_options=call.options)
    assert masked.shape == (2, 125, 8)


def test_window_runs_on_every_dit_family():
    from tokenreduce.methods import dit_method_problem
    from test_core_dit import FAMILY

    assert dit_method_problem("ToDo", FAMILY["Flux.1"], "window") is None  # every host: ComfyUI, diffusers, Forge


def test_tiles_split_into_chunks_give_the_same_output(monkeypatch):
    """A large grid's queries run in chunks of whole tiles (``LOGITS`` bounds each chunk's logits):
    one tile a chunk gives what one chunk for all gives; the backend sees only the text's queries."""
    from tokenreduce import peak_window

    plan = plan_of((2, 12, 10), before=5, tile=(1, 4, 4), halo=(1, 2, 2))
    generator = torch.Generator().manual_seed(7)
    q, k, v = (rand(generator, plan.length) for _ in range(3))
    calls = []

    def counted(*args):
        calls.append(args[0].shape)
        return sdpa(*args)

    monkeypatch.setattr(peak_window, "LOGITS", 10 ** 9)  # every tile in one chunk
    whole = window_call(q, k, v, HEADS, 2, plan, counted, 4, heads_out=True)
    assert calls == [(B, HEADS, 5, D)]  # the grid's queries by hand, the text's through the backend
    monkeypatch.setattr(peak_window, "LOGITS", 0)  # at least one tile a chunk
    split = window_call(q, k, v, HEADS, 2, plan, counted, 4, heads_out=True)
    assert (split - whole).abs().max() < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_softmax_by_hand_gives_what_the_fused_kernel_gives(monkeypatch, dtype):
    """Off the CPU (or on a torch without its fused kernel's log-sum-exp) the grid's queries run by
    hand, one softmax over both key sets: the same attention as the two fused calls merged."""
    from tokenreduce import peak_window

    plan = plan_of((2, 12, 10), before=5, after=2, tile=(1, 4, 4), halo=(1, 2, 2))
    generator = torch.Generator().manual_seed(9)
    q, k, v = (rand(generator, plan.length).to(dtype) for _ in range(3))
    fused = window_call(q, k, v, HEADS, 2, plan, sdpa, 4, heads_out=True)
    monkeypatch.setattr(peak_window, "_fused", lambda q: None)
    by_hand = window_call(q, k, v, HEADS, 2, plan, sdpa, 4, heads_out=True)
    assert by_hand.dtype == dtype
    assert (by_hand.float() - fused.float()).abs().max() < (1e-5 if dtype == torch.float32 else 5e-2)
    monkeypatch.setattr(peak_window, "LOGITS", 0)  # one tile a chunk
    assert (window_call(q, k, v, HEADS, 2, plan, sdpa, 4, heads_out=True).float() - by_hand.float()).abs().max() < 1e-5


def test_a_backend_that_softmaxes_keys_in_chunks_gets_no_nan():
    """ComfyUI's CPU default (sub-quadratic attention) takes each chunk of keys' max: a chunk of
    masked keys alone must not give NaN (the mask is finite, not -inf)."""
    def chunked(q, k, v, bias, size=4):
        logits = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + bias
        chunks = logits.split(size, -1)
        peaks = [c.amax(-1, keepdim=True) for c in chunks]
        peak = torch.stack(peaks).amax(0)
        weights = [(c - m).exp() * (m - peak).exp() for c, m in zip(chunks, peaks)]
        return torch.cat(weights, -1) @ v / sum(w.sum(-1, keepdim=True) for w in weights)

    plan = plan_of((1, 16, 16), before=4)
    generator = torch.Generator().manual_seed(8)
    q, k, v = (rand(generator, plan.length) for _ in range(3))
    out = window_call(q, k, v, HEADS, 2, plan, chunked, 4, heads_out=True)
    assert torch.isfinite(out).all()
    assert (out - windowed(q, k, v, plan, 4)).abs().max() < 1e-5


def test_the_cuda_kernels_contract_gives_what_the_softmax_by_hand_gives(monkeypatch):
    """On CUDA the grid's queries run through aten's memory-efficient kernel (``_with_lse``): a
    stand-in with that kernel's contract (the mask's rows at a stride of a multiple of 16, the
    log-sum-exp padded to a multiple of 32 queries, garbage past them) gives, merged, the
    attention of the softmax by hand; the mask is aligned without changing its values."""
    from tokenreduce import peak_window

    strides = []

    def efficient(q, k, v, bias, compute_log_sumexp):
        assert compute_log_sumexp
        logits = q.float() @ k.float().transpose(-1, -2) * q.shape[-1] ** -0.5
        if bias is not None:
            strides.append(bias.stride(-2))
            assert bias.stride(-2) % 16 == 0
            assert bias.shape == (*q.shape[:3], k.shape[2])  # "attn_bias: wrong shape" otherwise
            logits = logits + bias.float()
        lse = logits.logsumexp(-1)
        padded = torch.full((*lse.shape[:-1], -(-lse.shape[-1] // 32) * 32), 1e4)  # past the queries: garbage
        padded[..., :lse.shape[-1]] = lse
        return (logits.softmax(-1) @ v.float()).to(q.dtype), padded, None, None

    plan = plan_of((2, 12, 10), before=5, after=2, tile=(1, 4, 4), halo=(1, 2, 2))
    generator = torch.Generator().manual_seed(11)
    q, k, v = (rand(generator, plan.length) for _ in range(3))
    monkeypatch.setattr(peak_window, "_fused", lambda q: None)
    by_hand = window_call(q, k, v, HEADS, 2, plan, sdpa, 4, heads_out=True)
    monkeypatch.setattr(peak_window, "_fused", lambda q: peak_window._with_lse(efficient))
    kernel = window_call(q, k, v, HEADS, 2, plan, sdpa, 4, heads_out=True)
    assert strides  # the far field went through the kernel with its bias
    assert (kernel - by_hand).abs().max() < 1e-5
    monkeypatch.undo()
    assert peak_window._fused(torch.empty(0, device="meta")) is None  # another device: by hand
    # widths the kernel does not align go by hand (float32: no compute capability asked)
    assert peak_window._efficient_kernel_takes(torch.empty(1, 1, 1, 16))
    assert not peak_window._efficient_kernel_takes(torch.empty(1, 1, 1, 12))


@pytest.mark.parametrize("grid, factors, tile, halo", [
    ((1, 11, 9), (1, 3, 3), (1, 4, 4), (0, 2, 2)),  # cells of 9, 6, 4 tokens; windows half over cells
    ((3, 10, 10), (1, 2, 2), (2, 4, 4), (1, 2, 2)),  # video: windows in time, a last tile overlapping
    ((1, 12, 12), (1, 2, 2), (1, 4, 4), (0, 2, 2)),  # one cell size: the flash split on CUDA
])
def test_the_shared_call_corrected_per_tile_gives_the_softmax_by_hand(monkeypatch, grid, factors, tile, halo):
    """The fused path attends every shared key once, each cell with its whole count, then per tile
    adds its window and takes away what its window holds (cells partly or wholly inside, heavy keys
    inside it, a heavy key's token out of its cell): the attention of the softmax by hand, within
    float32's rounding, also with heavy keys sitting inside windows (keys made heavy on purpose)."""
    from tokenreduce import peak_window

    plan = plan_of(grid, factors, before=3, after=2, tile=tile, halo=halo)
    generator = torch.Generator().manual_seed(13)
    q, k, v = (rand(generator, plan.length) for _ in range(3))
    k[:, :, plan.start + torch.tensor([0, 5, plan.tokens // 2, plan.tokens - 1])] *= 4  # heavy, some off the stride
    fused = window_call(q, k, v, HEADS, 2, plan, sdpa, 6, heads_out=True)
    monkeypatch.setattr(peak_window, "_fused", lambda q: None)
    by_hand = window_call(q, k, v, HEADS, 2, plan, sdpa, 6, heads_out=True)
    assert (fused - by_hand).abs().max() < 1e-5
    assert plan.uniform == (0.0 if factors[1] == 3 else 4.0)


def test_the_maskless_split_gives_the_masked_call(monkeypatch):
    """Where every cell has one size, CUDA runs the shared keys through the flash kernel, which
    takes no mask: the cells in one call with their log count on its log-sum-exp, the text and
    heavy keys in another (the windows in a third). A stand-in with that contract (no mask, a
    padded log-sum-exp) gives the one masked call's attention."""
    from tokenreduce import peak_window

    def flash(q, k, v):
        logits = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
        lse = logits.logsumexp(-1)
        padded = torch.full((*lse.shape[:-1], lse.shape[-1] + 5), 1e4)
        padded[..., :lse.shape[-1]] = lse
        return logits.softmax(-1) @ v, padded[..., :q.shape[2]]

    plan = plan_of((1, 12, 12), before=4, after=1)
    generator = torch.Generator().manual_seed(17)
    q, k, v = (rand(generator, plan.length) for _ in range(3))
    masked = window_call(q, k, v, HEADS, 2, plan, sdpa, 4, heads_out=True)
    calls = []
    monkeypatch.setattr(peak_window, "_flash", lambda q: lambda *x: calls.append(1) or flash(*x))
    split = window_call(q, k, v, HEADS, 2, plan, sdpa, 4, heads_out=True)
    assert len(calls) == 3  # the cells, the text and heavy keys, the windows (one chunk)
    assert (split - masked).abs().max() < 1e-5
