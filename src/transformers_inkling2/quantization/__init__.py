"""Routed experts stored as NVFP4 / MXFP8: the formats, the packed expert modules, detection at load, `inkling2
quantize`."""
