"""Lightning callbacks for bridge-pl, named in configs as ``callbacks.<Name>``.

Each module is thin and calls into ``bridge_pl``.
"""

from callbacks.checkpoint import ValidatedCheckpoint
from callbacks.heap import ReleaseHeap
from callbacks.index_refresh import IndexRefresh
from callbacks.landscape import LossLandscape
from callbacks.memory import MemoryAccount
from callbacks.miss_report import CreditReport as CreditReport  # MissReport's deprecated name, for old configs
from callbacks.miss_report import MissReport
from callbacks.progress import BridgeProgressBar
from callbacks.qa_eval import QAEval
from callbacks.warm_start import WarmStart

__all__ = [
    "BridgeProgressBar", "IndexRefresh", "LossLandscape", "MemoryAccount", "MissReport", "QAEval",
    "ReleaseHeap", "ValidatedCheckpoint", "WarmStart",
]
