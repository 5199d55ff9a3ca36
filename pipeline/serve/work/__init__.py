"""The serving side of each engine (pipeline/serve/engines/<name>.py holds its declarations): the server and model
libraries imported at the top, loaded by name (Engine.work, pipeline.base.registry.load_work) only when
`compress serve` runs the engine, so `compress check` never does."""
