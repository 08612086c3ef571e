"""A chat REPL over a scripted model that streams slowly (``python -m tests._slow_chat``), so a
test can type into the terminal while an answer streams. Each message the session receives is
printed on stderr as ``<<GOT:'text'>>``."""
from __future__ import annotations

import sys
import time
import types

from pyinfer.api import GenerationStats
from pyinfer.repl import ChatSession, repl

N_PIECES, DELAY_S = 20, 0.1


class SlowLLM:
    n_ctx = 4096
    model_name = "slow"

    def __init__(self):
        self.last_stats = GenerationStats()
        self.engine = types.SimpleNamespace(reuse_decoded_rows=False)

    def chat_tokens(self, messages):
        return [0] * 10

    def stream_text(self, ids, max_tokens=None, should_stop=None, **kw):
        stats = self.last_stats = GenerationStats(prompt_tokens=10, prompt_evaluated=10,
                                                  finish_reason="stop")
        for i in range(N_PIECES):
            time.sleep(DELAY_S)
            stats.completion_tokens += 1
            yield f"w{i} "
            if should_stop is not None and should_stop():
                stats.interrupted = True
                return


class RecordingSession(ChatSession):
    def ask(self, text, *args, **kwargs):
        print(f"<<GOT:{text!r}>>", file=sys.stderr, flush=True)
        return super().ask(text, *args, **kwargs)


if __name__ == "__main__":
    sys.exit(repl(RecordingSession(SlowLLM(), max_tokens=100)))
