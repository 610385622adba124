"""The committed gRPC stubs must be exactly what the .proto files generate."""

from __future__ import annotations

from pathlib import Path

from protos.generate import ROOT, generate


def test_committed_stubs_match_the_proto_files(tmp_path: Path):
    fresh = generate(tmp_path)
    assert fresh, "the generator produced nothing"
    stale = []
    for path in fresh:
        committed = ROOT / "protos" / path.name
        if not committed.exists() or committed.read_bytes() != path.read_bytes():
            stale.append(path.name)
    assert not stale, f"stale stubs {stale}: run `python -m protos.generate` and commit the result"


def test_stale_stubs_would_be_caught(tmp_path: Path):
    # The comparison above must see a change in the .proto: generate from an edited copy.
    fresh = {p.name: p.read_bytes() for p in generate(tmp_path / "a")}
    proto = (ROOT / "protos" / "omni_proxy.proto").read_text()
    edited = tmp_path / "b" / "protos"
    edited.mkdir(parents=True)
    (edited / "omni_proxy.proto").write_text(proto.replace("message Ack {}", "message Ack { int32 x = 1; }"))
    from grpc_tools import protoc
    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    out = tmp_path / "c"
    out.mkdir()
    assert protoc.main(["protoc", f"-I{tmp_path / 'b'}", f"-I{include}", f"--python_out={out}",
                        "protos/omni_proxy.proto"]) == 0
    assert (out / "protos" / "omni_proxy_pb2.py").read_bytes() != fresh["omni_proxy_pb2.py"]
