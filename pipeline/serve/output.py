"""What a client sees of a growing output (pure functions, tested on plain strings): the text cut before the first
stop string, what a stream may already send, and OpenAI's legacy completions `logprobs` record."""
from __future__ import annotations


class StopText:
    """The visible text of a growing output.

    `update(text, final)` takes the whole decoded output so far and returns (visible, stopped): the text up to the
    first occurrence of any stop string (stopped True), else, while generating, the text less what may still become
    a stop string (its last len(longest stop) - 1 characters) and less a trailing half UTF-8 character ("\\ufffd",
    the rest of the character comes with the next token); at the end (final) the whole text.
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self._searched = 0  # stop strings cannot start before this index (already searched)

    def update(self, text: str, final: bool) -> tuple[str, bool]:
        start = self._searched
        hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            return text[:min(hits)], True
        self._searched = max(0, len(text) - self.hold - 8)  # 8: a last character may still change (\ufffd)
        if final:
            return text, False
        visible = text[:len(text) - self.hold] if self.hold else text
        if visible.endswith("\ufffd"):
            visible = visible[:-1]
        return visible, False


CONTEXT_TOKENS = 4  # prompt tokens decoded before the output (vLLM's incremental detokenizer starts 5 back)


def continuation(decode, context: list[int], tokens: list[int]) -> str:
    """The text `tokens` add after `context` (the prompt's last tokens), so that prompt text + output text is the
    text of the whole sequence: a tokenizer that joins words with spaces, or drops the space of SentencePiece's
    first "▁word", shows an output decoded alone without its leading space."""
    if not context or not tokens:
        return decode(tokens)
    head, full = decode(context), decode(context + tokens)
    return full[len(head):] if full.startswith(head) else decode(tokens)


def finish_reason(stopped: bool, n_tokens: int, max_tokens: int) -> str:
    """"stop" for a stop string or the end-of-sequence token, "length" when max_tokens tokens were generated."""
    return "stop" if stopped or n_tokens < max_tokens else "length"


def legacy_logprobs(tokens: list[str], token_logprobs: list[float | None], top: list[dict[str, float] | None],
                    offset: int) -> dict:
    """OpenAI's completions `logprobs`: {tokens, token_logprobs, top_logprobs, text_offset}, each token's offset the
    running length of the token strings before it, from `offset` (0 with echo, else the prompt's length)."""
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def top_dict(chosen: str, chosen_lp: float, top: list[tuple[str, float]]) -> dict[str, float]:
    """The top-k alternatives of one position by token string, with the chosen token always in it (as vLLM does);
    two ids with the same string keep the higher logprob."""
    out: dict[str, float] = {}
    for s, lp in [*top, (chosen, chosen_lp)]:
        if s not in out or lp > out[s]:
            out[s] = lp
    return out
