"""The system each catalog GPU usually comes in (systems.json, one source per entry): its host RAM per node, which CPU
offload is checked against when the plan is for another machine and --host-memory is not given."""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources

from pydantic import BaseModel, ConfigDict

UNIT_BYTES = {"GB": 10**9, "GiB": 2**30}


class HostSystem(BaseModel):
    """A GPU's usual system: its name, GPU count and host RAM per node, with the source that states it."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    system: str
    gpus: int
    host_memory: float
    unit: str
    source: str
    quote: str
    #: other systems with this GPU (more or fewer GPUs to a node), each with its source
    alternatives: tuple[HostSystem, ...] = ()

    @property
    def host_memory_bytes(self) -> int:
        return int(self.host_memory * UNIT_BYTES[self.unit])

    def host_bytes_for(self, gpus_per_node: int) -> int:
        """Host RAM of a node with `gpus_per_node` GPUs: the system's, or proportionally more where the node has more
        GPUs than the system (several such systems' worth)."""
        return int(self.host_memory_bytes * max(1.0, gpus_per_node / self.gpus))


@lru_cache(maxsize=1)
def _systems() -> dict[str, HostSystem]:
    data = json.loads(resources.files("planner.hardware").joinpath("systems.json").read_text())
    # an alternative whose figure names no source is kept in the file but not assumed
    return {name: HostSystem(**{**entry, "alternatives": [a for a in entry.get("alternatives", ()) if a.get("source")]})
            for name, entry in data["systems"].items()}


def usual_system(gpu_name: str) -> HostSystem:
    """The usual system of a catalog GPU (every catalog GPU has one: tests/test_hardware.py)."""
    return _systems()[gpu_name]


def system_for(gpu_name: str, gpus_per_node: int) -> HostSystem:
    """The system a node of `gpus_per_node` such GPUs is assumed to be: the usual one where it holds them, else the
    smallest listed system that does (a 4-GPU L40S node is a g6e.12xlarge, not four g6e.xlarge), else the largest
    listed (`host_bytes_for` then scales its RAM)."""
    usual = usual_system(gpu_name)
    if gpus_per_node <= usual.gpus:
        return usual
    larger = [s for s in usual.alternatives if s.gpus >= gpus_per_node]
    if larger:
        return min(larger, key=lambda s: (s.gpus, s.host_memory_bytes))
    return max((usual, *usual.alternatives), key=lambda s: (s.gpus, -s.host_memory_bytes))


def node_gpus(gpu_name: str) -> int:
    """The most GPUs a listed system of this GPU holds in one node (1 for a GPU outside the catalog)."""
    try:
        usual = usual_system(gpu_name)
    except KeyError:
        return 1
    return max(s.gpus for s in (usual, *usual.alternatives))
