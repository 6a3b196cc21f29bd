"""Command-line entry points (Hydra apps run under torchrun or plain python)."""
