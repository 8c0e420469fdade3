"""Test-wide settings: one thread, quiet logs, no network."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture
def weight_loads():
    """The descriptions of the progress bars transformers opens during the test, drawn or not (without a terminal
    they are not drawn): ``"Loading weights"`` once per model loaded. Read through transformers' tqdm hook."""
    from transformers.utils import logging as hf_logging

    opened: list[str] = []

    def hook(factory, args, kwargs):
        opened.append(kwargs.get("desc", ""))
        return factory(*args, **kwargs)

    previous = hf_logging.set_tqdm_hook(hook)
    yield opened
    hf_logging.set_tqdm_hook(previous)


def pytest_collection_modifyitems(items) -> None:
    """Files with slow tests first: each test process takes whole files in this order, so the long ones start early
    and the two processes finish together instead of one running the last long file alone."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: file and test order kept within each group
