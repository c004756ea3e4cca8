"""Files and other libraries: plain state dicts, safetensors, Hugging Face."""
