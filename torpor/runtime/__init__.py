"""The runtime: hosts agents, supervises them, hibernates and evicts them, and answers admin."""

from torpor.runtime.admin import Admin, AgentInfo, RenderedCall, RuntimeStats
from torpor.runtime.config import RuntimeConfig
from torpor.runtime.embedding import EmbeddingStats
from torpor.runtime.host import Runtime
from torpor.runtime.spawn import Branch
from torpor.runtime.stats import Transition
from torpor.runtime.task import TaskHandle

__all__ = [
    "Admin",
    "AgentInfo",
    "Branch",
    "EmbeddingStats",
    "RenderedCall",
    "Runtime",
    "RuntimeConfig",
    "RuntimeStats",
    "TaskHandle",
    "Transition",
]
