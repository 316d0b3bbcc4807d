"""The reference model in plain PyTorch: text decoder, ViT, multimodal model, DSpark drafter, checkpoint names.
Fast paths reach it only through the registries of `interfaces`; nothing here imports them."""
