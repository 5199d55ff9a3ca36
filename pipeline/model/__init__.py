"""Models: where they come from (sources, materialize, gguf_header), how they load (models), their families and dtypes, compute settings and memory accounting."""
