"""Causal depthwise short convolution with a carried tail (shared by Mamba-2, GKA and the other mixers)."""

from kvfree.kernels.conv.reference import causal_conv1d

__all__ = ["causal_conv1d"]
