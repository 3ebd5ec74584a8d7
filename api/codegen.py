"""Regenerate the Python code for ``generation.proto``.

Run ``python -m pdserve.api.codegen`` after editing the proto; it rewrites
``generation_pb2.py``, ``generation_pb2_grpc.py`` and ``generation_pb2.pyi`` beside it.
``grpcio-tools`` (the ``test`` extra) is needed here only; serving needs grpcio and protobuf.

The proto is compiled from a temporary tree where it sits at ``pdserve/api/generation.proto``,
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

PROTO_PATH = Path(__file__).with_name("generation.proto")
PROTO_NAME = "pdserve/api/generation.proto"  # the name protoc and the descriptor pool see
GENERATED_NAMES = ("generation_pb2.py", "generation_pb2_grpc.py", "generation_pb2.pyi")


def generate(out_dir: Path | str, proto_path: Path | str = PROTO_PATH) -> list[Path]:
    """Compile ``proto_path`` into ``out_dir``; returns the paths of the generated files."""
    try:
        import grpc_tools  # noqa: F401
    except ImportError as exc:
        raise RuntimeError("grpcio-tools is needed to regenerate code: "
                           "pip install 'pdserve[test]'") from exc
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        source = root / "src" / PROTO_NAME
        source.parent.mkdir(parents=True)
        shutil.copyfile(proto_path, source)
        build = root / "build"
        build.mkdir()
        cmd = [sys.executable, "-m", "grpc_tools.protoc", f"-I{root / 'src'}",
               f"--python_out={build}", f"--grpc_python_out={build}", f"--pyi_out={build}",
               PROTO_NAME]
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"protoc failed ({result.returncode}): {result.stderr.strip()}")
        written = []
        for name in GENERATED_NAMES:
            target = out_dir / name
            shutil.copyfile(build / "pdserve" / "api" / name, target)
            written.append(target)
    logger.info("generated %s into %s", ", ".join(GENERATED_NAMES), out_dir)
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
