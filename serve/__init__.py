"""The OpenAI-compatible HTTP server over an artefact (`kiln serve`)."""
