"""Short real training runs that confirm and refine a plan: the shipped training script under each candidate's
emitted files, one process group per run, cached on disk."""

from probes.runner import DEFAULT_TIMEOUT_S, Prober, run_training

__all__ = ["Prober", "run_training", "DEFAULT_TIMEOUT_S", "cuda_available"]


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
