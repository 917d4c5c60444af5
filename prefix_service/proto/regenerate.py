"""Regenerate the committed stubs from proto/prefix_service.proto with grpc_tools.protoc.

The proto is mapped to the virtual path prefix_service/proto/prefix_service.proto, so the
generated _pb2_grpc module imports `prefix_service.proto.prefix_service_pb2` (a package import,
no post-processing) and the descriptor registers under that file name.

    python -m prefix_service.proto.regenerate [--out DIR]   # default: the package itself
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

PROTO_FILE = Path(__file__).resolve().parents[2] / "proto" / "prefix_service.proto"
VIRTUAL_DIR = "prefix_service/proto"
GENERATED = ("prefix_service_pb2.py", "prefix_service_pb2.pyi", "prefix_service_pb2_grpc.py")
PINNED_GRPCIO_TOOLS = "1.62.3"  # keep in step with setup.cfg's test extra


def generate(out_root: Path, proto_file: Path = PROTO_FILE) -> list[Path]:
    """Write the stubs under out_root/prefix_service/proto/ and return their paths."""
    from grpc_tools import protoc

    out_root = Path(out_root)
    (out_root / VIRTUAL_DIR).mkdir(parents=True, exist_ok=True)
    args = ["grpc_tools.protoc", f"-I{VIRTUAL_DIR}={proto_file.parent}", f"--python_out={out_root}",
            f"--pyi_out={out_root}", f"--grpc_python_out={out_root}", str(proto_file)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {proto_file}")
    return [out_root / VIRTUAL_DIR / name for name in GENERATED]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[2],
                        help="root folder; files go to <out>/prefix_service/proto/ (default: this checkout)")
    args = parser.parse_args(argv)
    try:
        from importlib.metadata import version
        found = version("grpcio-tools")
    except Exception:  # noqa: BLE001 - not installed
        found = None
    if found != PINNED_GRPCIO_TOOLS:
        print(f"warning: grpcio-tools {found} is installed; the committed stubs come from "
              f"{PINNED_GRPCIO_TOOLS} (pip install grpcio-tools=={PINNED_GRPCIO_TOOLS})", file=sys.stderr)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
