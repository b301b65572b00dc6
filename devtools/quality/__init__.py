"""Image-quality measurements for the project's quality tables (same seed, with and without a reduction)."""
