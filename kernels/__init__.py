"""Fused kernels for the SDE step and its log-probability (installed as stepfast.kernels)."""
