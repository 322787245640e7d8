"""The wheels a lent GPU machine needs to run benchmarks/gpu_validation.py, fetched here into .whl/ (git-ignored):
what the machine's image lacks of trainplan's own requirements (pydantic and its parts) and of the packages the
validation's configurations need (DeepSpeed for ZeRO-2 with offload, bitsandbytes for QLoRA, Liger-Kernel, torchao
for float8), pinned to the versions installed here, for the machine's Python (3.12) and processor (x86-64).

    python -m benchmarks.device_wheels            # fills .whl/ (binary wheels; DeepSpeed, published as a source
                                                  # archive only, is built into a wheel here)
    python -m benchmarks.device_wheels --list     # what it would fetch

Then, on the machine (the `run` of the device tool, with `.whl` carried):

    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl \\
      && PYTHONPATH=/tmp/site:$PYTHONPATH HF_HUB_OFFLINE=1 python3 benchmarks/gpu_validation.py --out $OUT
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / ".whl"
#: What the image lacks (its package list: the device tool's KINDS.md): trainplan's requirements and the
#: validation's optional packages, with what each of them needs beyond the image.
MISSING = ("pydantic", "pydantic-core", "annotated-types", "typing-inspection", "deepspeed", "hjson", "bitsandbytes",
           "liger-kernel", "torchao")
#: Published as a source archive only: built into a (pure Python) wheel here; its CUDA ops compile on first use there.
SOURCE_ONLY = ("deepspeed",)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
PYTHON = "3.12"


def pinned() -> list[str]:
    """Each missing package at the version installed here (`name==version`); those not installed here by name."""
    out = []
    for name in MISSING:
        try:
            out.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            out.append(name)
    return out


def commands(packages: list[str]) -> list[list[str]]:
    """The pip commands that fetch `packages` into WHEELS."""
    binary = [p for p in packages if p.split("==")[0] not in SOURCE_ONLY]
    source = [p for p in packages if p.split("==")[0] in SOURCE_ONLY]
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    out = [[sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", PYTHON,
            "--implementation", "cp", *platforms, "-d", str(WHEELS), *binary]]
    out += [[sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(WHEELS), p] for p in source]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print the commands, fetch nothing")
    args = parser.parse_args(argv)
    for command in commands(pinned()):
        print(" ".join(command))
        if not args.list:
            subprocess.run(command, check=True)  # noqa: S603 - a fixed pip command, no shell
    return 0


if __name__ == "__main__":
    sys.exit(main())
