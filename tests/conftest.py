import pytest
import torch
from tinymodels import make_adapters, make_model

torch.set_num_threads(2)


def pytest_addoption(parser):
    parser.addoption(
        "--engine-core",
        default="thread",
        choices=("thread", "process"),
        help="where the servers' native engine runs in the server tests (serve --engine-core; "
        "serve's default is process, these tests' thread: an engine process per test server "
        "makes tests/server slower, and tests/server/test_engine_process.py runs both)",
    )


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="session")
def llama_adapters(llama_dir, tmp_path_factory):
    return make_adapters(llama_dir, tmp_path_factory.mktemp("llama-adapters"))


@pytest.fixture(scope="session")
def demo_world():
    """The trained demo world, built once per machine (cached) and shared by the whole run."""
    from loraplex.demo.world import build_world, default_world_dir

    return build_world(default_world_dir(), progress=False)
