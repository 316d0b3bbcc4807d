"""Attention backends (`attn_implementation`): FlexAttention paths and our Triton / Gluon prefill and decode kernels."""
