"""`artnb.types`: ART's module path for message types, training configs and results."""

from typing import Literal

from .core.config import TrainConfig
from .core.model import TrainResult
from .core.sft import TrainSFTConfig
from .core.trajectory import Message, MessageOrChoice, Messages, MessagesAndChoices, Tools

LocalTrainResult = TrainResult  # ART's name for what LocalBackend.train returns
Verbosity = Literal[0, 1, 2]

__all__ = [
    "LocalTrainResult",
    "Message",
    "MessageOrChoice",
    "Messages",
    "MessagesAndChoices",
    "Tools",
    "TrainConfig",
    "TrainResult",
    "TrainSFTConfig",
    "Verbosity",
]
