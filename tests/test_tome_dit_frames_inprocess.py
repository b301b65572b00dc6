"""ToMe on DiTs keeps conditioning frames whole, in the real ComfyUI, in-process on tiny random
models built with ComfyUI's own classes: Wan Phantom's subject frames (``time_dim_concat``,
appended to the video in time), Wan Animate's reference image (its first latent frame), and the
clean first frame of image to video where frames have timesteps of their own (Wan 2.2 TI2V 5B,
LTX-Video: a noise mask), at stride_t 1 and with tiles across frames (LTX-Video at 121 frames with
stride_t 2, Wan at 81 with stride_t 3, the cases where the first frame used to share tiles).

A spy before the node (ours calls it as its inner block) sees what a merged block is given and
the merge it ran with; one around ours on the patched clone sees what the model hands it."""

from __future__ import annotations

import torch

import random_dits
from comfy_helpers import session_of
from test_comfy_dit_inprocess import randn_like
from test_comfy_tome_dit_inprocess import VARIANTS, dits, spy_around, tome  # noqa: F401 (the fixture)

KEY = ("double_block", 1)  # a merged block (the first and last stay whole)


def _spied(comfy, model, **settings):
    """``model`` with ToMe applied between two spies at ``KEY``: (patched model, what the model
    hands the block, what the block is given merged, with the merge in its options)."""
    inside, outside = [], {}
    clone = model.clone()

    def spy(args, extra):
        inside.append((args["img"].clone(), args["transformer_options"].get("tokenreduce:merged grid")))
        return extra["original_block"](args)
    clone.set_model_patch_replace(spy, "dit", *KEY)
    output = tome(comfy, clone, ratio=0.5, **settings)
    patched = spy_around(output.result[0], [KEY], outside)
    return patched, outside.setdefault(KEY, []), inside


def _sample(comfy, model, variant, extras=None, frames=None, latent=None, noise_mask=None):
    """One step of ``variant``'s sampling with ``extras`` added to both conditionings."""
    size = random_dits.tested_size(variant)
    if frames is not None:
        size["frames"] = frames
    positive, negative = random_dits.conditioning(variant, **size)
    positive, negative = ([[c, {**e, **(extras or {})}] for c, e in cond] for cond in (positive, negative))
    latent = random_dits.latent(variant, **size) if latent is None else latent
    with torch.inference_mode():
        out = comfy.sample.sample(model, randn_like(latent, 0), 1, 2.0, "euler", "simple", positive, negative, latent,
                                  seed=0, disable_pbar=True, noise_mask=noise_mask)
    assert torch.isfinite(out).all()
    return latent


def _untouched_outside(given, merged, before, n, after, r):
    """The tokens before and after the grid reach the block as the model hands them; only the
    grid's ``n`` tokens merge (``r`` of them)."""
    assert merged.shape[1] == given.shape[1] - r and given.shape[1] == before + n + after, (merged.shape, given.shape)
    assert torch.equal(merged[:, :before], given[:, :before])
    assert torch.equal(merged[:, merged.shape[1] - after:], given[:, given.shape[1] - after:])


def _first_frame_whole(given, merged, plan, per_frame):
    """The grid's first frame (the grid at the start of the sequence): each of its tokens has a
    merged row of its own that no other token reads and that holds the token as it was."""
    rows = plan.restore_map[:, :per_frame]
    assert all(len(set(row.tolist())) == per_frame for row in rows)
    assert not (plan.restore_map[:, per_frame:, None] == rows[:, None]).any()
    kept = merged.gather(1, rows.unsqueeze(-1).expand(-1, -1, merged.shape[-1]))
    assert torch.equal(kept, given[:, :per_frame])


def test_wan_phantom_subject_frames_never_merge(comfy, dits):
    """WanPhantomSubjectToVideo's subject images (``time_dim_concat``: two latent frames after the
    video's three) are not the video's grid: their tokens reach the merged block as they are, at
    stride_t 1 and with tiles of 2 frames (where the last video frame used to merge with a subject
    frame), and the merged count is the video grid's."""
    model = dits("wan21_t2v")
    n, per_frame = VARIANTS["wan21_t2v"][2], 48
    shape = random_dits.latent("wan21_t2v", **random_dits.tested_size("wan21_t2v")).shape
    subjects = torch.randn(1, 16, 2, *shape[-2:], generator=torch.Generator().manual_seed(4))
    for stride_t in (1, 2):
        patched, outside, inside = _spied(comfy, model, stride_t=stride_t)
        _sample(comfy, patched, "wan21_t2v", {"time_dim_concat": subjects})
        (given,), ((merged, plan),) = outside, inside
        r = int(n * 0.5)
        _untouched_outside(given["img"], merged, 0, n, 2 * per_frame, r)
        assert plan.tokens == n and plan.r == r
        (level,) = session_of(patched).last_report.levels
        assert set(level.tokens.values()) == {(n, n - r)}


def _animate(comfy):
    """A tiny Wan 2.2 Animate (AnimateWanModel, detected as WAN22_Animate) with 4 blocks."""
    import comfy.model_management
    import comfy.model_patcher
    import comfy.supported_models as supported
    from random_models import build_random

    config = supported.WAN22_Animate({**random_dits.unet_config("wan21_t2v"), "model_type": "animate",
                                      "num_layers": 4})
    config.set_inference_dtype(torch.float32, None)
    model = build_random(lambda: config.get_model({}), 0)
    model.eval()
    assert type(model.diffusion_model).__name__ == "AnimateWanModel"
    return comfy.model_patcher.ModelPatcher(model, load_device=comfy.model_management.get_torch_device(),
                                            offload_device=comfy.model_management.unet_offload_device())


def test_wan_animate_reference_frame_never_merges(comfy):
    """WanAnimateToVideo puts the reference image in the first latent frame (the model adds the pose
    to the frames after it): its tokens reach the merged block as they are and the video's frames
    alone merge, at stride_t 1 and 2."""
    model = _animate(comfy)
    size = random_dits.tested_size("wan21_t2v")
    shape = random_dits.latent("wan21_t2v", **size).shape  # [1, 16, 3, H, W]: reference + 2 video frames
    pose = torch.randn(1, 16, shape[2] - 1, *shape[-2:], generator=torch.Generator().manual_seed(5))
    per_frame = 48
    n = (shape[2] - 1) * per_frame
    for stride_t in (1, 2):
        patched, outside, inside = _spied(comfy, model, stride_t=stride_t)
        _sample(comfy, patched, "wan21_t2v", {"pose_video_latent": pose})
        (given,), ((merged, plan),) = outside, inside
        _untouched_outside(given["img"], merged, per_frame, n, 0, plan.r)
        # stride_t 2: the video's own first latent frame (encoded apart, a causal VAE's lone
        # first frame) in no tile either, so fewer than half merge
        assert plan.tokens == n and plan.r == min(int(n * 0.5), plan.tiles.sources) > 0


def _first_frame_mask(latent):
    mask = torch.ones([latent.shape[0], 1, *latent.shape[2:]])
    mask[:, :, :1] = 0.0
    return mask


def test_wan22_ti2v_clean_first_frame_stays_whole(comfy, dits):
    """Wan 2.2 TI2V 5B image to video (Wan22ImageToVideoLatent's noise mask: a timestep per frame,
    the first frame clean): the first frame's tokens are never merged nor merged into, at stride_t
    1, 3 on 3 latent frames, and 3 at 81 frames (21 latent frames, where the first frame used to
    share a tile with the next two)."""
    model = dits("wan22_ti2v_5b")
    for stride_t, frames in ((1, None), (3, None), (3, 81)):
        patched, outside, inside = _spied(comfy, model, stride_t=stride_t)
        size = random_dits.tested_size("wan22_ti2v_5b")
        latent = torch.randn(random_dits.latent_shape("wan22_ti2v_5b", frames=frames or size["frames"],
                                                     height_px=size["height_px"], width_px=size["width_px"]),
                             generator=torch.Generator().manual_seed(2))
        _sample(comfy, patched, "wan22_ti2v_5b", frames=frames, latent=latent, noise_mask=_first_frame_mask(latent))
        (given,), ((merged, plan),) = outside, inside
        per_frame = plan.tokens // latent.shape[2]
        _first_frame_whole(given["img"], merged, plan, per_frame)
        assert plan.r == min(int(plan.tokens * 0.5), plan.tiles.sources)


def test_ltxv_image_to_video_clean_first_frame_stays_whole(comfy, dits):
    """LTX-Video image to video (LTXVImgToVideo's noise mask: a timestep per token, the first frame
    clean) at 121 frames (16 latent frames) with stride_t 2, where the first frame used to share its
    tiles with the second, and at stride_t 1: its tokens are never merged nor merged into."""
    model = dits("ltxv")
    size = random_dits.tested_size("ltxv")
    for stride_t in (2, 1):
        patched, outside, inside = _spied(comfy, model, stride_t=stride_t)
        latent = torch.randn(random_dits.latent_shape("ltxv", frames=121, height_px=size["height_px"],
                                                     width_px=size["width_px"]),
                             generator=torch.Generator().manual_seed(2))
        assert latent.shape[2] == 16
        _sample(comfy, patched, "ltxv", frames=121, latent=latent, noise_mask=_first_frame_mask(latent))
        (given,), ((merged, plan),) = outside, inside
        _first_frame_whole(given["img"], merged, plan, plan.tokens // 16)


def test_wan_vace_first_frame_stays_whole(comfy, dits):
    """Wan VACE: WanVaceToVideo puts its reference image in front of the video as the first latent
    frame, which only the VACE mask's values tell (never read): the first frame is always kept
    whole, never merged nor merged into, at stride_t 1 and 2."""
    model = dits("wan21_vace")
    for stride_t in (1, 2):
        patched, outside, inside = _spied(comfy, model, stride_t=stride_t)
        latent = _sample(comfy, patched, "wan21_vace")
        assert len(outside) == len(inside) > 0  # cond and uncond (their VACE hints differ: not batched)
        for given, (merged, plan) in zip(outside, inside):
            _first_frame_whole(given["img"], merged, plan, plan.tokens // latent.shape[2])
            assert plan.r > 0
