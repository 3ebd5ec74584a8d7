"""The committed generated code matches the api/ protos and loads with the installed runtime."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import grpc
import pytest

from pdserve.api import admin_pb2, admin_pb2_grpc, codegen, generation_pb2, generation_pb2_grpc

# Lines that record the generator's version rather than the proto's content.
_VERSION_LINES = re.compile(
    r"^(# Protobuf Python Version: .*|GRPC_GENERATED_VERSION = .*)$|"
    r"(_runtime_version\.Domain\.PUBLIC,\n)(\s*\d+,\n){3}", re.MULTILINE)


def _without_versions(text: str) -> str:
    return _VERSION_LINES.sub("<version>", text)


def test_committed_generated_code_is_in_sync(tmp_path):
    """Regenerate into tmp_path and compare byte for byte.

    When the installed grpcio-tools differs from the one that generated the committed files,
    only the version-stamp lines may differ; everything else must still be identical.
    """
    written = codegen.generate(tmp_path)
    assert sorted(p.name for p in written) == sorted(codegen.GENERATED_NAMES)
    committed_dir = Path(codegen.__file__).parent
    same_tools = (generation_pb2_grpc.GRPC_GENERATED_VERSION
                  == importlib.metadata.version("grpcio-tools"))
    for name in codegen.GENERATED_NAMES:
        fresh = (tmp_path / name).read_text()
        committed = (committed_dir / name).read_text()
        if same_tools:
            assert committed == fresh, f"{name} is stale: run python -m pdserve.api.codegen"
        else:
            assert _without_versions(committed) == _without_versions(fresh), \
                f"{name} is stale: run python -m pdserve.api.codegen"


@pytest.mark.parametrize("pb2, pb2_grpc", [(generation_pb2, generation_pb2_grpc),
                                            (admin_pb2, admin_pb2_grpc)],
                         ids=["generation", "admin"])
def test_generated_imports_are_package_absolute(pb2, pb2_grpc):
    stem = pb2.__name__.rsplit(".", 1)[-1].removesuffix("_pb2")
    text = Path(pb2_grpc.__file__).read_text()
    assert f"from pdserve.api import {stem}_pb2 as" in text
    assert f"\nimport {stem}_pb2" not in text
    assert pb2.DESCRIPTOR.name == codegen.proto_name(f"{stem}.proto")
    assert pb2.DESCRIPTOR.package == "pdserve.v1"


def test_every_proto_is_generated():
    protos = sorted(p.name for p in Path(codegen.__file__).parent.glob("*.proto"))
    assert protos == sorted(codegen.PROTOS)
    assert set(admin_pb2.DESCRIPTOR.services_by_name) == {"Admin"}
    assert {m.name for m in admin_pb2.DESCRIPTOR.services_by_name["Admin"].methods} == {
        "ListWorkers", "DrainWorker", "GetPools", "SetPoolTarget", "GetTraces", "GetConfig",
        "GetControlPlane", "LoadLoraAdapter", "UnloadLoraAdapter", "ListLoraAdapters"}


def test_generated_code_needs_no_newer_grpcio_than_installed():
    def version(text: str) -> tuple[int, ...]:
        return tuple(int(part) for part in re.findall(r"\d+", text)[:3])

    assert version(grpc.__version__) >= version(generation_pb2_grpc.GRPC_GENERATED_VERSION)


def test_sampling_fields_have_presence_and_mirror_sampling_params():
    from dataclasses import fields

    from pdserve.worker_api.sampling_params import SamplingParams

    descriptor = generation_pb2.SamplingParams.DESCRIPTOR
    assert {f.name for f in descriptor.fields} == {f.name for f in fields(SamplingParams)}
    for field in descriptor.fields:
        assert field.is_repeated or field.has_presence, f"{field.name} must be proto3 optional"
