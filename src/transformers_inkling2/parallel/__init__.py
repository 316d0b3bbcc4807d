"""Tensor and expert parallelism (`tp_plan="auto"`) and the per-GPU memory planner (`inkling2 plan`)."""
