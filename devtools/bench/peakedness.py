"""Where attention is peaked, per self-attention layer, on the trained photo fixtures and on
random weights of the same architecture (``benchmark.py --peakedness``; issue #44).

    python3 devtools/benchmark.py --peakedness [--out docs/results/peakedness_fixtures.json]

A held-out trained UNet changed 96 % under ToDo while random weights of its architecture changed
0.2 %: trained attention is sharply peaked, so pooling keys drops the keys a query relies on.
This measures that per layer on ``devtools/photo_fixtures.py``'s two fixtures, at their native
size: Flux.1's classes (each double block's joint attention and each single block's attention,
a 32x32 image grid and 8 text tokens) and SD1.5's UNet (each transformer block's ``attn1``, on
grids 32x32, 16x16, 8x8 and the middle 4x4).

How: every attention call goes through ComfyUI's ``optimized_attention_override`` (passed in the
call's ``transformer_options``, so the model itself is never changed), which hands the call on
to the attention function unchanged and returns what it computes (bit for bit the unpatched
output), and beside it reads the call's q, k and v (after RoPE, as the attention sees them). From
``softmax(q k^T / sqrt(d))`` per head over the image-token queries, averaged over queries, heads
and the batch (``attention_stats``):

- ``top``: the largest attention weight of a query (1 = one key takes all, 1/keys = flat);
- ``entropy`` in nats, beside its maximum ``max_entropy`` = ln(keys) (0 = one key);
- ``self``: the weight a query puts on its own position's key;
- ``top_kept_2x2``: under 2x2 average pooling of the image keys and values (ToDo's ``average``
  method at factor 2, text keys left whole), the weight that the query's top key's value still
  gets (the pooled cell's weight / the keys in the cell), as a share of its weight unpooled:
  1 for flat attention, at most 1/4 where one key took everything;
- ``text_mass`` (Flux): the image queries' attention mass on the 8 text tokens;
- ``todo_change_nearest`` / ``_average``: the RMS change of the image queries' attention
  output (before the output projection) when the image keys and values are pooled 2x2 with
  ToDo's own ``downsample_tokens`` (``nearest``, ToDo's default: every other row and column;
  ``average``), the text whole, in units of the values' spread over the image tokens (RMS of
  the values less their mean): how far ToDo at factor 2 moves what each query reads. Not
  relative to the output itself: a flat attention's output is a mean of many values, near 0
  after centring, so that ratio would call the flattest layers the most changed.

The kind of peak (issue #50; ``peak_kind``): pooling keys loses a peak whether it sits on a few
keys that every query shares (attention sinks: keep those keys whole) or on each query's own
neighbourhood (a local window keeps it), and the cure differs, so per layer:

- sink-like: ``shared_top16``, the mass a query puts on the 16 keys heaviest over all the image
  queries (the keys of largest column mass of the attention map, text keys included; per head
  and batch element), against ``shared_uniform`` = 16 / keys; ``shared_top1``, the same for the
  single heaviest key; ``top_shared``, the share of queries whose top key is the one key most
  queries pick; ``own_top16``, beside them, the mass on each query's own 16 heaviest keys (what
  the shared 16 would carry if every query's peak were on the same keys);
- local: ``local_r1`` / ``local_r2``, the mass on the image keys within Chebyshev distance 1 / 2
  of the query's own grid position (3x3 / 5x5, cut at the grid's border), against
  ``local_r1_uniform`` / ``local_r2_uniform``, the share those keys would get under uniform
  attention; ``top_near``, the share of queries whose top key lies within one grid step;
- ``kind``: "sink", "local", "sink + local", "scattered" (peaked on each query's own keys, but
  neither shared nor near) or "flat" (none of these: near-uniform), by ``peak_kind``'s
  thresholds (their reasons are given there).

UNet calls are told apart by ``transformer_options``: a self-attention's keys are the block's
grid (``activations_shape``), a cross-attention's (attn2) the 8 text tokens, skipped.

Inputs: the held-out photos (``held_out_images``) encoded by the fixture's VAE
(``process_latent_in``), x the 4 ``EVAL_CAPTIONS`` (a batch of 8), x 2 noise seeds, at three
noise levels of the model's schedule (``sigmas[int(len * t)]`` for t = 0.25, 0.5, 0.75; the
noise mixed in by ``noise_scaling``, as ``denoise_gain`` does), one ``apply_model`` each. The
random model: ``photo_fixtures.build`` filled by ``random_models.build_random`` (seed 0), given the
same latents and text tokens. Per layer the mean over all of them, and per noise level.

Writes the JSON (``--out``) and prints a markdown table per fixture. Runs on the pinned host
(0.3.75), on the CPU: about 300 CPU seconds with torch's 2 threads (6-10 minutes of wall time on
a shared 2-core machine at load 5-10, about 3 where the cores are free).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import defaultdict
from pathlib import Path

from . import REPO

T_FRACTIONS = (0.25, 0.5, 0.75)
NOISE_SEEDS = (0, 1)
RANDOM_SEED = 0
FIXTURES = ("flux", "sd15")
OUT = REPO / "docs" / "results" / "peakedness_fixtures.json"
METRICS = ("top", "entropy", "max_entropy", "self", "top_kept_2x2", "text_mass", "todo_change_nearest",
           "todo_change_average", "shared_top16", "shared_top1", "shared_uniform", "top_shared", "own_top16",
           "local_r1", "local_r1_uniform", "local_r2", "local_r2_uniform", "top_near")

# --- the kind of peak (issue #50) ---
SHARED_KEYS = 16  # the heavy keys a ToDo could keep whole: 16 of 1024 (1.6 %) costs little
LOCAL_RADII = (1, 2)  # Chebyshev radii on the grid: 3x3 and 5x5 neighbourhoods
# A set of keys holds a layer's peak when its mean mass exceeds the share uniform attention would
# give it by at least this much: a quarter of every query's attention moved onto the set. An
# excess over the uniform share rather than a ratio, so that a small grid (SD's 4x4 middle,
# where 16 keys are all the keys and a 5x5 window nearly all) is not called peaked for holding
# its uniform share, and a large one needs a real peak (32x32: 16 keys need 27 % of the mass, 0.25
# above 1.6 %). A quarter: pooling 2x2 (ToDo's factor 2) keeps 1 key in 4 of a set, so a
# quarter of a query's attention on the set means up to 19 % of it lost or smeared, the size of
# change where the quality table's images start to differ; flat and random-weight layers stay far
# below (excess under 0.05 on these fixtures).
PEAK_EXCESS = 0.25
# Local also needs most queries' top key within one grid step: a window around each query holds
# the peak only where the peak is next to the query, not just mass spread nearby.
NEAR_TOP = 0.5


def peak_kind(stats: dict) -> str | None:
    """The kind of a layer's peak from ``attention_stats``' (or the summary's) means: "sink"
    where the 16 keys heaviest over all queries hold ``PEAK_EXCESS`` above their uniform share,
    "local" where the 5x5 neighbourhood does and ``NEAR_TOP`` of the queries' top keys lie within
    one grid step, "sink + local" where both hold, "scattered" where neither does but each
    query's own 16 heaviest keys do (peaked, on keys neither shared nor near), "flat" where none
    does. None without the metrics."""
    needed = ("shared_top16", "shared_uniform", "local_r2", "local_r2_uniform", "top_near", "own_top16")
    if any(stats.get(key) is None for key in needed):
        return None
    sink = stats["shared_top16"] - stats["shared_uniform"] >= PEAK_EXCESS
    local = stats["local_r2"] - stats["local_r2_uniform"] >= PEAK_EXCESS and stats["top_near"] >= NEAR_TOP
    if sink or local:
        return " + ".join(name for name, holds in (("sink", sink), ("local", local)) if holds)
    return "scattered" if stats["own_top16"] - stats["shared_uniform"] >= PEAK_EXCESS else "flat"


# --- the measurement ---------------------------------------------------------------------------

def attention_stats(q, k, image: tuple[int, int, int], scale: float | None = None, v=None) -> dict:
    """Means over batch, heads and image-token queries of softmax(q k^T * scale), per query:
    ``top``, ``entropy``, ``max_entropy`` (ln keys), ``self``, ``top_kept_2x2`` (None where
    the grid does not divide by 2) and ``text_mass`` (the mass on keys outside the image span;
    0 without such keys), plus ``queries`` (how many were averaged). With ``v``: also
    ``todo_change_nearest`` and ``todo_change_average``: the RMS change of the image queries'
    attention output when the image keys and values are pooled 2x2 on the grid (ToDo's
    ``downsample_tokens``, methods ``nearest``, its default, and ``average``; text kept whole),
    in units of the values' spread (the RMS of the image tokens' values less their mean): 0 =
    unchanged, ~0.05 for flat attention over 32x32 (a mean of 1024 values against one of 256),
    ~1.4 where each query read one value that pooling drops.

    The kind of peak (module docstring): ``shared_top16``, ``shared_top1``, ``shared_uniform``,
    ``top_shared``, ``own_top16``, ``local_r1``, ``local_r2``, their ``_uniform`` shares,
    ``top_near``, and ``kind`` (``peak_kind``).

    ``q``, ``k``, ``v``: [B, heads, tokens, d] of a self-attention (queries and keys the same
    sequence); ``image`` = (start, h, w): the image tokens are ``start .. start + h*w`` of the
    sequence in raster order, every other token is text."""
    import torch

    from tokenreduce import downsample_tokens

    start, h, w = image
    n = h * w
    end = start + n
    batch, heads, tokens, d = q.shape
    scale = d ** -0.5 if scale is None else scale
    poolable = h % 2 == 0 and w % 2 == 0
    changes = v is not None and poolable
    index = torch.arange(n, device=q.device)
    if poolable:  # the cell of each image key on the 2x2-pooled grid (the pooled keys: image cells, then text)
        cell = (index // w // 2) * (w // 2) + (index % w) // 2
    row, col = index // w, index % w  # Chebyshev distance between image positions: [n, n]
    distance = torch.maximum((row[:, None] - row[None]).abs(), (col[:, None] - col[None]).abs())
    near = torch.stack([distance <= r for r in LOCAL_RADII], -1).float()  # [n, n, radii]
    shared = min(SHARED_KEYS, tokens)

    def pool(x, method):  # [..., tokens, d] -> the pooled image tokens, then the text ones
        flat = x.reshape(-1, tokens, x.shape[-1])
        image_part = downsample_tokens(flat[:, start:end], h, w, 2.0, method)
        return torch.cat([image_part, flat[:, :start], flat[:, end:]], 1).reshape(*x.shape[:-2], -1, x.shape[-1])

    q, k = q.float() * scale, k.float()
    if poolable:
        pooled_k = {"average": pool(k, "average"), **({"nearest": pool(k, "nearest")} if changes else {})}
    if changes:
        v = v.float()
        pooled_v = {method: pool(v, method) for method in ("nearest", "average")}
        image_v = v[:, :, start:end]
        spread = (image_v - image_v.mean(2, keepdim=True)).square().sum().item()
    sums = dict.fromkeys(("top", "entropy", "self", "top_kept_2x2", "text_mass", "nearest", "average",
                          "shared_top16", "shared_top1", "top_shared", "own_top16", "top_near",
                          *(f"local_r{r}" for r in LOCAL_RADII)), 0.0)
    for b in range(batch):  # one batch element at a time: [heads, n, keys] scores
        qi = q[b, :, start:end]
        logp = torch.log_softmax(qi @ k[b].transpose(-1, -2), dim=-1)
        p = logp.exp()
        top, where = p.max(dim=-1)
        sums["top"] += top.sum().item()
        sums["entropy"] -= torch.linalg.vecdot(p, logp).sum().item()
        sums["self"] += torch.diagonal(p[..., start:end], dim1=-2, dim2=-1).sum().item()
        sums["text_mass"] += p[..., :start].sum().item() + p[..., end:].sum().item()
        column = p.sum(1)  # [heads, keys]: each key's mass over the image queries
        sums["shared_top16"] += column.topk(shared, -1).values.sum().item()
        sums["shared_top1"] += column.max(-1).values.sum().item()
        sums["own_top16"] += p.topk(shared, -1).values.sum().item()
        picked = torch.zeros(heads, tokens, device=q.device).scatter_add_(1, where, torch.ones_like(top))
        sums["top_shared"] += picked.max(-1).values.sum().item()  # the queries on the most picked key
        for r, mass in zip(LOCAL_RADII, torch.einsum("hij,ijr->r", p[..., start:end], near).tolist()):
            sums[f"local_r{r}"] += mass
        is_image = (where >= start) & (where < end)
        top_index = (where - start).clamp(0, n - 1)  # near[..., 0]: within LOCAL_RADII[0] = 1 grid step
        sums["top_near"] += (is_image & (near[index, top_index, 0] > 0)).sum().item()
        if poolable:
            pooled_p = torch.softmax(qi @ pooled_k["average"][b].transpose(-1, -2), dim=-1)
            text_slot = n // 4 + torch.where(where < start, where, where - n)
            slot = torch.where(is_image, cell[(where - start).clamp(0, n - 1)], text_slot)
            kept = pooled_p.gather(-1, slot[..., None])[..., 0] / torch.where(is_image, 4.0, 1.0)
            sums["top_kept_2x2"] += (kept / top).sum().item()
        if changes:
            reference = p @ v[b]
            for method in ("nearest", "average"):
                weights = pooled_p if method == "average" else \
                    torch.softmax(qi @ pooled_k[method][b].transpose(-1, -2), dim=-1)
                sums[method] += (weights @ pooled_v[method][b] - reference).square().sum().item()
    count = batch * heads * n
    out = {key: sums[key] / count for key in ("top", "entropy", "self", "top_kept_2x2", "text_mass", "shared_top16",
                                              "shared_top1", "top_shared", "own_top16", "top_near",
                                              *(f"local_r{r}" for r in LOCAL_RADII))}
    out["max_entropy"] = math.log(tokens)
    out["shared_uniform"] = shared / tokens
    for r, keys in zip(LOCAL_RADII, near.sum((0, 1)).tolist()):  # uniform attention's mass there, mean over queries
        out[f"local_r{r}_uniform"] = keys / (n * tokens)
    if not poolable:
        out["top_kept_2x2"] = None
    for method in ("nearest", "average"):
        out[f"todo_change_{method}"] = math.sqrt(sums[method] / spread) if changes and spread > 0 else None
    out["queries"] = count
    out["kind"] = peak_kind(out)
    return out


class Capture:
    """ComfyUI's ``optimized_attention_override``: runs the attention function it is handed
    with the same arguments and returns its output unchanged, and measures each self-attention
    call's q and k (``attention_stats``) under its layer's label and the current ``tag``.

    UNet calls (``transformer_options["block"]``): self-attention where the keys are the
    block's grid, labelled "input 1", "middle 0", "output 9" (".i" for a deeper block of a
    transformer). Flux calls (``block_type``): "double 0", "single 3", the image grid ``grid``
    beside the text (first unless ``text_first`` is False)."""

    def __init__(self, grid: tuple[int, int] | None = None, text_first: bool = True):
        self.grid, self.text_first = grid, text_first
        self.tag = None
        self.sums = defaultdict(lambda: defaultdict(float))  # (label, tag) -> metric -> query-weighted sum
        self.layers = {}  # label -> {"grid", "keys", "text_tokens", "downsample" (UNets)}, in call order
        self.calls = 0

    def __call__(self, func, *args, **kwargs):
        out = func(*args, **kwargs)
        self.calls += 1
        import torch

        with torch.no_grad():
            self.record(args, kwargs)
        return out

    @staticmethod
    def heads_first(args, kwargs):
        """q, k, v of an attention call as [B, heads, tokens, d] (UNets pass [B, tokens, heads * d])."""
        q, k, v = args[:3]
        heads = args[3] if len(args) > 3 else kwargs["heads"]
        if not kwargs.get("skip_reshape", False):
            q, k, v = (t.reshape(t.shape[0], t.shape[1], heads, -1).transpose(1, 2) for t in (q, k, v))
        return q, k, v

    def record(self, args, kwargs) -> None:
        opts = kwargs.get("transformer_options") or {}
        q, k, v = self.heads_first(args, kwargs)
        if "block" in opts:  # a UNet
            shape = opts.get("activations_shape")
            h, w = shape[-2:]
            if k.shape[2] != h * w or q.shape[2] != h * w:
                return  # cross-attention (attn2): keys are the text
            block, index = opts["block"], opts.get("block_index", 0)
            label = f"{block[0]} {block[1]}" + (f".{index}" if index else "")
            original = opts.get("original_shape")
            ds = original[-2] // h if original else None
            image = (0, h, w)
        elif "block_type" in opts:  # Flux
            h, w = self.grid
            n_text = k.shape[2] - h * w
            label = f"{opts['block_type']} {opts.get('block_index', 0)}"
            ds = None
            image = (n_text if self.text_first else 0, h, w)
        else:
            return
        stats = attention_stats(q, k, image, v=v)
        self.layers.setdefault(label, {"grid": [h, w], "keys": k.shape[2], "text_tokens": k.shape[2] - h * w,
                                       "downsample": ds})
        entry = self.sums[(label, self.tag)]
        for key in METRICS:
            if stats[key] is not None:  # a query-weighted sum, and the queries it holds
                entry[key] += stats[key] * stats["queries"]
                entry[key, "queries"] += stats["queries"]

    def summary(self) -> dict:
        """label -> {metric: mean over every call, "by_t": {tag: {metric: mean}}}."""
        def means(entry) -> dict:
            values = {key: round(entry[key] / entry[key, "queries"], 5) if entry[key, "queries"] else None
                      for key in METRICS}
            return {**values, "kind": peak_kind(values)}

        result = {}
        for label in self.layers:
            total = defaultdict(float)
            by_t = {}
            for (lab, tag), entry in self.sums.items():
                if lab == label:
                    by_t[str(tag)] = means(entry)
                    for key, value in entry.items():
                        total[key] += value
            result[label] = {**means(total), "by_t": by_t}
        return result


# --- the fixtures ------------------------------------------------------------------------------

def batches(fixture, model, px: int):
    """(t, sigma, noisy latents, text tokens, pooled or None) per noise level and seed: the
    held-out photos x the eval captions (batch 8)."""
    import torch

    import photo_fixtures as pf

    photos = pf.held_out_images(px)
    clean = model.process_latent_in(fixture.vae.encode(photos)).float()
    captions = list(pf.EVAL_CAPTIONS)
    clean = clean.repeat_interleave(len(captions), 0)  # (photo, caption)
    tokens = torch.cat([fixture.conditioning(c)[0][0] for c in captions]).repeat(len(photos), 1, 1)
    pooled = tokens.mean(1) if fixture.spec.pooled else None
    sigmas = model.model_sampling.sigmas
    for t in T_FRACTIONS:
        sigma = sigmas[int(len(sigmas) * t)].reshape(1).repeat(len(clean)).float()
        for seed in NOISE_SEEDS:
            noise = torch.randn(clean.shape, generator=torch.Generator().manual_seed(seed))
            yield t, sigma, model.model_sampling.noise_scaling(sigma, noise, clean), tokens, pooled


def run(model, fixture, px: int, capture: Capture) -> dict:
    """Every batch through ``model.apply_model`` with ``capture`` as the attention override;
    returns t -> sigma."""
    import torch

    sigmas = {}
    with torch.no_grad():
        for t, sigma, noisy, tokens, pooled in batches(fixture, model, px):
            capture.tag = t
            sigmas[str(t)] = round(float(sigma[0]), 5)
            extras = {"y": pooled} if pooled is not None else {}
            model.apply_model(noisy, sigma, c_crossattn=tokens,
                              transformer_options={"optimized_attention_override": capture}, **extras)
    return sigmas


def capture_for(model, px: int) -> Capture:
    """A Capture knowing the model's image grid and token order (Flux; UNets say theirs)."""
    import photo_fixtures as pf

    net = model.diffusion_model
    doubles = getattr(net, "double_blocks", None)
    if doubles is None:
        return Capture()
    patch = net.patch_size
    side = px // pf.PATCH // patch
    return Capture(grid=(side, side), text_first=not getattr(doubles[0], "flipped_img_txt", False))


def random_model(spec):
    import photo_fixtures as pf
    import random_models

    return random_models.build_random(lambda: pf.build(spec)[0], RANDOM_SEED).eval()


def measure_fixture(name: str) -> dict:
    import photo_fixtures as pf

    fixture = pf.load(name)
    px = fixture.spec.native_px
    out = {"px": px, "layers": {}}
    for kind, model in (("trained", fixture.patcher.model), ("random", random_model(fixture.spec))):
        capture = capture_for(model, px)
        started = time.perf_counter()
        out["sigmas"] = run(model, fixture, px, capture)
        out.setdefault("seconds", {})[kind] = round(time.perf_counter() - started, 1)
        for label, values in capture.summary().items():
            layer = out["layers"].setdefault(label, dict(capture.layers[label]))
            layer[kind] = values
    return out


# --- the report --------------------------------------------------------------------------------

def _f(value, digits=3) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def grid_text(layer: dict) -> str:
    h, w = layer["grid"]
    text = f"{h}x{w}"
    if layer.get("downsample"):
        text += f" (1/{layer['downsample']})"
    if layer.get("text_tokens"):
        text += f" + {layer['text_tokens']} text"
    return text


def layer_table(caption: str, columns: list[str], result: dict, cells) -> str:
    """A markdown table, a row per layer: its label, its grid, then ``cells(metrics)`` (one per
    column) for the trained weights and again for the random ones."""
    header = ["layer", "grid", *(f"{kind}: {column}" for kind in ("trained", "random") for column in columns)]
    lines = [caption, "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label, layer in result["layers"].items():
        lines.append("| " + " | ".join([label, grid_text(layer), *cells(layer["trained"]), *cells(layer["random"])])
                     + " |")
    return "\n".join(lines)


def table(name: str, result: dict) -> str:
    text = any(layer.get("text_tokens") for layer in result["layers"].values())
    caption = (f"**{name}** ({result['px']} px; mean over 2 held-out photos x 4 captions x 2 seeds x t = "
               f"{', '.join(map(str, T_FRACTIONS))}; ToDo change: the attention output's RMS change under ToDo's "
               "nearest 2x2 pooling, in units of the values' spread)")
    columns = ["top weight", "entropy / max", "2x2 kept", "ToDo change", *(["on text"] if text else [])]
    return layer_table(caption, columns, result, lambda m: [
        _f(m["top"], 4), f"{_f(m['entropy'], 2)} / {_f(m['max_entropy'], 2)}", _f(m["top_kept_2x2"], 2),
        _f(m["todo_change_nearest"], 3), *([_f(m["text_mass"])] if text else [])])


def _pct(value) -> str:
    return "—" if value is None else f"{100 * value:.{1 if value < 0.1 else 0}f} %"


def kind_table(name: str, result: dict) -> str:
    """Per layer, trained and random: the kind of peak and the metrics that decide it."""
    caption = (f"**{name}**, kind of peak (shared 16: a query's mass on the 16 keys heaviest over all queries; own "
               "16: on its own 16 heaviest; same top key: the queries whose top key is the most picked key; within "
               "r1 / r2: the mass within Chebyshev distance 1 / 2 of the query on the grid; top within 1: the "
               f"queries whose top key is within one grid step; kind: a set holds the peak at {PEAK_EXCESS} above "
               f"its uniform share, local also needs top within 1 >= {NEAR_TOP})")
    columns = ["kind", "shared 16 (uniform)", "own 16", "same top key", "within r1 (uniform)", "within r2 (uniform)",
               "top within 1"]
    return layer_table(caption, columns, result, lambda m: [
        m.get("kind") or "—", f"{_pct(m.get('shared_top16'))} ({_pct(m.get('shared_uniform'))})",
        _pct(m.get("own_top16")), _pct(m.get("top_shared")),
        *(f"{_pct(m.get(f'local_r{r}'))} ({_pct(m.get(f'local_r{r}_uniform'))})" for r in LOCAL_RADII),
        _pct(m.get("top_near"))])


def load_host(comfyui: Path) -> None:
    import torch

    for path in (str(comfyui), str(REPO), str(REPO / "devtools")):
        if path not in sys.path:
            sys.path.insert(0, path)
    from comfy.cli_args import args

    args.cpu = not torch.cuda.is_available()
    import comfy.model_management  # noqa: F401


def main(argv: list[str], comfyui: Path | None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peakedness", action="store_true", help="this measurement (the flag that selects it)")
    p.add_argument("--fixtures", nargs="+", default=list(FIXTURES), choices=FIXTURES)
    p.add_argument("--out", type=Path, default=OUT, help="the JSON written")
    args = p.parse_args(argv)
    load_host(comfyui)
    import torch

    from comfy_server import comfyui_version

    started = time.perf_counter()
    results = {}
    for name in args.fixtures:
        results[name] = measure_fixture(name)
        print(table(name, results[name]), "\n", flush=True)
        print(kind_table(name, results[name]), "\n", flush=True)
    import photo_fixtures as pf

    record = {
        "what": "attention peakedness per self-attention layer of the trained photo fixtures and of random weights "
                "of the same architecture, and the kind of each layer's peak (devtools/benchmark.py --peakedness, "
                "devtools/bench/peakedness.py; issues #44, #50)",
        "metrics": {
            "top": "mean over image-token queries (and heads, batch) of the largest attention weight",
            "entropy": "mean attention entropy in nats; max_entropy = ln(keys)",
            "self": "mean weight on the query's own position",
            "top_kept_2x2": "under 2x2 average pooling of image keys and values (text keys whole): the weight the "
                            "query's top key's value still gets (pooled cell weight / 4) over its unpooled weight",
            "text_mass": "mean attention mass of image queries on text tokens (Flux)",
            "todo_change_nearest": "RMS change of the image queries' attention output (before the output "
                                   "projection) when image keys and values are pooled 2x2 as ToDo does by default "
                                   "(downsample_tokens, nearest: every other row and column), text kept whole, in "
                                   "units of the RMS of the image tokens' values less their mean over the tokens",
            "todo_change_average": "the same with 2x2 average pooling (ToDo's method average)",
            "shared_top16": f"mean mass of an image query on the {SHARED_KEYS} keys of largest attention mass summed "
                            "over all image queries (per head and batch element; text keys included)",
            "shared_top1": "the same for the single heaviest key",
            "shared_uniform": f"{SHARED_KEYS} / keys: what uniform attention puts on any {SHARED_KEYS} keys",
            "top_shared": "share of image queries whose top key is the key most queries have as their top key "
                          "(per head and batch element)",
            "own_top16": f"mean mass of an image query on its own {SHARED_KEYS} heaviest keys",
            **{f"local_r{r}": f"mean mass of an image query on the image keys within Chebyshev distance {r} of its "
                              "own grid position" for r in LOCAL_RADII},
            **{f"local_r{r}_uniform": f"what uniform attention puts on that distance-{r} neighbourhood, averaged "
                                      "over the queries (border queries have fewer neighbours)" for r in LOCAL_RADII},
            "top_near": "share of image queries whose top key is an image key within Chebyshev distance 1",
            "kind": f"peak_kind: sink where shared_top16 - shared_uniform >= {PEAK_EXCESS}; local where local_r2 - "
                    f"local_r2_uniform >= {PEAK_EXCESS} and top_near >= {NEAR_TOP}; 'sink + local' both; scattered "
                    f"where neither but own_top16 - shared_uniform >= {PEAK_EXCESS}; flat otherwise",
        },
        "inputs": {"photos": [ph.name for ph in pf.PHOTOS if ph.held_out], "captions": list(pf.EVAL_CAPTIONS),
                   "noise_seeds": list(NOISE_SEEDS), "t": list(T_FRACTIONS), "random_weights_seed": RANDOM_SEED},
        "host": {"comfyui": comfyui_version(comfyui), "torch": torch.__version__,
                 "attention": __import__("comfy.ldm.modules.attention", fromlist=["x"]).optimized_attention.__name__,
                 "device": str(__import__("comfy.model_management", fromlist=["x"]).get_torch_device())},
        "fixtures": results,
        "seconds": round(time.perf_counter() - started, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out} in {record['seconds']} s")
    return 0
