"""Generates the protobuf and gRPC code at build time (wheel, sdist, `pip install .`,
editable installs), from protos/dpex/v1/ into dpex/proto/. The generated files are
never edited and never committed; everything else about the package is in pyproject.toml."""
import glob
import os

from setuptools import setup
from setuptools.command.build_py import build_py


def generate_protos(out_dir: str) -> None:
    """Runs protoc (from grpcio-tools, a build requirement) as `make proto` does."""
    from grpc_tools import protoc
    import grpc_tools

    protos = sorted(glob.glob(os.path.join("protos", "dpex", "v1", "*.proto")))
    if not protos:
        raise RuntimeError("no .proto files under protos/dpex/v1: is this a whole checkout?")
    include = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    args = ["protoc", "-Idpex/proto=protos/dpex/v1", f"-I{include}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *protos]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed on " + " ".join(protos))


class BuildPy(build_py):
    def run(self) -> None:
        super().run()
        # An editable install imports dpex/ from the checkout: generate there.
        generate_protos("." if getattr(self, "editable_mode", False) else self.build_lib)


setup(cmdclass={"build_py": BuildPy})
