"""Continuous-batching scheduler over the hybrid KV cache (torch-free)."""

from hybridkv.scheduler.config import SchedulerConfig
from hybridkv.scheduler.fake_runner import FakeRunner, fake_token
from hybridkv.sampling_params import SamplingParams
from hybridkv.scheduler.interface import ModelRunner, ScheduledRequest, SchedulerOutput
from hybridkv.scheduler.scheduler import Scheduler
from hybridkv.scheduler.sequence import FinishReason, Sequence, SequenceStatus

__all__ = [
    "FakeRunner",
    "FinishReason",
    "ModelRunner",
    "SamplingParams",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "Sequence",
    "SequenceStatus",
    "fake_token",
]
