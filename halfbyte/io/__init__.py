"""Reading and writing model files: HF directories, safetensors, GGUF, tokenizers."""
