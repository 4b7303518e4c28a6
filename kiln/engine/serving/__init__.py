"""Serving: the engine behind its callers: the async engine loop of the server, the offline `LLM` API and the
`kiln generate` / `chat` / `compile` commands.

async_engine.py    the engine loop for serving: one thread owns the EngineCore; asyncio callers get per-request queues
commands.py        handlers of `kiln generate`, `kiln chat` and `kiln compile`
llm.py             the offline API: `LLM(model=...).generate(prompts, params)` and `.chat(messages, params)`
request_stream.py  what the async engine hands asyncio callers: `RequestStream`, the table delivering outputs, stats
"""
