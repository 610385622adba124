"""Metaserver for vLLM-Ascend's Mooncake layerwise connector (hosted by the control plane)."""
