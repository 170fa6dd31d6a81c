"""The gateway service: its core (state and decisions, no I/O) and its asyncio shell."""

from services.gateway.public import Choice, Job, chunk_writer, parse_job, validate_body

__all__ = ["Choice", "Job", "chunk_writer", "parse_job", "validate_body"]
