"""Regenerate the Python gRPC stubs from protos/*.proto.

    python -m protos.generate            # rewrite the committed stubs
    python -m protos.generate --out DIR  # write them elsewhere (the staleness test does this)

The stubs are committed so that running omni-proxy needs no code generator; the exact
grpcio-tools version is pinned in pyproject.toml because its output embeds it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_FILES = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "protos").glob("*.proto"))


def generate(out: Path) -> list[Path]:
    from grpc_tools import protoc
    import grpc_tools

    out.mkdir(parents=True, exist_ok=True)
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = ["protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={out}", f"--pyi_out={out}",
            f"--grpc_python_out={out}", *PROTO_FILES]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted((out / "protos").glob("*_pb2*.py*"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT, help="output root (default: the repo)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
