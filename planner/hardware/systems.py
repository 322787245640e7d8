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
    return {name: HostSystem(**entry) for name, entry in data["systems"].items()}


def usual_system(gpu_name: str) -> HostSystem:
    """The usual system of a catalog GPU (every catalog GPU has one: tests/test_hardware.py)."""
    return _systems()[gpu_name]
