"""The scheduler service: its core (state and decisions, no I/O) and its asyncio shell.

Public to the tools: the core, which `headrace bench scheduler` times without a model."""

from services.scheduler.core import Scheduler, SchedulerConfig

__all__ = ["Scheduler", "SchedulerConfig"]
