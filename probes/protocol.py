"""What crosses a training run's process boundary: the files `plan --emit` wrote go in (plan.json is read back by
`planner.load_plan`, which validates it); each rank's `planner.types.Measurement` comes out, as one result line on
stdout and a JSON file, and is validated again by the reader."""

from __future__ import annotations

import json

from planner.types import Measurement

#: The result line starts with this; anything else on stdout is the model's and the Trainer's own chatter.
RESULT_PREFIX = "PROBE-RESULT "


def result_line(result: Measurement) -> str:
    return RESULT_PREFIX + result.model_dump_json() + "\n"


def parse_result(stdout: str) -> Measurement | None:
    """The last result line of a run's output, validated, or None."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return Measurement.model_validate(json.loads(line[len(RESULT_PREFIX):]))
    return None
