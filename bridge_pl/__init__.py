"""bridge-pl: BRIDGE (bilevel retrieval-credit-aware agentic RL) on PyTorch Lightning."""

__version__ = "0.1.0"
