"""draftsmith: train EAGLE-3 draft models for Hugging Face causal LMs and measure whether
speculative decoding makes them faster. Stages: generate -> extract -> train -> export -> bench."""

__version__ = "0.1.0"
