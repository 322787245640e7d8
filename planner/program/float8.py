"""What float8 training changes in the program: accelerate's AO backend swaps eligible nn.Linear layers for torchao's
Float8Linear (tensorwise dynamic scaling), whose three GEMMs run on FP8 tensor cores while autograd keeps saving the
high-precision input and weight (torchao/float8/float8_linear.py:45). So a float8 step is the bf16-mixed program
(the same traced activations) with those GEMMs at the FP8 rate, six casts per converted layer, their short-lived
float8 copies, and a 1-byte FSDP all-gather of the converted weights. The facts are in planner/facts/float8.json.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from planner import facts
from planner.config import Config
from planner.models.spec import ModelSpec
from planner.vocab import PRECISION

#: bytes of an activation or output gradient element a cast reads (bf16 under autocast)
ACTIVATION_BYTES = 2


def converts(cfg: Config) -> bool:
    return PRECISION[cfg.precision].float8


def torchao_missing() -> str | None:
    """Why `--precision auto` cannot weigh float8 here, or None (the suite treats torchao as absent:
    tests/conftest.py)."""
    return None if importlib.util.find_spec("torchao") is not None else "torchao is not installed here"


@dataclass(frozen=True)
class Float8Linears:
    """The model's nn.Linear shapes and the share of each that accelerate converts (`ModelSpec.float8_linears`)."""

    #: (in_features, out_features, converted, total) per shape
    shapes: tuple[tuple[int, int, int, int], ...]

    @classmethod
    def of(cls, spec: ModelSpec) -> "Float8Linears":
        facts.record("float8.dim_multiple")
        return cls(spec.float8_linears)

    @property
    def converted_layers(self) -> int:
        return sum(c for _i, _o, c, _t in self.shapes)

    @property
    def total_layers(self) -> int:
        return sum(t for _i, _o, _c, t in self.shapes)

    @property
    def converted_weights(self) -> int:
        """Weight elements of the converted layers."""
        return sum(i * o * c for i, o, c, _t in self.shapes)

    def share(self, dims: list[float], scaled: list[bool]) -> float:
        """The share of a traced GEMM ([b, m, n, k], which of them grow with tokens) that runs in float8: a linear
        layer's GEMM has one token dimension and the layer's two weight dimensions (forward, dgrad and wgrad alike)."""
        fixed = sorted(int(d) for d, grows in zip(dims[1:], scaled[1:]) if not grows)
        if dims[0] != 1 or len(fixed) != 2:
            return 0.0
        converted = total = 0
        for i, o, c, t in self.shapes:
            if sorted((i, o)) == fixed:
                converted, total = converted + c, total + t
        return converted / total if total else 0.0

    def cast_traffic(self, tokens: float, weight_bytes: int, compiled: bool) -> tuple[float, float]:
        """Bytes the casts of one micro-step move over `tokens` tokens, and the kernels they launch."""
        casts, traffic = facts.get("float8.casts_per_linear"), facts.get("float8.cast_traffic")
        elements_16 = sum(c * tokens * (casts["input"] * i + casts["grad_output"] * o) for i, o, c, _t in self.shapes)
        elements_w = casts["weight"] * self.converted_weights
        if compiled:
            per_16 = traffic["compiled_reads"] * ACTIVATION_BYTES + traffic["float8_bytes"]
            per_w = traffic["compiled_reads"] * weight_bytes + traffic["float8_bytes"]
            kernels = traffic["compiled_kernels"]
        else:
            per_16 = per_w = traffic["eager_bytes"]
            kernels = traffic["eager_kernels"]
        launches = kernels * sum(casts.values()) * self.converted_layers
        return elements_16 * per_16 + elements_w * per_w, float(launches)

    def transient_bytes(self, tokens: float, compiled: bool) -> int:
        """The float8 copies alive at once around the largest converted layer's backward GEMMs: its output gradient in
        both layouts, its input and weight; eager casts also hold the fp32 copy and its scaled product
        (torchao/float8/float8_training_tensor.py:153) of the operand being cast."""
        converted = [(i, o) for i, o, c, _t in self.shapes if c]
        if not converted:
            return 0
        i, o = max(converted, key=lambda s: s[0] * s[1] + tokens * (s[0] + 2 * s[1]))
        copies = tokens * (2 * o + i) + i * o
        temporaries = 0 if compiled else 2 * 4 * tokens * max(i, o)
        return int(copies * facts.get("float8.cast_traffic")["float8_bytes"] + temporaries)

    def gathered_bytes(self, parameters: int, weight_bytes: int) -> float:
        """Bytes FSDP all-gathers per pass over the model: converted weights as float8 (accelerate's default
        float8 all-gather), the rest at the working weights' width."""
        converted = self.converted_weights
        return converted * facts.get("float8.fsdp_all_gather") + (parameters - converted) * weight_bytes
