"""The DSpark drafter's checkpoints (the official `mtp.safetensors`) and its training (`inkling2 train-dspark`). The
drafter model is `modeling/modeling_inkling2_dspark.py`; its decoding is `generation/dspark.py`."""
