"""Compaction: token budgets, reducers, folds into checkpoints, pointer markers, recall.

The working set an agent keeps is bounded by tokens, never by message count;
what leaves it stays in the log, findable with ``recall`` and ``expand``.
"""

from torpor.compaction.audit import rebuild_rendered
from torpor.compaction.fold import FoldPlan, Summarizer, build_checkpoint, plan_fold, turn_starts
from torpor.compaction.markers import (
    encode_hints,
    extract_topics,
    format_marker,
    handoff_text,
    make_marker,
    merge_markers,
)
from torpor.compaction.policy import CompactionPolicy
from torpor.compaction.recall import (
    EXPAND_TOOL,
    RECALL_TOOL,
    expand,
    format_events,
    format_hits,
    recall,
)
from torpor.compaction.recipe import Recipe, Rendered, decode_recipe, encode_recipe
from torpor.compaction.render import INTERRUPTED_RESULT
from torpor.compaction.summarizer import ModelSummarizer, SummaryOutcome, summarize_fold
from torpor.compaction.tokens import (
    DEFAULT_ENCODING,
    MESSAGE_OVERHEAD,
    count_body,
    count_text,
    get_encoding,
    make_token_counter,
)
from torpor.compaction.working_set import WorkingSet

__all__ = [
    "DEFAULT_ENCODING",
    "EXPAND_TOOL",
    "INTERRUPTED_RESULT",
    "MESSAGE_OVERHEAD",
    "ModelSummarizer",
    "RECALL_TOOL",
    "CompactionPolicy",
    "FoldPlan",
    "Recipe",
    "Rendered",
    "Summarizer",
    "SummaryOutcome",
    "WorkingSet",
    "build_checkpoint",
    "count_body",
    "count_text",
    "decode_recipe",
    "encode_hints",
    "encode_recipe",
    "expand",
    "extract_topics",
    "format_events",
    "format_hits",
    "format_marker",
    "get_encoding",
    "handoff_text",
    "make_marker",
    "make_token_counter",
    "merge_markers",
    "plan_fold",
    "rebuild_rendered",
    "recall",
    "summarize_fold",
    "turn_starts",
]
