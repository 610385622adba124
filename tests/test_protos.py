"""The committed gRPC stubs must be exactly what the .proto files generate, and the check
that says so (protos.generate.stale_stubs, also `python -m protos.generate --check`) must
find every way they can go stale."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from protos import generate as gen
from protos.generate import ROOT, stale_stubs

STUBS = ("omni_proxy_pb2.py", "omni_proxy_pb2.pyi", "omni_proxy_pb2_grpc.py")


def test_committed_stubs_match_the_proto_files():
    stale = stale_stubs()
    assert not stale, f"stale stubs {stale}: run `python -m protos.generate` and commit the result"
    assert gen.main(["--check"]) == 0


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """A copy of the repo's protos/ (the .proto files and their committed stubs)."""
    (tmp_path / "protos").mkdir()
    for p in (ROOT / "protos").glob("*.proto"):
        shutil.copy(p, tmp_path / "protos" / p.name)
    for name in STUBS:
        shutil.copy(ROOT / "protos" / name, tmp_path / "protos" / name)
    assert stale_stubs(tmp_path) == []       # the copy starts current
    return tmp_path


def test_a_proto_edited_without_regenerating_is_caught(copy: Path):
    proto = copy / "protos" / "omni_proxy.proto"
    proto.write_text(proto.read_text().replace("message Ack {}", "message Ack { int32 x = 1; }"))
    assert set(stale_stubs(copy)) >= {"omni_proxy_pb2.py", "omni_proxy_pb2.pyi"}


def test_a_stub_edited_by_hand_or_missing_is_caught(copy: Path):
    grpc_stub = copy / "protos" / "omni_proxy_pb2_grpc.py"
    grpc_stub.write_text(grpc_stub.read_text() + "\n# edited by hand\n")
    (copy / "protos" / "omni_proxy_pb2.pyi").unlink()
    assert sorted(stale_stubs(copy)) == ["omni_proxy_pb2.pyi", "omni_proxy_pb2_grpc.py"]


def test_the_cli_check_fails_on_stale_stubs(copy: Path, capsys):
    assert gen.main(["--check", "--root", str(copy)]) == 0
    proto = copy / "protos" / "omni_proxy.proto"
    proto.write_text(proto.read_text().replace("message Ack {}", "message Ack { int32 x = 1; }"))
    assert gen.main(["--check", "--root", str(copy)]) == 1
    assert "stale stubs ['omni_proxy_pb2.py', 'omni_proxy_pb2.pyi']" in capsys.readouterr().err
