"""The tokenizer service: its core (state and decisions, no I/O) and its asyncio shell."""
