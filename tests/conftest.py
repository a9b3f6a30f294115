import pytest
import torch

from tinymodels import make_adapters, make_model

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="session")
def llama_adapters(llama_dir, tmp_path_factory):
    return make_adapters(llama_dir, tmp_path_factory.mktemp("llama-adapters"))
