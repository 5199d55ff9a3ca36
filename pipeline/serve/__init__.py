"""`compress serve EXPORT_DIR`: an OpenAI-compatible server for an export folder, and its load test.

Why our own FastAPI app and not `transformers serve` (checked with transformers 5.24): `transformers serve` does serve
a local folder with continuous batching (`--continuous-batching`), but it has no API key at all, no bounded queue
(no 503 with Retry-After: requests pile up without limit), no drain on SIGTERM, and it exposes `/load_model` and
`/reset`, through which any client can make the process load another model (from the Hub when online). Wrapping it
would mean patching its app in four places; the part worth reusing is the engine underneath, so this package is a
small FastAPI + uvicorn app around transformers' continuous-batching manager
(`model.init_continuous_batching()`: `add_request(streaming=True)`, `register_result_handler`, `cancel_request`).

Modules: folder (torch-free: what an export folder holds), engines/ (the registry of serving engines, one file each:
transformers (this package's app over transformers' manager), llamacpp (a .gguf through llama-cpp-python's own
server, with what it does and does not do), vllm (vLLM's own server from its own environment, supervised as a child
process); each declares the formats it serves per device and the options it applies), engine (the model and the
manager, the scoring forward for logprobs), app (routes, key, body cap, middleware), openai_schema (request models:
fields served, accepted without effect, refused with 400), completions (generation, batches, echo, logprobs, SSE),
output (stop strings, logprobs shapes, prompt-aware decoding), admission (the bounded queue), metrics (Prometheus
/metrics), drain (SIGTERM: port kept open, 503 until in-flight requests finish), server (checks, binding, then the
chosen engine), measured (serving.json: the figures `--engine auto` picks by), measure (the
`validate/<model>/serve/<engine>` unit), loadtest (the asyncio load generator), config (the torch-free
`[validate.serve]` table and which engines serve which model).
"""
