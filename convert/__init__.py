"""pyinfer-convert: a Hugging Face Llama directory or a llama.cpp GGUF -> a pyinfer GGUF file."""
import sys


_warned: set[str] = set()


def warn(message: str) -> None:
    """One ``warning: ...`` line on stderr (the converter's only non-error chatter), once per
    message and process (a conversion may plan its source twice: the importance pass, then the
    write)."""
    if message not in _warned:
        _warned.add(message)
        print(f"warning: {message}", file=sys.stderr)
