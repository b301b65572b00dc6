"""Host-free tests of ToDo on DiTs: the attention override (``ToDoDiTPatch.override``) called
directly, the way ComfyUI's attention functions call it, with call contexts built the way the
host builds them (``prepare_call`` before each model call) and tensors in the layouts the
families use: ``[B, H, N, D]`` with ``skip_reshape`` (Flux, Qwen, Lumina, HunyuanVideo),
``[B, N, H*D]`` (Wan, SD3's q and k) and SD3's v ``[B, N, H, D]``.

Keys are filled with their own position along the sequence, so what reaches the backend says
which positions it got, in which order. The models are stand-ins with only the attributes the
families read (block lists, patch size, token-order flags)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from tokenreduce.families import FAMILIES
from tokenreduce.downsample import downsampled_grid
from tokenreduce.layout import dit_layout
from tokenreduce.run import SKIPPED, ModelCall, RunState
from tokenreduce.todo_dit import OVERRIDE, ToDoDiTPatch
from tokenreduce.window import SigmaWindow

FAMILY = {family.name: family for family in FAMILIES}
KEY = "tokenreduce.test"
B, HEADS, D = 2, 2, 4


# --- stand-in diffusion models: only what the families read ---------------------------------------

def flux_model(double=2, single=2, patch=2):
    return SimpleNamespace(patch_size=patch, double_blocks=[None] * double, single_blocks=[None] * single)


def qwen_model(blocks=2):
    return SimpleNamespace(patch_size=2, transformer_blocks=[None] * blocks)


def lumina_model(pad_multiple=None):
    return SimpleNamespace(patch_size=2, context_refiner=[None], noise_refiner=[None], layers=[None, None],
                           pad_tokens_multiple=pad_multiple)


def sd3_model(blocks=2, image_only=()):
    return SimpleNamespace(x_embedder=SimpleNamespace(patch_size=(2, 2)), register_length=0, joint_blocks=[
        SimpleNamespace(x_block=SimpleNamespace(x_block_self_attn=i in image_only)) for i in range(blocks)])


class WanT2VCrossAttention:
    pass


class WanI2VCrossAttention:
    pass


def wan_model(blocks=2, i2v=False, ref_conv=None):
    cross = WanI2VCrossAttention if i2v else WanT2VCrossAttention
    return SimpleNamespace(patch_size=(1, 2, 2), ref_conv=ref_conv,
                           blocks=[SimpleNamespace(cross_attn=cross()) for _ in range(blocks)])


def hunyuan_model(image_first=False, refiner=2):
    first = SimpleNamespace(flipped_img_txt=True) if image_first else SimpleNamespace()
    return SimpleNamespace(patch_size=[1, 2, 2], byt5_in=None, vision_in=None, double_blocks=[first],
                           single_blocks=[None],
                           txt_in=SimpleNamespace(individual_token_refiner=SimpleNamespace(blocks=[None] * refiner)))


# --- the host's side: a patch, a run, a model call ------------------------------------------------

def make_patch(family, model, blocks=None, factor=2.0, temporal_factor=1.0, method="nearest", previous=None):
    layout = dit_layout(model, FAMILY[family])
    if blocks is None:
        blocks = {site.key[1] for site in layout.sites}
    return ToDoDiTPatch(layout, frozenset(blocks), factor, temporal_factor, method, model, KEY, "ToDo", previous=previous)


class Call:
    """One model call as the host runs it: the run, this call's context in the options."""

    def __init__(self, patch, x, context, active=True, **kwargs):
        self.run = RunState(SigmaWindow(1.0, 0.0), always_active=active)
        if not active:
            self.run.window = SigmaWindow(0.0, 0.0)  # no noise level is inside
        sigmas = torch.tensor([0.5])
        self.context = self.run.open_call(sigmas)
        self.options = {OVERRIDE: patch.override}
        patch.prepare_call(self.context, self.run, ModelCall(x, context, kwargs, self.options, sigmas))
        self.options[KEY] = self.context
        self.patch = patch

    def __call__(self, *args, **kwargs):
        """An attention call: returns what the backend received (args, kwargs)."""
        backend = Backend()
        self.patch.override(backend, *args, transformer_options=self.options, _inside_attn_wrapper=True, **kwargs)
        (received,) = backend.calls
        return received

    @property
    def notes(self) -> dict:
        return self.context["notes"]


class Backend:
    """Stands for the attention function: records what it gets, returns zeros shaped like q."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return torch.zeros_like(args[0])


def positions(length, layout="bhnd", offset=0.0):
    """q/k/v whose every entry is its token's position along the sequence (+ offset)."""
    seq = torch.arange(length, dtype=torch.float32) + offset
    if layout == "bhnd":
        return seq.view(1, 1, length, 1).expand(B, HEADS, length, D).clone()
    if layout == "bnc":
        return seq.view(1, length, 1).expand(B, length, HEADS * D).clone()
    return seq.view(1, length, 1, 1).expand(B, length, HEADS, D).clone()  # SD3's v: [B, N, H, D]


def seq_of(x, dim):
    """The positions a position-filled tensor holds along its sequence dim, in order (each
    token's entries all hold its position: nothing was mixed across tokens)."""
    values = x.movedim(dim, 0).reshape(x.shape[dim], -1)
    assert (values == values[:, :1]).all()
    return [int(v) for v in values[:, 0]]


def strided(start, grid, factor, temporal=1):
    """The grid positions strided selection keeps: every factor-th row and column of every
    temporal-th frame, from the first, frame-major raster order."""
    t, h, w = grid
    return [start + (f * h + r) * w + c for f in range(0, t, temporal) for r in range(0, h, factor)
            for c in range(0, w, factor)]


def image_latent(h, w, channels=16):
    return torch.zeros(B, channels, h, w)


def video_latent(t, h, w, channels=16):
    return torch.zeros(B, channels, t, h, w)


# --- what reaches the backend: text, references and padding untouched, the grid strided ----------

def test_flux_text_grid_and_references_in_order():
    """[text 5, image grid 8x6, reference 4x4]: the text and reference keys arrive unchanged and
    in order, the grid's keys are every second row and column."""
    patch = make_patch("Flux.1", flux_model())
    ref = torch.zeros(1, 16, 8, 8)
    call = Call(patch, image_latent(16, 12), torch.zeros(B, 5, 8), ref_latents=[ref])
    n = 5 + 48 + 16
    q, k, v = positions(n), positions(n), positions(n, offset=0.5)
    (rq, rk, rv, heads), kwargs = call(q, k, v, HEADS, skip_reshape=True, mask=None)
    expected = list(range(5)) + strided(5, (1, 8, 6), 2) + list(range(53, 69))
    assert seq_of(rk, 2) == expected
    assert [p + 0.5 for p in expected] == [float(x) for x in rv[0, 0, :, 0]]
    assert rq is q and heads == HEADS  # every query stays
    assert kwargs["skip_reshape"] is True and kwargs["_inside_attn_wrapper"] is True
    assert call.notes == {(8, 6): (1, {"q": (48, 48), "k/v": (48, 12)})}


@pytest.mark.parametrize("image_first", [True, False], ids=["0.3.75 image first", "later text first"])
def test_hunyuan_video_in_either_token_order(image_first):
    """ComfyUI 0.3.75 puts the video before the text, later versions after it: the grid is found
    where the model puts it, and strided in time too."""
    patch = make_patch("HunyuanVideo", hunyuan_model(image_first), temporal_factor=2.0)
    text = 6
    call = Call(patch, video_latent(4, 8, 8), torch.zeros(B, text, 8))
    n = text + 4 * 4 * 4
    start = 0 if image_first else text
    for _ in range(2):  # the text refiner's calls come first
        call(positions(text), positions(text), positions(text), HEADS, skip_reshape=True, mask=None)
    (_, rk, _, _), _ = call(positions(n), positions(n), positions(n), HEADS, skip_reshape=True, mask=None)
    kept = strided(start, (4, 4, 4), 2, temporal=2)
    other = list(range(64, n)) if image_first else list(range(text))
    assert seq_of(rk, 2) == (kept + other if image_first else other + kept)
    assert call.notes[(4, 4, 4)] == (1, {"q": (64, 64), "k/v": (64, 8)})


def test_lumina_pad_tokens_after_the_grid_are_kept():
    """Z-Image pads the caption and the image to multiples of 32: [caption 5 + 27 pads, grid
    6x4 + 8 pads]; the noise refiner attends over [grid + pads] alone."""
    patch = make_patch("Lumina 2 / Z-Image", lumina_model(pad_multiple=32))
    call = Call(patch, image_latent(12, 8), torch.zeros(B, 5, 8))
    text_refiner = positions(32)
    (_, rk, _, _, _), _ = call(text_refiner, text_refiner, text_refiner, HEADS, None, skip_reshape=True)
    assert rk is text_refiner  # the caption refiner: left alone
    refiner = positions(32)
    (_, rk, _, _, _), _ = call(refiner, refiner, refiner, HEADS, None, skip_reshape=True)
    assert seq_of(rk, 2) == strided(0, (1, 6, 4), 2) + list(range(24, 32))
    joint = positions(64)
    (_, rk, _, _, _), _ = call(joint, joint, joint, HEADS, None, skip_reshape=True)
    assert seq_of(rk, 2) == list(range(32)) + strided(32, (1, 6, 4), 2) + list(range(56, 64))
    assert SKIPPED not in call.notes


def test_wan_self_attention_over_the_video_cross_attention_left_alone():
    """[B, N, H*D] layout; cross-attention (q: video, k: 512 text tokens) is another slot."""
    patch = make_patch("Wan 2.1 / 2.2", wan_model(), temporal_factor=2.0)
    call = Call(patch, video_latent(3, 8, 8), torch.zeros(B, 512, 8))
    n = 3 * 4 * 4
    x = positions(n, "bnc")
    (_, rk, rv), kwargs = call(x, x, x, heads=HEADS)
    assert seq_of(rk, 1) == strided(0, (3, 4, 4), 2, temporal=2) and seq_of(rv, 1) == seq_of(rk, 1)
    assert kwargs["heads"] == HEADS
    text = positions(512, "bnc")
    (rq, rk, rv), _ = call(x, text, text, heads=HEADS)
    assert rq is x and rk is text and rv is text


def test_wan_reference_frame_before_the_video_is_kept():
    """Fun models with a reference latent put one frame of tokens before the video."""
    patch = make_patch("Wan 2.1 / 2.2", wan_model(ref_conv=object()))
    call = Call(patch, video_latent(2, 8, 8), torch.zeros(B, 512, 8), reference_latent=torch.zeros(B, 16, 1, 8, 8))
    n = 16 + 2 * 16
    x = positions(n, "bnc")
    (_, rk, _), _ = call(x, x, x, heads=HEADS)
    assert seq_of(rk, 1) == list(range(16)) + strided(16, (2, 4, 4), 2)


def test_sd3_value_layout_and_image_only_calls():
    """SD3 passes q, k as [B, N, H*D] and v as [B, N, H, D], no skip_reshape; SD3.5 Medium adds
    an image-only call after a block's joint call."""
    patch = make_patch("SD3 / SD3.5", sd3_model(image_only=(0,)))
    call = Call(patch, image_latent(8, 8), torch.zeros(B, 7, 8))
    n = 7 + 16
    (_, rk, rv), _ = call(positions(n, "bnc"), positions(n, "bnc"), positions(n, "bnhd"), heads=HEADS)
    assert seq_of(rk, 1) == list(range(7)) + strided(7, (1, 4, 4), 2)
    assert rv.shape == (B, 7 + 4, HEADS, D) and seq_of(rv, 1) == seq_of(rk, 1)
    (_, rk, rv), _ = call(positions(16, "bnc"), positions(16, "bnc"), positions(16, "bnhd"), heads=HEADS)
    assert seq_of(rk, 1) == strided(0, (1, 4, 4), 2) and rv.shape == (B, 4, HEADS, D)
    assert SKIPPED not in call.notes


# --- masks ------------------------------------------------------------------------------------

def _qwen_call():
    patch = make_patch("Qwen-Image", qwen_model())
    return Call(patch, torch.zeros(B, 16, 1, 8, 8), torch.zeros(B, 3, 8)), 3 + 16


def test_a_positional_key_mask_is_reduced_with_the_keys():
    """Qwen-Image (0.33) and Lumina pass the mask positionally: [B, 1, N] additive."""
    call, n = _qwen_call()
    mask = torch.arange(n, dtype=torch.float32).view(1, 1, n).expand(B, 1, n).clone()
    (_, rk, _, _, rmask), kwargs = call(positions(n), positions(n), positions(n), HEADS, mask, skip_reshape=True)
    assert "mask" not in kwargs
    assert rmask.shape == (B, 1, 3 + 4) and seq_of(rmask, 2) == seq_of(rk, 2)


def test_a_keyword_key_mask_of_every_query_is_reduced_along_keys():
    """Flux's regional-prompting mask [B, 1, N, N] comes as mask=: its last dim is the keys."""
    patch = make_patch("Flux.1", flux_model())
    call = Call(patch, image_latent(8, 8), torch.zeros(B, 3, 8))
    n = 3 + 16
    mask = torch.arange(n, dtype=torch.float32).view(1, 1, 1, n).expand(B, 1, n, n).clone()
    (_, rk, _, _), kwargs = call(positions(n), positions(n), positions(n), HEADS, skip_reshape=True, mask=mask)
    assert kwargs["mask"].shape == (B, 1, n, 3 + 4)
    assert [int(x) for x in kwargs["mask"][0, 0, 5]] == seq_of(rk, 2)


def test_a_broadcast_mask_is_kept():
    call, n = _qwen_call()
    mask = torch.zeros(B, 1, 1)
    (_, rk, _, _, rmask), _ = call(positions(n), positions(n), positions(n), HEADS, mask, skip_reshape=True)
    assert rmask is mask and rk.shape[2] == 3 + 4


def test_a_mask_of_another_length_leaves_the_call_alone():
    call, n = _qwen_call()
    mask, k = torch.zeros(B, 1, n + 1), positions(n)
    (_, rk, _, _, rmask), _ = call(positions(n), k, positions(n), HEADS, mask, skip_reshape=True)
    assert rk is k and rmask is mask and call.notes[SKIPPED] == 1


# --- calls ToDo must leave alone ----------------------------------------------------------------

def test_refiner_calls_and_blocks_not_selected_pass_through_untouched():
    """HunyuanVideo: 2 text-refiner calls, then double block 0, single block 1; only block 1
    selected."""
    patch = make_patch("HunyuanVideo", hunyuan_model(), blocks={1})
    call = Call(patch, video_latent(1, 8, 8), torch.zeros(B, 6, 8))
    text, joint = positions(6), positions(6 + 16)
    for _ in range(2):
        args, _ = call(text, text, text, HEADS, skip_reshape=True, mask=None)
        assert all(a is text for a in args[:3])
    args, _ = call(joint, joint, joint, HEADS, skip_reshape=True, mask=None)
    assert all(a is joint for a in args[:3])  # block 0: not selected
    (_, rk, _, _), _ = call(joint, joint, joint, HEADS, skip_reshape=True, mask=None)
    assert seq_of(rk, 2) == list(range(6)) + strided(6, (1, 4, 4), 2)
    assert SKIPPED not in call.notes


@pytest.mark.parametrize("q_len,k_len", [(30, 30), (19, 30), (30, 19)], ids=["unexpected length", "q shorter",
                                                                           "k longer than q"])
def test_a_grid_call_of_unexpected_lengths_is_left_alone_and_noted(q_len, k_len):
    patch = make_patch("Flux.1", flux_model())
    call = Call(patch, image_latent(8, 8), torch.zeros(B, 3, 8))  # predicted: 3 + 16 = 19
    q, k, v = positions(q_len), positions(k_len), positions(k_len)
    args, kwargs = call(q, k, v, HEADS, skip_reshape=True, mask=None)
    assert args[0] is q and args[1] is k and args[2] is v and kwargs["mask"] is None
    assert call.notes == {SKIPPED: 1}


def test_the_report_says_which_dit_calls_were_left_alone_and_why():
    patch = make_patch("Flux.1", flux_model())
    call = Call(patch, image_latent(8, 8), torch.zeros(B, 3, 8))  # predicted: 3 + 16 = 19
    call(positions(30), positions(30), positions(30), HEADS, skip_reshape=True, mask=None)
    call.run.close_call(call.context, torch.tensor([0.5]))
    (warning,) = call.run.report("ToDo", 0.0, 1.0, 0.0, True, None).warnings
    assert warning.startswith("ToDo left 1 attention calls of this run unreduced")
    assert "token layout it predicts" in warning and "HyperTile" not in warning  # a UNet cause


def test_calls_beyond_the_plan_and_outside_the_window_pass_through():
    patch = make_patch("Flux.1", flux_model(double=1, single=0))
    call = Call(patch, image_latent(8, 8), torch.zeros(B, 3, 8))
    x = positions(19)
    assert call(x, x, x, HEADS, skip_reshape=True)[0][1] is not x  # block 0: reduced
    assert call(x, x, x, HEADS, skip_reshape=True)[0][1] is x  # a call the plan does not know
    inactive = Call(patch, image_latent(8, 8), torch.zeros(B, 3, 8), active=False)
    assert inactive(x, x, x, HEADS, skip_reshape=True)[0][1] is x and inactive.notes == {}
    assert "keep" not in inactive.context


def test_outside_a_sampling_run_everything_passes_through():
    patch = make_patch("Flux.1", flux_model())
    backend, x = Backend(), positions(19)
    patch.override(backend, x, x, x, HEADS, skip_reshape=True, transformer_options={})
    patch.override(backend, x, x, x, HEADS, skip_reshape=True)  # no transformer_options at all
    assert all(args[1] is x for args, _ in backend.calls)


def test_a_previous_override_is_called_with_our_keys():
    """A SageAttention-style override installed before ToDo gets the backend and ToDo's keys."""
    received = []

    def previous(func, *args, **kwargs):
        received.append((func, args, kwargs))
        return func(*args, **kwargs)

    patch = make_patch("Flux.1", flux_model(), previous=previous)
    call = Call(patch, image_latent(8, 8), torch.zeros(B, 3, 8))
    backend, x = Backend(), positions(19)
    patch.override(backend, x, x, x, HEADS, skip_reshape=True, mask=None, transformer_options=call.options)
    (func, args, kwargs), = received
    assert func is backend and seq_of(args[1], 2) == list(range(3)) + strided(3, (1, 4, 4), 2)
    assert kwargs["transformer_options"] is call.options and backend.calls[0][0][1] is args[1]


# --- pooling and grids --------------------------------------------------------------------------

def test_average_pooling_on_sd3_is_the_mean_of_each_cell():
    patch = make_patch("SD3 / SD3.5", sd3_model(), method="average")
    call = Call(patch, image_latent(8, 12), torch.zeros(B, 5, 8))
    h, w, n = 4, 6, 5 + 24
    generator = torch.Generator().manual_seed(0)
    k = torch.randn(B, n, HEADS * D, generator=generator)
    v = torch.randn(B, n, HEADS, D, generator=generator)
    (_, rk, rv), _ = call(k, k, v, heads=HEADS)

    def cells(x):  # independent: the mean of each 2x2 cell of the grid part
        grid = x[:, 5:].reshape(B, h // 2, 2, w // 2, 2, -1).mean(dim=(2, 4))
        return torch.cat([x[:, :5].reshape(B, 5, -1), grid.reshape(B, -1, grid.shape[-1])], dim=1)

    torch.testing.assert_close(rk, cells(k))
    torch.testing.assert_close(rv.reshape(B, -1, HEADS * D), cells(v.reshape(B, n, -1)))
    assert rv.shape == (B, 5 + 6, HEADS, D)


def test_average_pooling_along_time_on_a_video():
    """Wan layout with a temporal factor: the mean over each 2x2x2 cell."""
    patch = make_patch("Wan 2.1 / 2.2", wan_model(), temporal_factor=2.0, method="average")
    call = Call(patch, video_latent(4, 4, 4), torch.zeros(B, 512, 8))
    x = torch.randn(B, 4 * 2 * 2, HEADS * D, generator=torch.Generator().manual_seed(1))
    (_, rk, _), _ = call(x, x, x, heads=HEADS)
    # [B, (frames 2 x 2) (rows 1 x 2) (cols 1 x 2), C] -> the mean of each 2x2x2 cell
    torch.testing.assert_close(rk, x.reshape(B, 2, 2, 1, 2, 1, 2, -1).mean(dim=(2, 4, 6)).reshape(B, 2, -1))


@pytest.mark.parametrize("grid,factor,temporal", [
    ((1, 13, 9), 1.5, 1.0), ((1, 10, 7), 2.5, 1.0), ((1, 5, 5), 3.0, 1.0), ((1, 7, 5), 2.0, 1.0),
    ((5, 6, 6), 2.0, 2.0), ((7, 6, 4), 2.0, 3.0), ((21, 6, 10), 2.0, 2.5), ((21, 4, 4), 2.0, 2.0),
])
def test_non_integer_and_temporal_factors_give_the_grid_downsampled_grid_says(grid, factor, temporal):
    """Kept: ceil(size / factor) positions per axis (downsampled_grid), every factor-th from
    the first (a non-integer factor rounds down): with an integer factor a plain stride, also
    where it does not divide the size (Wan's 21 latent frames of 81 at temporal factor 2: frames
    0, 2, ..., 20)."""
    t, h, w = grid
    patch = make_patch("Wan 2.1 / 2.2", wan_model(), factor=factor, temporal_factor=temporal)
    call = Call(patch, video_latent(t, 2 * h, 2 * w), torch.zeros(B, 512, 8))
    n = t * h * w
    x = positions(n, "bnc")
    (_, rk, _), _ = call(x, x, x, heads=HEADS)
    th, tw = downsampled_grid(h, w, factor)
    tt = math.ceil(t / temporal)
    assert rk.shape[1] == tt * th * tw
    frames, rows, cols = ([math.floor(i * f) for i in range(m)] for m, f in ((tt, temporal), (th, factor), (tw, factor)))
    expected = [(fr * h + r) * w + c for fr in frames for r in rows for c in cols]
    assert seq_of(rk, 1) == expected
    assert call.notes[grid if t > 1 else grid[1:]] == (1, {"q": (n, n), "k/v": (n, tt * th * tw)})


def test_image_models_ignore_the_temporal_factor():
    patch = make_patch("Flux.1", flux_model(), temporal_factor=4.0)
    call = Call(patch, image_latent(8, 8), torch.zeros(B, 3, 8))
    (_, rk, _, _), _ = call(positions(19), positions(19), positions(19), HEADS, skip_reshape=True)
    assert seq_of(rk, 2) == list(range(3)) + strided(3, (1, 4, 4), 2)


def test_the_keep_plan_is_built_once_per_layout_in_a_run():
    patch = make_patch("Flux.1", flux_model())
    call = Call(patch, image_latent(8, 8), torch.zeros(B, 3, 8))
    again = call.run.open_call(torch.tensor([0.4]))
    patch.prepare_call(again, call.run, ModelCall(image_latent(8, 8), torch.zeros(B, 3, 8), {}, call.options,
                                                  torch.tensor([0.4])))
    assert again["keep"] is call.context["keep"]


# --- other overrides around ToDo's: each attention call reduced and counted once ------------------

def _model_call(patch, installed, previous_set=True):
    """A model call whose options hold ``installed`` in the override slot (another node set it
    after ToDo's); returns (run, context, options)."""
    run = RunState(SigmaWindow(1.0, 0.0), always_active=True)
    sigmas = torch.tensor([0.5])
    context = run.open_call(sigmas)
    options = {OVERRIDE: installed}
    patch.prepare_call(context, run, ModelCall(image_latent(8, 8), torch.zeros(B, 3, 8), {}, options, sigmas))
    options[KEY] = context
    return run, context, options


def _attention_calls(options, count=3):
    """``count`` attention calls of the model through whatever is in the slot; what the backend got."""
    backend = Backend()
    for _ in range(count):
        x = positions(19)
        options[OVERRIDE](backend, x, x, x, HEADS, skip_reshape=True, transformer_options=options)
    return [seq_of(args[1], 2) for args, _ in backend.calls]


def _chaining(replaced):
    def chaining(func, *args, **kwargs):  # as a SageAttention patch that calls what it replaced
        return replaced(func, *args, **kwargs)
    return chaining


def _replacing(func, *args, **kwargs):  # as a backend choice that calls the function it is handed
    return func(*args, **kwargs)


REDUCED = list(range(3)) + strided(3, (1, 4, 4), 2)


@pytest.mark.parametrize("where", ["chaining after", "replacing after", "chaining before", "replacing before",
                                   "removed after"])
def test_every_attention_call_is_reduced_and_counted_once_whatever_override_surrounds_todo(where):
    """An override set after ToDo that chains to the one it replaced calls ToDo's again: ToDo must
    not reduce (and count) that call a second time, or its counter runs ahead and later blocks go
    unreduced with a wrong warning."""
    before = _chaining(_replacing) if where == "chaining before" else _replacing if where == "replacing before" \
        else None
    patch = make_patch("Flux.1", flux_model(), previous=before)
    installed = {"chaining after": _chaining(patch.override), "replacing after": _replacing,
                 "removed after": None}.get(where, patch.override)
    run, context, options = _model_call(patch, installed)
    assert _attention_calls(options) == [REDUCED] * 3
    assert context["calls"] == 3 and SKIPPED not in context["notes"] and not context.get("inside")
    assert not run.warnings
    if where == "removed after":
        assert any("removed the attention override" in note for note in run.notes)


def test_an_unhashable_override_after_todo_is_run_behind_it():
    class Unhashable:
        __hash__ = None

        def __call__(self, func, *args, **kwargs):
            return func(*args, **kwargs)

    patch = make_patch("Flux.1", flux_model())
    other = Unhashable()
    _, context, options = _model_call(patch, other)
    assert _attention_calls(options) == [REDUCED] * 3 and context["calls"] == 3
    _, _, again = _model_call(patch, other)
    assert again[OVERRIDE] is options[OVERRIDE]  # the same front object for the same override


def test_the_fronts_kept_for_overrides_found_after_todo_are_bounded_and_thread_safe():
    import threading

    from tokenreduce import override_front

    patch = make_patch("Flux.1", flux_model())
    overrides = [_chaining(_replacing) for _ in range(4 * override_front.FRONTS)]
    fronts = []

    def meet(chunk):
        for other in chunk:
            fronts.append(_model_call(patch, other)[2][OVERRIDE])

    threads = [threading.Thread(target=meet, args=(overrides[i::4],)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(fronts) == len(overrides) and len(patch._fronts) == override_front.FRONTS
    last = overrides[-1]
    assert _model_call(patch, last)[2][OVERRIDE] is _model_call(patch, last)[2][OVERRIDE]


# --- a call plan that follows the model call (Family.call_plan) -----------------------------------

def _skipping_wan(model, x, context, kwargs, options):
    """Wan's plan with the self-attention of the blocks in options["skip"] left out (as STG skips
    a block's self-attention call), or a reason where options["refuse"] says so."""
    from tokenreduce.dit import IMAGE, OTHER, Slot

    if options.get("refuse"):
        return "this kind of call cannot be planned"
    skip = options.get("skip", ())
    return tuple(slot for i in range(len(model.blocks))
                 for slot in ((() if i in skip else (Slot(IMAGE, i),)) + (Slot(OTHER, i),)))


def _call_planned(skip=(), refuse=False, blocks=(1,)):
    family = FAMILY["Wan 2.1 / 2.2"]._replace(call_plan=_skipping_wan)
    model = wan_model()
    patch = ToDoDiTPatch(dit_layout(model, family), frozenset(blocks), 2.0, 1.0, "nearest", model, KEY, "ToDo")
    patch.plan = tuple(slot._replace(kind="other") for slot in patch.plan)  # the fixed plan is not used
    call = Call.__new__(Call)
    call.run = RunState(SigmaWindow(1.0, 0.0), always_active=True)
    sigmas = torch.tensor([0.5])
    call.context = call.run.open_call(sigmas)
    call.options = {OVERRIDE: patch.override, "skip": skip, "refuse": refuse}
    patch.prepare_call(call.context, call.run, ModelCall(video_latent(3, 8, 8), torch.zeros(B, 512, 8), {},
                                                         call.options, sigmas))
    call.options[KEY] = call.context
    call.patch = patch
    return call


def test_a_family_plans_each_call_from_its_inputs():
    """With block 0's self-attention skipped in this call, its second attention call is block 1's
    self-attention: reduced (block 1 is selected), where the fixed plan would have taken it for
    block 0's cross-attention."""
    n = 3 * 4 * 4
    x, text = positions(n, "bnc"), positions(512, "bnc")
    call = _call_planned(skip=(0,))
    (_, rk, _), _ = call(x, text, text, heads=HEADS)
    assert rk is text
    (_, rk, _), _ = call(x, x, x, heads=HEADS)
    assert seq_of(rk, 1) == strided(0, (3, 4, 4), 2)
    call = _call_planned(skip=())  # block 0 runs its self-attention: not selected, left alone
    assert [call(x, k, k, heads=HEADS)[0][1] is k for k in (x, text, x)] == [True, True, False]


def test_a_call_plan_is_made_once_per_distinct_call_and_a_reason_leaves_the_call_alone():
    first, again = _call_planned(skip=(0,)), _call_planned(skip=(0,))
    assert first.context["plan"] == again.context["plan"]
    other = first.run.open_call(torch.tensor([0.4]))
    first.patch.prepare_call(other, first.run, ModelCall(video_latent(3, 8, 8), torch.zeros(B, 512, 8), {},
                                                         dict(first.options), torch.tensor([0.4])))
    assert other["plan"] is first.context["plan"]  # the same object: a compiled model sees no new value
    refused = _call_planned(refuse=True)
    assert not refused.context["active"]
    assert any("cannot be planned" in w for w in refused.run.warnings)


def test_a_fixed_plan_family_keeps_its_plan():
    patch = make_patch("Flux.1", flux_model())
    call = Call(patch, image_latent(8, 8), torch.zeros(B, 3, 8))
    assert call.context["plan"] is patch.plan


@pytest.mark.parametrize("grid, strides, r", [((1, 6, 8), (1, 2, 2), 24), ((3, 4, 6), (1, 2, 2), 30),
                                              ((1, 5, 7), (1, 2, 2), 10)])
def test_keys_kept_in_a_merged_block_are_todos_on_the_restored_grid(grid, strides, r):
    """In a block ToMe merged, ToDo's kept keys are its nearest selection of the grid as ToMe
    restores it: the tokens around the grid all kept, the grid's kept keys merged tokens."""
    from tokenreduce.todo_dit import keep_plans, merged_keep_index
    from tokenreduce.tome_dit import make_tiles, plan_block, restore, take

    n, before, after = math.prod(grid), 5, 3
    length = before + n + after
    tokens = SimpleNamespace(grid=grid, joint=(length, before), image=None)
    ((_, keep),) = keep_plans(tokens, 2.0, 1.0, "cpu").items()
    tiles = make_tiles(grid, strides, torch.Generator().manual_seed(1), "cpu")
    plan = plan_block(torch.randn(2, n, 8, generator=torch.Generator().manual_seed(2)), tiles, r)
    m = plan.merged_tokens
    keys = torch.randn(2, length - r, 4, generator=torch.Generator().manual_seed(3))  # a merged block's keys
    index = merged_keep_index(keep, plan, length - r)
    assert index.shape == (2, keep.index.shape[0])  # ToDo's count of keys
    assert (index[:, :before] == torch.arange(before)).all()
    assert (index[:, -after:] == torch.arange(before + m, length - r)).all()
    grid_rows = index[:, before:-after]
    assert ((grid_rows >= before) & (grid_rows < before + m)).all()
    restored = torch.cat([keys[:, :before], restore(plan, keys[:, before:before + m]), keys[:, before + m:]], 1)
    assert torch.equal(take(keys, 1, index), restored.index_select(1, keep.index))
