"""Torch reference kernels (placeholder until filled)."""
