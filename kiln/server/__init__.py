"""The OpenAI-compatible HTTP server: routes (api.py), request/response shapes (protocol.py, formats.py,
responses.py), errors for clients (errors.py), Prometheus metrics, the serving loop and its launcher.

adapters.py    LoRA adapters over HTTP: /v1/models entries, /v1/load_lora_adapter and /v1/unload_lora_adapter
api.py         the FastAPI app: OpenAI routes, /health, /metrics, the middleware stack, error handlers, engine lifespan
cli.py         parsers of `kiln serve` and `kiln loadtest` (handlers: launcher.py, kiln.bench.loadtest)
connection_table.py  the open connections: idle ones closed (oldest first) for room, a per-peer cap, refusals counted
connections.py per-connection limits uvicorn lacks: a deadline and a size bound on headers, a fixed send buffer
embeddings.py  /v1/embeddings: OpenAI's request and answer (float or base64) over the engine's embedding requests
errors.py      every failure as OpenAI's error body `{"error": {...}}` with its HTTP status
formats.py     the two OpenAI response shapes over one serving loop: `text_completion` and `chat.completion`
grammar_compiler.py  constraints compiled off the tokenizer thread: a bounded pool, a deadline, one slot per client
grammar_limits.py    how large a constraint may be (bytes, choices, schema depth), checked before compiling
launcher.py    start-up and shutdown of `kiln serve`: load the engine, bind uvicorn, exit 0 on SIGINT/SIGTERM
limits.py      how much work one HTTP request may ask for, and the checks that refuse more before the work is done
metrics.py     Prometheus metrics on a per-app registry: HTTP requests by status, latency histograms, engine state
middleware.py  what runs on every HTTP request before a route sees it: a request id, the API key, the body-size limit
protocol.py    OpenAI request bodies (the fields kiln serves) and their mapping onto SamplingParams
reasoning.py   a thinking model's `<think>...</think>` split into reasoning_content, whole or as it streams
request_fields.py  the fields kiln does not serve, why (each a 400 naming it), and those that ask for nothing
responses.py   OpenAI response bodies built from RequestOutputs: usage, logprobs in both API shapes, SSE framing
server_args.py `ServerArgs`: every serving option of `kiln serve` in one dataclass, which generates its flags
structured_fields.py  response_format, structured_outputs and guided_*: the one constraint a request asks for
answers.py     the streaming response that aborts its engine requests, waits that end on disconnect
tokenization.py  vLLM's /tokenize, /detokenize and /tokenizer_info
tool_fields.py   tools, tool_choice and history calls: what they ask of the prompt, the output's schema, its reading
tool_parsers.py  the formats models write tool calls in (hermes, llama3_json, mistral, json_array), chosen by template
tool_reader.py   one choice's output read for tool calls as it streams: content, call names, arguments as written
tool_prompt.py   tools in the prompt: as templates that know tools take them, or kiln's fallback in hermes format
serving.py     /v1/completions and /v1/chat/completions: validate, tokenize off the event loop, add to engine, answer
"""
