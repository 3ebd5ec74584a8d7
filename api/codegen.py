"""Regenerate the Python code for the ``.proto`` files of ``pdserve.api``.

Run ``python -m pdserve.api.codegen`` after editing a proto; for each of :data:`PROTOS` it
rewrites ``<name>_pb2.py``, ``<name>_pb2_grpc.py`` and ``<name>_pb2.pyi`` beside it.
``grpcio-tools`` (the ``test`` extra) is needed here only; serving needs grpcio and protobuf.

Each proto is compiled from a temporary tree where it sits at ``pdserve/api/<name>.proto``,
so protoc writes package-absolute imports (``from pdserve.api import generation_pb2``) and
registers the file under a name no other package uses. The generated code checks at import
that the installed protobuf and grpcio are at least the versions it was generated with.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

API_DIR = Path(__file__).parent
PROTOS = ("generation.proto", "admin.proto")  # every proto of pdserve.api
PROTO_PATH = API_DIR / "generation.proto"
PROTO_NAME = "pdserve/api/generation.proto"  # the name protoc and the descriptor pool see


def proto_name(proto: str) -> str:
    """The name a proto of :data:`PROTOS` is registered under (``pdserve/api/<file>``)."""
    return f"pdserve/api/{proto}"


def generated_names(proto: str) -> tuple[str, str, str]:
    stem = proto.removesuffix(".proto")
    return (f"{stem}_pb2.py", f"{stem}_pb2_grpc.py", f"{stem}_pb2.pyi")


GENERATED_NAMES = tuple(name for proto in PROTOS for name in generated_names(proto))


def generate(out_dir: Path | str, proto_dir: Path | str = API_DIR,
             protos: tuple[str, ...] = PROTOS) -> list[Path]:
    """Compile ``protos`` (file names in ``proto_dir``) into ``out_dir``; returns the paths
    of the generated files."""
    try:
        import grpc_tools  # noqa: F401  # lazy: grpcio-tools is a test dependency
    except ImportError as exc:
        raise RuntimeError("grpcio-tools is needed to regenerate code: "
                           "pip install 'pdserve[test]'") from exc
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for proto in protos:
            source = root / "src" / proto_name(proto)
            source.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(Path(proto_dir) / proto, source)
        build = root / "build"
        build.mkdir()
        cmd = [sys.executable, "-P", "-m", "grpc_tools.protoc", f"-I{root / 'src'}",
               f"--python_out={build}", f"--grpc_python_out={build}", f"--pyi_out={build}",
               *(proto_name(p) for p in protos)]
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"protoc failed ({result.returncode}): {result.stderr.strip()}")
        written = []
        for name in (n for p in protos for n in generated_names(p)):
            target = out_dir / name
            shutil.copyfile(build / "pdserve" / "api" / name, target)
            written.append(target)
    logger.info("generated %s into %s", ", ".join(p.name for p in written), out_dir)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTO_PATH.parent,
                        help="folder for the generated files (default: beside the proto)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    generate(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
