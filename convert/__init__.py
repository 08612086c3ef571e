"""pyinfer-convert: a Hugging Face Llama directory or a llama.cpp GGUF -> a pyinfer GGUF file."""
import sys


def warn(message: str) -> None:
    """One ``warning: ...`` line on stderr (the converter's only non-error chatter)."""
    print(f"warning: {message}", file=sys.stderr)
