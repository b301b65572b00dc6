"""The model families the benchmark builds with random weights: how to build one, its text
conditioning, and how its latent relates to the image. Nothing here assumes a UNet: the
latent's channels and dimensions are read from the model's own latent format, so a DiT
(image or video) is one more entry in ``FAMILIES``."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable


@dataclass(frozen=True)
class Family:
    name: str
    build: Callable  # (tiny, seed, dtype) -> ModelPatcher with random weights
    conditioning: Callable  # (tiny, seed) -> a conditioning in ComfyUI's format
    tiny_only: bool = False  # no full-size layout to build
    downscale: int = 8  # image pixels per latent pixel, each side
    frames: int = 1  # latent frames of a video family (latent_dimensions 3); --frames overrides
    gpu_only_full_size: bool = False  # full size does not fit a CPU run (weights of tens of GB)
    # its conditioning carries inputs sized for the latent: made for each latent the benchmark
    # times, conditioning(tiny, seed, shape=latent shape)
    sized: bool = False
    audio: bool = False  # an audio latent beside the video (LTX-2: a nested latent, bench.step.with_audio)

    def step_conditioning(self, tiny: bool):
        """The (positive, negative) OneStep takes: made for each latent timed (a function of its
        shape) where the family sizes inputs for the latent, else made once."""
        if self.sized:
            return lambda shape: tuple(self.conditioning(tiny, seed, shape=shape) for seed in (1, 2))
        return self.conditioning(tiny, 1), self.conditioning(tiny, 2)


def _unet(family: str, tiny: bool, seed: int, dtype):
    import random_models

    return random_models.make_model(family, tiny=tiny, seed=seed, dtype=dtype)


def _unet_conditioning(family: str, tiny: bool, seed: int) -> list:
    import random_models

    return random_models.conditioning(family, tiny, seed=seed)


# The DiTs with --tiny: tiny random-weight models of the families ToDo supports (devtools/random_dits.py),
# a few blocks deep so that blocks remain between the first and last ones ToDo leaves alone
# (skip_first_blocks / skip_last_blocks). Their text is shorter than real prompts (12 tokens;
# Wan's T5 pads to 512 as in ComfyUI) and their width (64 per head group) a fraction of the real
# ones, so attention, whose cost grows with the tokens squared, takes a larger share of their
# forward than of a real model's: read their speed-ups with their Amdahl columns.
DIT_DEPTH = {
    "sd3": {"depth": 4,  # MMDiT's width is 64 per block: the text projection must match it
            "context_embedder_config": {"target": "torch.nn.Linear",
                                        "params": {"in_features": 32, "out_features": 256}},
            "pos_embed_max_size": 64, "num_patches": 64 * 64},  # positions for up to 1024 px
    "flux_dev": {"depth": 2, "depth_single_blocks": 4},
    "wan21_t2v": {"num_layers": 6},
    # the other families ToMe merges whole blocks of (--tome-dit), as deep as Flux.1 and Wan 2.1 here
    "flux2": {"depth": 2, "depth_single_blocks": 4},
    "chroma": {"depth": 2, "depth_single_blocks": 4},
    "qwen_image": {"num_layers": 6},
    "hunyuan_video": {"depth": 2, "depth_single_blocks": 4},
    "hunyuan_video15": {"depth": 2, "depth_single_blocks": 4},
    "lumina2": {"n_layers": 4, "n_refiner_layers": 2},
    "z_image": {"n_layers": 4, "n_refiner_layers": 2},
}
WAN_LATENT_FRAMES = 5  # 17 video frames

# Without --tiny: the released models' layouts (the unet_config ComfyUI's detection reads off their
# files), random weights, for speed on a GPU. Flux.1 [dev]: 12B parameters, 19 double and 38
# single blocks of width 3072, T5-XXL text (4096) and CLIP-L pooled (768). Wan 2.1 1.3B: 30 blocks
# of width 1536, T5 text (4096). Their text: the test models' 12 (Flux) and Wan's 512 tokens.
DIT_FULL_SIZE = {
    "flux_dev": {"hidden_size": 3072, "num_heads": 24, "depth": 19, "depth_single_blocks": 38,
                 "context_in_dim": 4096, "vec_in_dim": 768, "axes_dim": [16, 56, 56]},
    "wan21_t2v": {"dim": 1536, "ffn_dim": 8960, "num_heads": 12, "num_layers": 30, "text_dim": 4096},
}
FULL_SIZE_TEXT = {"flux_dev": {"text_dim": 4096, "pooled_dim": 768}, "wan21_t2v": {"text_dim": 4096}}


def _dit(family: str, tiny: bool, seed: int, dtype):
    import random_dits

    if not random_dits.available(family):  # a family of later ComfyUI trees only
        raise SystemExit(f"{family}: this ComfyUI has no {random_dits.FAMILY_SPECS[family].config}; "
                         f"run the benchmark with --comfyui PATH of a tree that has it")
    layout = DIT_DEPTH[family] if tiny else DIT_FULL_SIZE[family]
    return random_dits.make_dit(family, seed=seed, dtype=dtype, **layout)


def _dit_conditioning(family: str, tiny: bool, seed: int, shape: list | None = None) -> list:
    """Its text conditioning; with the latent's ``shape``, the inputs the family sizes for the
    latent (reference, motion and control frames, audio embeddings) sized for that latent."""
    import random_dits

    widths = {} if tiny else FULL_SIZE_TEXT[family]
    size = dict(frames=4 * WAN_LATENT_FRAMES - 3)
    if shape is not None:
        spec = random_dits.FIXTURES[family].spec if family in random_dits.FIXTURES else random_dits.FAMILY_SPECS[family]
        size = dict(height_px=shape[-2] * spec.space_down, width_px=shape[-1] * spec.space_down,
                    frames=(shape[2] - 1) * spec.time_down + 1 if len(shape) == 5 else 1)
    positive, _ = random_dits.conditioning(family, seed=seed, **size, **widths)
    return positive


FAMILIES: dict[str, Family] = {
    name: Family(name, partial(_unet, name), partial(_unet_conditioning, name)) for name in ("SD15", "SDXL", "SD21")
}
FAMILIES.update({
    "SD3": Family("SD3", partial(_dit, "sd3"), partial(_dit_conditioning, "sd3"), tiny_only=True),
    "Flux": Family("Flux", partial(_dit, "flux_dev"), partial(_dit_conditioning, "flux_dev"),
                   gpu_only_full_size=True),
    "Wan21": Family("Wan21", partial(_dit, "wan21_t2v"), partial(_dit_conditioning, "wan21_t2v"),
                    frames=WAN_LATENT_FRAMES),
    "Flux2": Family("Flux2", partial(_dit, "flux2"), partial(_dit_conditioning, "flux2"), tiny_only=True,
                    downscale=16),
    "Chroma": Family("Chroma", partial(_dit, "chroma"), partial(_dit_conditioning, "chroma"), tiny_only=True),
    "QwenImage": Family("QwenImage", partial(_dit, "qwen_image"), partial(_dit_conditioning, "qwen_image"),
                        tiny_only=True),
    "HunyuanVideo": Family("HunyuanVideo", partial(_dit, "hunyuan_video"), partial(_dit_conditioning, "hunyuan_video"),
                           tiny_only=True, frames=WAN_LATENT_FRAMES),
    "HunyuanVideo15": Family("HunyuanVideo15", partial(_dit, "hunyuan_video15"),
                             partial(_dit_conditioning, "hunyuan_video15"), tiny_only=True, downscale=16,
                             frames=WAN_LATENT_FRAMES),
    "Lumina2": Family("Lumina2", partial(_dit, "lumina2"), partial(_dit_conditioning, "lumina2"), tiny_only=True),
    "ZImage": Family("ZImage", partial(_dit, "z_image"), partial(_dit_conditioning, "z_image"), tiny_only=True),
})


# The families whose tiny fixtures live in devtools/dit_fixtures/ (--tiny only), by their fixture
# name; those whose conditioning carries image inputs sized for the test latent (i2v images, VACE
# frames, references) are left out: the benchmark's sizes would not fit them; so are those whose
# latent is not the plain one the benchmark makes (a 5-D image latent: the HunyuanImage 2.1
# refiner; a latent of their own: MiniMax-H3's video + audio, FlowRVS's image). Except those
# the benchmark makes such inputs for, for each latent it times (SIZED_FIXTURES).
_DEPTH_KEYS = ("num_layers", "depth", "n_layers", "num_blocks", "layers", "num_visual_blocks", "patch_depth")


def _fixture_depth(fixture) -> dict:
    if fixture.deep is not None:
        return fixture.deep
    key = next((key for key in _DEPTH_KEYS if isinstance(fixture.config.get(key), int)), None)
    return {} if key is None else {key: 4}


# {fixture: its latent}: Wan S2V's conditioning (audio embedding, reference frame, motion frames,
# control video), Wan VACE's control frames and mask, Wan SCAIL's pose video and reference,
# Mage-Flow's and JoyImage's reference images, made for each latent timed, beside the plain latent
# (Krea 2 and JoyImage: the 5-D image latent their latent format asks for, one frame); LTX-2 with
# its audio latent beside the video (the nested latent LTXVConcatAVLatent makes, audio of the
# video's length).
SIZED_FIXTURES = {"wan22_s2v": "plain", "wan21_vace": "plain", "wan21_scail": "plain", "mage_flow": "plain",
                  "joyimage": "plain", "krea2": "plain", "ltxav": "audio"}


def _fixture_families() -> dict:
    import random_dits

    found = {}
    for name, fixture in random_dits.FIXTURES.items():
        sized = SIZED_FIXTURES.get(name)
        if (fixture.shared is not None or fixture.spec.five_d or fixture.latent is not None) and sized is None:
            continue
        DIT_DEPTH[name] = _fixture_depth(fixture)
        found[name] = Family(name, partial(_dit, name), partial(_dit_conditioning, name), tiny_only=True,
                             downscale=fixture.spec.space_down,
                             frames=WAN_LATENT_FRAMES if fixture.spec.video else 1,
                             sized=fixture.shared is not None, audio=sized == "audio")
    return found


try:
    FAMILIES.update(_fixture_families())
except ImportError:  # outside a host (no comfy to import): the built-in ones
    pass


def parse_size(text: str) -> int | str:
    """A ``--sizes`` entry: ``1024`` (square, kept an int as in older results) or ``832x480``
    (width x height px, kept as that text)."""
    width, x, height = text.lower().partition("x")
    height = height if x else width
    if not (width.isdigit() and height.isdigit() and int(width) >= 8 and int(height) >= 8):
        raise ValueError(f"{text!r}: a size is px (1024) or width x height px (832x480)")
    return int(width) if int(height) == int(width) else f"{int(width)}x{int(height)}"


def dims(size: int | str) -> tuple[int, int]:
    """(width, height) px of a size."""
    if isinstance(size, int):
        return size, size
    width, height = size.split("x")
    return int(width), int(height)


def size_label(size: int | str) -> str:
    return "{}x{}".format(*dims(size))


def latent_shape(model, batch: int, size: int | str, downscale: int = 8, frames: int = 1) -> tuple[int, ...]:
    """The latent of an image of ``size`` (or a video of ``frames`` latent frames) for this
    model, from its latent format."""
    latent_format = model.get_model_object("latent_format")
    width, height = (side // downscale for side in dims(size))
    if getattr(latent_format, "latent_dimensions", 2) == 3:
        return (batch, latent_format.latent_channels, frames, height, width)
    return (batch, latent_format.latent_channels, height, width)
