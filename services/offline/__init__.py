"""The pipeline's cores wired in one process, without Redis: the engine, `LLM` and
`headrace generate`."""
