"""quantpipe: post-training quantization pipeline for Hugging Face causal LMs."""

__version__ = "0.1.0"
