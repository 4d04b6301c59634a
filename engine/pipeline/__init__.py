"""Asynchronous steps: the step in flight, and how the host takes, samples and
launches it while the device runs (see :mod:`formcast.engine.pipeline.pipeline`)."""

from formcast.engine.pipeline.pipeline import Pipeline
from formcast.engine.pipeline.state import PipelineStats

__all__ = ["Pipeline", "PipelineStats"]
