"""Prints the include directory holding a header from NVIDIA's PyPI packages (nvidia-cuda-runtime,
nvidia-nvml-dev), e.g. `find_headers.py cuda.h`; exits 1 with a message naming the package if absent."""

import sys
from importlib.util import find_spec
from pathlib import Path

PACKAGES = {
    "cuda.h": "nvidia-cuda-runtime",
    "cudaTypedefs.h": "nvidia-cuda-runtime",
    "nvml.h": "nvidia-nvml-dev",
}


def main() -> None:
    header = sys.argv[1]
    spec = find_spec("nvidia")
    roots = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    for root in roots:
        for found in sorted(root.glob(f"**/include/{header}")):
            print(found.parent)
            return
    sys.exit(f"find_headers.py: {header} not found; install the PyPI package {PACKAGES.get(header, '?')}")


if __name__ == "__main__":
    main()
