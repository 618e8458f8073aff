import os

import pytest
import torch

# Tests run on small tensors; extra threads only contend on the shared 2-core machines.
torch.set_num_threads(int(os.environ.get("KVCOMPRESS_TEST_THREADS", "2")))


@pytest.fixture(scope="session")
def default_model():
    """(model, tokenizer) of the real default model, loaded once per test session (e2e tests only)."""
    import kvcompress as kvc

    return kvc.load_model()
