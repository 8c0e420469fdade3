"""Test-wide settings: one thread, quiet logs, no network."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(1)


def pytest_collection_modifyitems(items) -> None:
    """Files with slow tests first: each test process takes whole files in this order, so the long ones start early
    and the two processes finish together instead of one running the last long file alone."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: file and test order kept within each group
