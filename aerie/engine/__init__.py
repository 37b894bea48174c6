"""The batched speculative decoding engine."""

from aerie.engine.engine import Completion, Engine, EngineConfig
from aerie.engine.metrics import SpecCounters, StepStats
from aerie.engine.request import RequestOutput, SamplingParams

__all__ = ["Completion", "Engine", "EngineConfig", "RequestOutput", "SamplingParams", "SpecCounters", "StepStats"]
