"""What generate() adds for Inkling2: DSpark decoding and decode steps replayed as CUDA graphs (`hooks` registers
them with the model)."""
