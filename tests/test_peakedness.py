"""The attention peakedness measurement (devtools/bench/peakedness.py, ``benchmark.py --peakedness``):
its statistics on hand-built q/k (one-hot attention: top weight 1, entropy 0; uniform: 1/n and
ln n; text mass, 2x2 pooling), the kind of peak where it is known (a key every query shares:
sink; each query on its neighbours: local; uniform: flat; each on a far key of its own:
scattered), that the capture reads each call's heads as the attention function does, and that
measuring leaves the trained fixtures' outputs bit for bit unchanged."""

from __future__ import annotations

import math

import pytest
import torch

from bench import peakedness


def one_hot_qk(h: int, w: int, text: int = 0, sharp: float = 1e3):
    """q, k [1, 1, tokens, d] where each image query attends only to its own key."""
    n = h * w
    tokens = text + n
    k = torch.eye(tokens)[None, None]  # one unit key per token
    q = torch.zeros(1, 1, tokens, tokens)
    q[0, 0, text:] = sharp * torch.eye(tokens)[text:]
    return q, k


def test_one_hot_attention():
    q, k = one_hot_qk(4, 6)
    stats = peakedness.attention_stats(q, k, (0, 4, 6))
    assert stats["top"] == pytest.approx(1.0, abs=1e-6)
    assert stats["entropy"] == pytest.approx(0.0, abs=1e-4)
    assert stats["max_entropy"] == pytest.approx(math.log(24))
    assert stats["self"] == pytest.approx(1.0, abs=1e-6)
    assert stats["text_mass"] == 0.0
    # 2x2 average pooling: the own cell takes everything, its value a quarter of the top key's.
    assert stats["top_kept_2x2"] == pytest.approx(0.25, abs=1e-4)
    assert stats["queries"] == 24


def test_uniform_attention():
    n, text = 8 * 8, 5
    q, k = torch.zeros(2, 3, text + n, 4), torch.randn(2, 3, text + n, 4)
    stats = peakedness.attention_stats(q, k, (text, 8, 8))
    assert stats["top"] == pytest.approx(1 / (text + n), rel=1e-5)
    assert stats["entropy"] == pytest.approx(math.log(text + n), rel=1e-5)
    assert stats["max_entropy"] == pytest.approx(math.log(text + n))
    assert stats["self"] == pytest.approx(1 / (text + n), rel=1e-5)
    assert stats["text_mass"] == pytest.approx(text / (text + n), rel=1e-5)
    assert stats["todo_change_nearest"] is None  # without values
    assert stats["queries"] == 2 * 3 * n


def test_todo_change():
    """Flat attention reads the mean of the values: average pooling keeps it exactly, nearest
    nearly (a mean of 16 values for one of 64); one-hot attention loses the value of 3 queries
    in 4 under nearest pooling (the RMS change about one value spread)."""
    h = w = 8
    n = h * w
    v = torch.randn(1, 1, n, 16, generator=torch.Generator().manual_seed(0))
    flat = peakedness.attention_stats(torch.zeros(1, 1, n, 16), torch.randn(1, 1, n, 16), (0, h, w), v=v)
    assert flat["todo_change_average"] == pytest.approx(0.0, abs=1e-5)
    assert 0.05 < flat["todo_change_nearest"] < 0.4
    blocks = v.reshape(1, 1, h // 2, 2, w // 2, 2, 16)[:, :, :, :1, :, :1].expand(1, 1, h // 2, 2, w // 2, 2, 16)
    even = peakedness.attention_stats(torch.zeros(1, 1, n, 16), torch.randn(1, 1, n, 16), (0, h, w),
                                      v=blocks.reshape(1, 1, n, 16))  # each 2x2 cell one value: nothing lost
    assert even["todo_change_nearest"] == pytest.approx(0.0, abs=1e-5)
    q, k = one_hot_qk(h, w)
    peaked = peakedness.attention_stats(q, k, (0, h, w), v=v)
    assert peaked["todo_change_nearest"] > 0.7 and peaked["todo_change_average"] > 0.7


def test_uniform_attention_over_image_keys_is_kept_by_pooling():
    q, k = torch.zeros(1, 2, 16, 8), torch.zeros(1, 2, 16, 8)
    stats = peakedness.attention_stats(q, k, (0, 4, 4))
    assert stats["top"] == pytest.approx(1 / 16)
    assert stats["entropy"] == pytest.approx(math.log(16), rel=1e-6)
    assert stats["top_kept_2x2"] == pytest.approx(1.0)


def test_peaked_on_text_and_odd_grid():
    """Image queries that look at one text token: all mass on text, pooling leaves that key
    whole (kept 1); a 3x5 grid has no 2x2 pooling (None)."""
    text, h, w = 3, 4, 4
    tokens = text + h * w
    k = torch.eye(tokens)[None, None]
    q = torch.zeros(1, 1, tokens, tokens)
    q[0, 0, text:, 1] = 1e3
    v = torch.randn(1, 1, tokens, tokens)
    stats = peakedness.attention_stats(q, k, (text, h, w), v=v)
    assert stats["text_mass"] == pytest.approx(1.0, abs=1e-6)
    assert stats["top_kept_2x2"] == pytest.approx(1.0, abs=1e-4)
    assert stats["todo_change_nearest"] == pytest.approx(0.0, abs=1e-4)
    odd = peakedness.attention_stats(torch.zeros(1, 1, 15, 2), torch.zeros(1, 1, 15, 2), (0, 3, 5),
                                     v=torch.ones(1, 1, 15, 2))
    assert odd["top_kept_2x2"] is None and odd["todo_change_nearest"] is None
    assert odd["top"] == pytest.approx(1 / 15)


def grid_qk(h: int, w: int, attends, text: int = 0, sharp: float = 50.0):
    """q, k [1, 1, tokens, tokens] (scale 1): image query i scores ``sharp`` on the keys
    ``attends(i)`` (token indices) and 0 on the rest, so it spreads its attention evenly over them."""
    tokens = text + h * w
    k = torch.eye(tokens)[None, None]
    q = torch.zeros(1, 1, tokens, tokens)
    for i in range(h * w):
        q[0, 0, text + i, attends(i)] = sharp
    return q, k


def chebyshev(h: int, w: int, i: int, r: int, text: int = 0) -> list[int]:
    """The token indices of the image keys within Chebyshev distance r of image position i."""
    y, x = divmod(i, w)
    return [text + yy * w + xx for yy in range(max(0, y - r), min(h, y + r + 1))
            for xx in range(max(0, x - r), min(w, x + r + 1))]


def test_kind_sink():
    """Every query on the same key (an image key far from most queries, or a text token): the
    16 heaviest keys hold everything, every query shares the top key: sink."""
    h = w = 16
    q, k = grid_qk(h, w, lambda i: [37])
    stats = peakedness.attention_stats(q, k, (0, h, w), scale=1.0)
    assert stats["shared_top16"] == pytest.approx(1.0, abs=1e-6)
    assert stats["shared_top1"] == pytest.approx(1.0, abs=1e-6)
    assert stats["top_shared"] == pytest.approx(1.0)
    assert stats["own_top16"] == pytest.approx(1.0, abs=1e-6)
    assert stats["shared_uniform"] == pytest.approx(16 / 256)
    assert stats["top_near"] == pytest.approx(9 / 256)  # only the sink's own neighbours
    assert stats["local_r1"] == pytest.approx(9 / 256, abs=1e-6)
    assert stats["kind"] == "sink"
    text = 4
    q, k = grid_qk(h, w, lambda i: [1], text=text)
    on_text = peakedness.attention_stats(q, k, (text, h, w), scale=1.0)
    assert on_text["text_mass"] == pytest.approx(1.0, abs=1e-6)
    assert on_text["top_near"] == 0.0 and on_text["local_r2"] == pytest.approx(0.0, abs=1e-6)
    assert on_text["kind"] == "sink"


def test_kind_local():
    """Each query spread over its 3x3 neighbourhood: all its mass within distance 1, its top key
    within one step, and no 16 keys shared by many queries: local."""
    h = w = 16
    q, k = grid_qk(h, w, lambda i: chebyshev(h, w, i, 1))
    stats = peakedness.attention_stats(q, k, (0, h, w), scale=1.0)
    assert stats["local_r1"] == pytest.approx(1.0, abs=1e-4)  # float32 sums over the queries
    assert stats["local_r2"] == pytest.approx(1.0, abs=1e-4)
    inner = (h - 2) * (w - 2) * 9 + 4 * 4 + (2 * (h - 2) + 2 * (w - 2)) * 6  # neighbours summed over the grid
    assert stats["local_r1_uniform"] == pytest.approx(inner / (h * w) ** 2)
    assert stats["top_near"] == pytest.approx(1.0)
    assert stats["shared_top16"] < 0.1  # each key ~ 9 queries' ninth: 16 of 256 keys' share
    assert stats["top_shared"] < 0.05
    assert stats["kind"] == "local"
    one_hot = peakedness.attention_stats(*one_hot_qk(4, 6), (0, 4, 6))  # on its own key, even on a small grid
    assert one_hot["kind"] == "local" and one_hot["top_near"] == 1.0


def test_kind_flat_and_scattered():
    """Uniform attention is flat, on a large grid and on a small one (SD's 4x4 middle, where 16
    keys are all the keys and the 5x5 window nearly all, and so hold only their uniform share);
    each query on one far key of its own is peaked but neither shared nor local: scattered."""
    for h, w in ((16, 16), (4, 4)):
        n = h * w
        stats = peakedness.attention_stats(torch.zeros(2, 2, n, 8), torch.randn(2, 2, n, 8), (0, h, w))
        assert stats["shared_top16"] == pytest.approx(stats["shared_uniform"], rel=1e-5)
        assert stats["local_r2"] == pytest.approx(stats["local_r2_uniform"], rel=1e-5)
        assert stats["own_top16"] == pytest.approx(min(16, n) / n, rel=1e-5)
        assert stats["kind"] == "flat"
    h = w = 16
    far = torch.randperm(h * w, generator=torch.Generator().manual_seed(0))
    q, k = grid_qk(h, w, lambda i: [int((i + 100 + far[i] % 50) % (h * w))])
    stats = peakedness.attention_stats(q, k, (0, h, w), scale=1.0)
    assert stats["own_top16"] == pytest.approx(1.0, abs=1e-6)
    assert stats["shared_top16"] < 0.3 and stats["top_near"] < 0.1
    assert stats["kind"] == "scattered"


def test_kind_rule():
    """The thresholds, at their edges: an excess of PEAK_EXCESS over the uniform share makes a
    set hold the peak; local also needs NEAR_TOP; both make "sink + local"; missing metrics None."""
    base = {"shared_top16": 0.02, "shared_uniform": 0.02, "local_r2": 0.03, "local_r2_uniform": 0.03,
            "top_near": 0.9, "own_top16": 0.1}
    excess = peakedness.PEAK_EXCESS
    assert peakedness.peak_kind(base) == "flat"
    assert peakedness.peak_kind({**base, "shared_top16": 0.02 + excess}) == "sink"
    assert peakedness.peak_kind({**base, "shared_top16": 0.019 + excess}) == "flat"
    assert peakedness.peak_kind({**base, "local_r2": 0.03 + excess}) == "local"
    assert peakedness.peak_kind({**base, "local_r2": 0.03 + excess, "top_near": 0.4}) == "flat"
    assert peakedness.peak_kind({**base, "local_r2": 0.5, "shared_top16": 0.5}) == "sink + local"
    assert peakedness.peak_kind({**base, "own_top16": 0.3}) == "scattered"
    assert peakedness.peak_kind({**base, "top_near": None}) is None


class CheckedCapture(peakedness.Capture):
    """A Capture that also recomputes each call's attention from the heads it reads and checks
    it against the attention function's own output (the layout is read as the model uses it)."""

    def __call__(self, func, *args, **kwargs):
        out = super().__call__(func, *args, **kwargs)
        q, k, v = self.heads_first(args, kwargs)
        mine = torch.softmax(q.float() @ k.float().transpose(-1, -2) * q.shape[-1] ** -0.5, -1) @ v.float()
        theirs = out if kwargs.get("skip_output_reshape") else \
            out.reshape(out.shape[0], out.shape[1], q.shape[1], -1).transpose(1, 2)  # [B, n, heads * d] out
        torch.testing.assert_close(mine, theirs.float(), rtol=1e-4, atol=1e-5)
        self.checked = getattr(self, "checked", 0) + 1
        return out


@pytest.mark.parametrize("name, px, layers", [
    ("sd15", 64, ["input 1", "input 2", "input 4", "input 5", "input 7", "input 8", "middle 0", "output 3",
                  "output 4", "output 5", "output 6", "output 7", "output 8", "output 9", "output 10", "output 11"]),
    ("flux", 128, ["double 0", "double 1", "single 0", "single 1", "single 2", "single 3"]),
])
def test_capture_leaves_the_output_bit_identical(comfy, name, px, layers):
    import photo_fixtures

    fixture = photo_fixtures.load(name)
    model = fixture.patcher.model
    before = {key: value.clone() for key, value in model.state_dict().items()}
    size = fixture.latent_size(px)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, fixture.spec.latent_channels, size, size, generator=generator)
    sigma = model.model_sampling.sigmas[len(model.model_sampling.sigmas) // 2].reshape(1).repeat(2)
    tokens = torch.cat([fixture.conditioning(c)[0][0] for c in ("a cat", "a rocket")])
    extras = {"y": tokens.mean(1)} if fixture.spec.pooled else {}
    found = peakedness.capture_for(model, px)
    capture = CheckedCapture(grid=found.grid, text_first=found.text_first)
    capture.tag = 0.5
    with torch.no_grad():
        plain = model.apply_model(x, sigma, c_crossattn=tokens, **extras)
        measured = model.apply_model(x, sigma, c_crossattn=tokens,
                                     transformer_options={"optimized_attention_override": capture}, **extras)
        again = model.apply_model(x, sigma, c_crossattn=tokens, **extras)
    assert torch.equal(plain, measured)
    assert torch.equal(plain, again)
    assert all(torch.equal(before[key], value) for key, value in model.state_dict().items())
    assert list(capture.layers) == layers
    assert capture.checked == capture.calls  # every attention call, cross-attention too, recomputed alike
    summary = capture.summary()
    for label in layers:
        entry = summary[label]
        assert 0 < entry["top"] <= 1 and 0 <= entry["entropy"] <= entry["max_entropy"] + 1e-6
        assert entry["by_t"]["0.5"]["top"] == entry["top"]
        assert entry["kind"] in ("sink", "local", "sink + local", "scattered", "flat")
        assert 0 <= entry["local_r1"] <= entry["local_r2"] <= 1 and 0 <= entry["top_near"] <= 1
        assert entry["shared_top1"] <= entry["shared_top16"] <= entry["own_top16"] + 1e-6
    if name == "flux":
        assert capture.layers["double 0"] == {"grid": [8, 8], "keys": 72, "text_tokens": 8, "downsample": None}
        assert 0 < summary["double 0"]["text_mass"] < 1
    else:
        assert capture.layers["input 1"]["grid"] == [8, 8] and capture.layers["input 1"]["downsample"] == 1
        assert capture.layers["middle 0"]["grid"] == [1, 1] and summary["middle 0"]["top_kept_2x2"] is None
