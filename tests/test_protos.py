"""The committed protobuf stubs match the .proto files, import as a package, and every element of
the contract is commented."""

import importlib.util
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "protos"


def _gen_protos():
    """Load scripts/gen_protos.py (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_match_regenerated(tmp_path):
    gen = _gen_protos()
    gen.generate(tmp_path)
    fresh = gen.generated_files(tmp_path)
    committed = gen.generated_files(PROTO_ROOT)
    hint = ("stubs differ from the .proto files: run `python scripts/gen_protos.py` (the output "
            f"also depends on the grpcio-tools version; installed: {version('grpcio-tools')})")
    assert sorted(committed) == sorted(fresh), hint
    for path, data in fresh.items():
        assert committed[path] == data, f"{path}: {hint}"


def test_stubs_import_as_package():
    from protos.nxdi.serving.v1 import serving_pb2, serving_pb2_grpc

    assert serving_pb2.DESCRIPTOR.package == "nxdi.serving.v1"
    services = serving_pb2.DESCRIPTOR.services_by_name
    assert {name: [m.name for m in s.methods] for name, s in services.items()} == {
        "Router": ["Generate", "ListModels"],
        "Prefill": ["Prefill", "GetLoad"],
        "Decode": ["Generate", "GetLoad"],
    }
    assert serving_pb2_grpc.PrefillStub and serving_pb2_grpc.add_DecodeServicer_to_server


def test_prefill_event_oneof_round_trip():
    from protos.nxdi.serving.v1 import serving_pb2 as pb

    event = pb.PrefillEvent(first_token=pb.FirstToken(token_id=7, logprob=-0.5))
    parsed = pb.PrefillEvent.FromString(event.SerializeToString())
    assert parsed.WhichOneof("event") == "first_token"
    assert parsed.first_token.token_id == 7 and parsed.first_token.HasField("logprob")
    assert not pb.TokenEvent(token_id=1).HasField("logprob")


def _descriptor_with_comments(tmp_path) -> descriptor_pb2.FileDescriptorProto:
    """serving.proto compiled with its source info (comments)."""
    out = tmp_path / "serving.desc"
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"--proto_path={PROTO_ROOT}",
                    "--include_source_info", f"--descriptor_set_out={out}",
                    str(PROTO_ROOT / "nxdi/serving/v1/serving.proto")], check=True)
    return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]


def _element_paths(fdp: descriptor_pb2.FileDescriptorProto) -> dict[tuple, str]:
    """Source-info path -> readable name for every message, field, oneof, enum, enum value,
    service and method (field numbers from descriptor.proto)."""
    paths = {}

    def enum(path, e):
        paths[path] = e.name
        for i, value in enumerate(e.value):
            paths[path + (2, i)] = f"{e.name}.{value.name}"

    def message(path, m):
        paths[path] = m.name
        for i, f in enumerate(m.field):
            paths[path + (2, i)] = f"{m.name}.{f.name}"
        synthetic = {f.oneof_index for f in m.field if f.proto3_optional}  # `optional` fields
        for i, o in enumerate(m.oneof_decl):
            if i not in synthetic:
                paths[path + (8, i)] = f"{m.name}.{o.name}"
        for i, nested in enumerate(m.nested_type):
            if not nested.options.map_entry:  # a map field's generated entry type
                message(path + (3, i), nested)
        for i, e in enumerate(m.enum_type):
            enum(path + (4, i), e)

    for i, m in enumerate(fdp.message_type):
        message((4, i), m)
    for i, e in enumerate(fdp.enum_type):
        enum((5, i), e)
    for i, s in enumerate(fdp.service):
        paths[(6, i)] = s.name
        for j, method in enumerate(s.method):
            paths[(6, i, 2, j)] = f"{s.name}.{method.name}"
    return paths


def test_every_proto_element_is_commented(tmp_path):
    fdp = _descriptor_with_comments(tmp_path)
    commented = {tuple(loc.path) for loc in fdp.source_code_info.location
                 if loc.leading_comments.strip() or loc.trailing_comments.strip()}
    missing = [name for path, name in _element_paths(fdp).items() if path not in commented]
    assert missing == []


@pytest.mark.parametrize("module", ["serving_pb2", "serving_pb2_grpc"])
def test_stubs_need_no_path_hacks(module):
    """The stubs import only via the protos package (no bare `nxdi.serving...` imports)."""
    text = (PROTO_ROOT / "nxdi/serving/v1" / f"{module}.py").read_text()
    assert "\nfrom nxdi." not in text and "\nimport nxdi" not in text
