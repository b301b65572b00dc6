"""A custom node pack for the end-to-end tests only (never installed for users): random text
conditioning in the shape a DiT family's text encoders give, linked into the test server's
``custom_nodes`` next to TokenReduce (see server_helpers.link_test_nodes).

Why: the DiT graphs of the end-to-end tests (Wan 2.1 and its VACE, Flux.1, LTX-Video) need
CONDITIONING from their text encoders, and none can be had where the tests run. No trained
weights can be downloaded, and a random-weight T5-XXL (4.7 G parameters, the encoder of Wan's
umt5-xxl and of Flux's and LTX-Video's t5xxl) is far too big to build and run on the CPU
machines the suite runs on. What the diffusion model sees of a prompt is only this tensor (and,
for Flux, CLIP-L's pooled vector; for LTX-Video, the tokens' mask), so random values of the
right shape exercise the same paths through the sampler and our node. Plain V1 nodes: they load
the same in every ComfyUI version the suite covers.

The VACE graph's WanVaceToVideo encodes its control video (grey where none is given) with the
Wan VAE, which cannot be had either (its loader builds the full-size VAE): its stand-in stores
random VACE frames and mask of the shapes it gives, with the same outputs.

The A/B graphs of Flux and Wan compare two decoded images; their VAEs cannot be had either: the
latent preview stands in for VAEDecode (ComfyUI's own latent-to-RGB preview map).
"""

import torch

T5_XXL = 4096  # T5-XXL / umt5-xxl hidden size (Wan 2.1, Flux.1, LTX-Video)
CLIP_L_POOLED = 768  # CLIP-L pooled output (Flux.1)
WAN_TOKENS = 512  # Wan's umt5 tokenizer pads every prompt to 512 tokens
LTXV_TOKENS = 128  # LTX-Video's T5 tokenizer pads every prompt to at least 128 tokens
LTX2_CONTEXT = 64  # the tiny LTX-2's processed text width: twice its caption_channels (dit_fixtures/ltx2.py)
LTX2_AUDIO = (8, 16)  # LTX-2's audio latent: 8 channels x 16 frequency bins, 25 latent frames a second


class RandomDiTConditioning:
    """CONDITIONING as CLIPTextEncode with the family's text encoders would give it, random."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "family": (["wan", "flux", "ltxv", "ltx2"],),
            "seed": ("INT", {"default": 0, "min": 0, "max": 2 ** 31 - 1}),
            "tokens": ("INT", {"default": 16, "min": 1, "max": 512,
                               "tooltip": "Text tokens (Flux; LTX-Video: unmasked of its 128; Wan "
                                          "always has 512)."}),
        }}

    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "encode"
    CATEGORY = "_for_testing"

    def encode(self, family, seed, tokens):
        generator = torch.Generator().manual_seed(seed)
        if family == "wan":
            return ([[torch.randn(1, WAN_TOKENS, T5_XXL, generator=generator), {}]],)
        if family == "ltxv":  # T5-XXL tokens and their mask (LTXV's encoder gives one)
            mask = torch.zeros(1, max(LTXV_TOKENS, tokens), dtype=torch.long)
            mask[:, :tokens] = 1
            return ([[torch.randn(1, mask.shape[1], T5_XXL, generator=generator), {"attention_mask": mask}]],)
        if family == "ltx2":  # the text connectors' output, video and audio halves (the tests' tiny LTX-2)
            return ([[torch.randn(1, tokens, LTX2_CONTEXT, generator=generator), {}]],)
        context = torch.randn(1, tokens, T5_XXL, generator=generator)
        return ([[context, {"pooled_output": torch.randn(1, CLIP_L_POOLED, generator=generator)}]],)


class RandomVaceConditioning:
    """WanVaceToVideo without its VAE: the text conditioning with ``vace_frames`` (inactive and
    reactive frame latents, 16 + 16 channels), ``vace_mask`` (the pixel mask folded 8x8 into 64
    channels) and ``vace_strength`` appended as it stores them, random, at the latent's size; the
    empty latent; the latent frames to trim (``reference``: one reference-image frame first)."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "positive": ("CONDITIONING",),
            "negative": ("CONDITIONING",),
            "width": ("INT", {"default": 832, "min": 16, "max": 4096, "step": 16}),
            "height": ("INT", {"default": 480, "min": 16, "max": 4096, "step": 16}),
            "length": ("INT", {"default": 81, "min": 1, "max": 4096, "step": 4}),
            "batch_size": ("INT", {"default": 1, "min": 1, "max": 64}),
            "strength": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 1000.0, "step": 0.01}),
            "reference": ("BOOLEAN", {"default": False}),
            "seed": ("INT", {"default": 0, "min": 0, "max": 2 ** 31 - 1}),
        }}

    RETURN_TYPES = ("CONDITIONING", "CONDITIONING", "LATENT", "INT")
    RETURN_NAMES = ("positive", "negative", "latent", "trim_latent")
    FUNCTION = "encode"
    CATEGORY = "_for_testing"

    def encode(self, positive, negative, width, height, length, batch_size, strength, reference, seed):
        generator = torch.Generator().manual_seed(seed)
        frames = (length - 1) // 4 + 1 + int(reference)
        size = [frames, height // 8, width // 8]
        latent = torch.randn([1, 32, *size], generator=generator)
        mask = (torch.rand([1, 64, *size], generator=generator) > 0.5).float()
        if reference:  # WanVaceToVideo: the reference frame's latent and zeros, unmasked
            mask[:, :, 0] = 0.0
        values = {"vace_frames": [latent], "vace_mask": [mask], "vace_strength": [strength]}

        def append(conditioning):
            out = []
            for context, extras in conditioning:
                extras = dict(extras)
                for key, value in values.items():
                    extras[key] = extras.get(key, []) + value
                out.append([context, extras])
            return out

        empty = {"samples": torch.zeros([batch_size, 16, *size])}
        return append(positive), append(negative), empty, int(reference)


class EmptyLTX2AudioLatent:
    """LTXVEmptyLatentAudio without its audio VAE (which cannot be had here: its loader reads the
    LTX-2 checkpoint): zeros of LTX-2's audio latent shape, round(frames / frame_rate * 25) latent
    frames of 8 channels x 16 bins, as that node gives them."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "frames_number": ("INT", {"default": 97, "min": 1, "max": 1000}),
            "frame_rate": ("FLOAT", {"default": 25.0, "min": 1.0, "max": 1000.0}),
            "batch_size": ("INT", {"default": 1, "min": 1, "max": 4096}),
        }}

    RETURN_TYPES = ("LATENT",)
    FUNCTION = "empty"
    CATEGORY = "_for_testing"

    def empty(self, frames_number, frame_rate, batch_size):
        channels, bins = LTX2_AUDIO
        frames = round(frames_number / frame_rate * 25)
        return ({"samples": torch.zeros(batch_size, channels, frames, bins), "type": "audio"},)


class LatentPreviewImage:
    """VAEDecode without the VAE, for the A/B examples of Flux and Wan (whose VAEs cannot be had:
    their loaders build the full-size models): the latent mapped to RGB by the family's latent
    format's ``latent_rgb_factors``, the linear map ComfyUI's own live previews use
    (latent_preview.Latent2RGBPreviewer), each latent pixel 8x8 pixels, each latent frame of a
    video one image of the batch. Enough to compare two samplers' outputs as images."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"samples": ("LATENT",), "family": (["flux", "wan"],)}}

    RETURN_TYPES = ("IMAGE",)
    FUNCTION = "preview"
    CATEGORY = "_for_testing"

    def preview(self, samples, family):
        import comfy.latent_formats

        latent_format = comfy.latent_formats.Flux() if family == "flux" else comfy.latent_formats.Wan21()
        latent = samples["samples"].float()
        if latent.ndim == 5:  # [B, C, T, H, W] -> the frames as images
            latent = latent.movedim(2, 1).flatten(0, 1)
        factors = torch.tensor(latent_format.latent_rgb_factors).T  # [3, C]
        bias = torch.tensor(latent_format.latent_rgb_factors_bias)
        rgb = torch.nn.functional.linear(latent.movedim(1, -1), factors, bias)
        image = ((rgb + 1.0) / 2.0).clamp(0.0, 1.0)
        return (image.repeat_interleave(8, dim=1).repeat_interleave(8, dim=2),)


NODE_CLASS_MAPPINGS = {"TokenReduceTestDiTConditioning": RandomDiTConditioning,
                       "TokenReduceTestVaceConditioning": RandomVaceConditioning,
                       "TokenReduceTestLTX2AudioLatent": EmptyLTX2AudioLatent,
                       "TokenReduceTestLatentPreviewImage": LatentPreviewImage}
NODE_DISPLAY_NAME_MAPPINGS = {"TokenReduceTestDiTConditioning": "Random DiT conditioning (TokenReduce tests)",
                              "TokenReduceTestVaceConditioning": "Random VACE conditioning (TokenReduce tests)",
                              "TokenReduceTestLTX2AudioLatent": "Empty LTX-2 audio latent (TokenReduce tests)",
                              "TokenReduceTestLatentPreviewImage": "Latent preview image (TokenReduce tests)"}
