"""kiln's bottom layer: what the compiler and the runtime share, importing nothing else of
kiln. The graph IR (`ir`, `graph_json`), the ops and their definitions (`ops`, `trace`),
quantization formats (`quant`), weight layouts (`layout`), compile targets (`target`) and
the artefact format (`artefact`). docs/architecture.md draws the layers above it."""
