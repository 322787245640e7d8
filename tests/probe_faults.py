"""A training script that misbehaves on purpose, for the probe runner's tests (never shipped):
`accelerate launch ... tests/probe_faults.py MODE --plan DIR --out OUT ...` with MODE hang | crash | oom."""

import sys
import time
from pathlib import Path

from planner.types import Measurement
from probes.protocol import result_line


def main() -> None:
    mode, args = sys.argv[1], sys.argv[2:]
    out = Path(args[args.index("--out") + 1])
    if mode == "hang":
        time.sleep(3600)
    if mode == "crash":
        import os

        os._exit(9)
    if mode == "oom":
        result = Measurement(status="oom", reason="OutOfMemoryError: injected out-of-memory")
        out.mkdir(parents=True, exist_ok=True)
        (out / "rank-0.json").write_text(result.model_dump_json())
        sys.stdout.write(result_line(result))


if __name__ == "__main__":
    main()
