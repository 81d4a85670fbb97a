import pytest

from tests.helpers.tiny_models import make_tiny_model, smollm2_path


@pytest.fixture(scope="session")
def smollm2() -> str:
    return smollm2_path()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny-engine")
    return {arch: make_tiny_model(root / arch, arch, seed=7) for arch in ("llama", "qwen2", "qwen3")}
