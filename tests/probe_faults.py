"""A probe worker that misbehaves on purpose, for the probe runner's tests (never shipped):
`python tests/probe_faults.py MODE REQUEST.json` with MODE hang | crash | oom."""

import sys
import time

from planner.types import Measurement
from probes.protocol import result_line


def main() -> None:
    mode = sys.argv[1]
    if mode == "hang":
        time.sleep(3600)
    if mode == "crash":
        sys.stdout.flush()
        import os

        os._exit(9)
    if mode == "oom":
        sys.stdout.write(result_line(Measurement(status="oom", reason="OutOfMemoryError: injected out-of-memory")))


if __name__ == "__main__":
    main()
