"""Short real training steps that confirm and refine a plan: one subprocess per probe, cached on disk."""

from probes.runner import DEFAULT_TIMEOUT_S, Prober, run_probe

__all__ = ["Prober", "run_probe", "DEFAULT_TIMEOUT_S", "cuda_available"]


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
