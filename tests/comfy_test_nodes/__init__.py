"""A custom node pack for the end-to-end tests only (never installed for users): random text
conditioning in the shape a DiT family's text encoders give, linked into the test server's
``custom_nodes`` next to TokenReduce (see server_helpers.link_test_nodes).

Why: the DiT graphs of the end-to-end tests (Wan 2.1, Flux.1) need CONDITIONING from their text
encoders, and none can be had where the tests run. No trained weights can be downloaded, and a
random-weight T5-XXL (4.7 G parameters, the encoder of both Wan's umt5-xxl and Flux's t5xxl) is far
too big to build and run on the CPU machines the suite runs on. What the diffusion model sees
of a prompt is only this tensor (and, for Flux, CLIP-L's pooled vector), so random values of the
right shape exercise the same paths through the sampler and our node. Plain V1 nodes: they load
the same in every ComfyUI version the suite covers.
"""

import torch

T5_XXL = 4096  # T5-XXL / umt5-xxl hidden size (Wan 2.1, Flux.1)
CLIP_L_POOLED = 768  # CLIP-L pooled output (Flux.1)
WAN_TOKENS = 512  # Wan's umt5 tokenizer pads every prompt to 512 tokens


class RandomDiTConditioning:
    """CONDITIONING as CLIPTextEncode with the family's text encoders would give it, random."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "family": (["wan", "flux"],),
            "seed": ("INT", {"default": 0, "min": 0, "max": 2 ** 31 - 1}),
            "tokens": ("INT", {"default": 16, "min": 1, "max": 512,
                               "tooltip": "Text tokens (Flux; Wan always has 512)."}),
        }}

    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "encode"
    CATEGORY = "_for_testing"

    def encode(self, family, seed, tokens):
        generator = torch.Generator().manual_seed(seed)
        if family == "wan":
            return ([[torch.randn(1, WAN_TOKENS, T5_XXL, generator=generator), {}]],)
        context = torch.randn(1, tokens, T5_XXL, generator=generator)
        return ([[context, {"pooled_output": torch.randn(1, CLIP_L_POOLED, generator=generator)}]],)


NODE_CLASS_MAPPINGS = {"TokenReduceTestDiTConditioning": RandomDiTConditioning}
NODE_DISPLAY_NAME_MAPPINGS = {"TokenReduceTestDiTConditioning": "Random DiT conditioning (TokenReduce tests)"}
