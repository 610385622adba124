"""Regenerate the Python gRPC stubs from protos/*.proto, or check that they are current.

    python -m protos.generate            # rewrite the committed stubs
    python -m protos.generate --out DIR  # write them elsewhere
    python -m protos.generate --check    # exit 1, naming them, when the committed stubs are stale
    python -m protos.generate --root DIR # read DIR/protos instead of the repo's

The stubs are committed so that running omni-proxy needs no code generator; the exact
grpcio-tools version is pinned in pyproject.toml because its output embeds it. The check
(``stale_stubs``) is what tests/test_protos.py runs: a .proto edited without regenerating, a
stub edited by hand or a stub missing is found.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def proto_files(root: Path = ROOT) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in (root / "protos").glob("*.proto"))


def generate(out: Path, root: Path = ROOT) -> list[Path]:
    """The stubs of ``root``'s protos/*.proto, written under ``out``/protos."""
    from grpc_tools import protoc
    import grpc_tools

    out.mkdir(parents=True, exist_ok=True)
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = ["protoc", f"-I{root}", f"-I{include}", f"--python_out={out}", f"--pyi_out={out}",
            f"--grpc_python_out={out}", *proto_files(root)]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted((out / "protos").glob("*_pb2*.py*"))


def stale_stubs(root: Path = ROOT) -> list[str]:
    """Names of the stubs in ``root``/protos that differ from what its .proto files generate
    now (missing ones included); empty when they are current."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp), root)
        if not fresh:
            raise SystemExit("the generator produced nothing")
        stale = []
        for path in fresh:
            committed = root / "protos" / path.name
            if not committed.exists() or committed.read_bytes() != path.read_bytes():
                stale.append(path.name)
        return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT, help="output root (default: the repo)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if the committed stubs are stale")
    parser.add_argument("--root", type=Path, default=ROOT, help="the tree whose protos/ is read (default: the repo)")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_stubs(args.root)
        if stale:
            print(f"stale stubs {stale}: run `python -m protos.generate` and commit the result", file=sys.stderr)
            return 1
        return 0
    for path in generate(args.out, args.root):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
