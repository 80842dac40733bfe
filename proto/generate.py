"""Generate the Python gRPC stubs for the kubelet APIs under proto/.

Run from anywhere: ``python -m proto.generate`` (or ``make -C proto``). The stubs are committed;
``tests/proto/test_stubs_fresh.py`` fails when they no longer match the .proto files.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

PROTO_DIR = Path(__file__).resolve().parent
REPO_ROOT = PROTO_DIR.parent
PROTO_FILES = (
    PROTO_DIR / "deviceplugin" / "v1beta1" / "api.proto",
    PROTO_DIR / "podresources" / "v1" / "api.proto",
    PROTO_DIR / "dra" / "v1" / "api.proto",
    PROTO_DIR / "pluginregistration" / "v1" / "api.proto",
)


def generate(out_dir: Path) -> None:
    """Write ``*_pb2.py`` and ``*_pb2_grpc.py`` for every API under ``out_dir``.

    Paths are relative to the repository root so the stubs import each other as ``proto.<api>...``.
    """
    include = Path(protoc.__file__).resolve().parent / "_proto"
    for proto in PROTO_FILES:
        relative = proto.relative_to(REPO_ROOT)
        status = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{REPO_ROOT}",
                f"-I{include}",
                f"--python_out={out_dir}",
                f"--grpc_python_out={out_dir}",
                str(relative),
            ]
        )
        if status != 0:
            raise RuntimeError(f"protoc failed with status {status} on {relative}")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO_ROOT)
