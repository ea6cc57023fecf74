"""`from artnb.rewards import ruler_score_group, ruler`: ART's import path for RULER (artnb/core/ruler.py)."""

from ..core.judge_requests import JudgeLimits, JudgeRequestError, RulerError
from ..core.ruler import DEFAULT_RUBRIC, ruler, ruler_score_group

__all__ = ["DEFAULT_RUBRIC", "JudgeLimits", "JudgeRequestError", "RulerError", "ruler", "ruler_score_group"]
