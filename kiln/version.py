"""kiln's version: recorded in every artefact and checked when one is loaded."""

__version__ = "0.1.0"
