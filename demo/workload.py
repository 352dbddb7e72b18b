"""Requests as OpenAI clients send them: prompts of chosen lengths, and one call.

Prompts are completions (token ids) or chats (messages through the server's
chat template). Their length in tokens is fixed by construction against the
server's own tokenizer (``/tokenize``), so a prompt can be made to end exactly
on a block boundary or inside a block. :func:`send` runs one request with the
``openai`` package, streamed or not, greedy, and records the generated token
ids, the text and the timing of every streamed chunk.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from demo.tiny_model import WORDS

Kind = Literal["completion", "chat"]

# The tiny tokenizer's training words: prompts of known token counts.
_WORDS = tuple(WORDS)


@dataclass(frozen=True)
class Prompt:
    """One request's input. ``num_tokens``: its length as the engine sees it."""

    kind: Kind
    stream: bool
    num_tokens: int
    token_ids: tuple[int, ...] = ()  # completion
    messages: tuple[tuple[str, str], ...] = ()  # chat: (role, content)

    def mid_block(self, block_size: int) -> bool:
        return self.num_tokens % block_size != 0

    def body(self) -> dict[str, Any]:
        """The prompt part of the request body."""
        if self.kind == "completion":
            return {"prompt": list(self.token_ids)}
        return {"messages": [{"role": r, "content": c} for r, c in self.messages]}


def completion_prompt(num_tokens: int, rng: random.Random, stream: bool) -> Prompt:
    ids = tuple(rng.randrange(3, 512) for _ in range(num_tokens))  # the tiny vocab, no specials
    return Prompt("completion", stream, num_tokens, token_ids=ids)


def chat_prompt(
    want: Callable[[int], bool],
    low: int,
    rng: random.Random,
    stream: bool,
    count_tokens: Callable[[list[dict[str, str]]], int],
    high: int,
) -> Prompt:
    """A chat whose templated length ``n`` has ``want(n)`` and ``low <= n <= high``:
    words are appended until it does (``count_tokens`` asks the server)."""
    words = [rng.choice(_WORDS) for _ in range(max(1, low // 3))]
    for _ in range(400):
        messages = [{"role": "user", "content": " ".join(words)}]
        n = count_tokens(messages)
        if n > high:
            words = words[: max(1, len(words) // 2)]
            continue
        if n >= low and want(n):
            return Prompt("chat", stream, n, messages=(("user", messages[0]["content"]),))
        words.append(rng.choice((*_WORDS, "a", "b", "x")))
    raise RuntimeError(f"no chat prompt of {low}-{high} tokens with the wanted length found")


def mixed_prompts(
    count: int,
    block_size: int,
    count_tokens: Callable[[list[dict[str, str]]], int],
    *,
    seed: int = 0,
    low: int = 8,
    high: int = 200,
) -> list[Prompt]:
    """``count`` prompts of random lengths in [low, high]: completions and chats,
    streamed and not, in turn; every other one ends inside a block (length not a
    multiple of ``block_size``), the others exactly on a block boundary."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        kind: Kind = "completion" if i % 4 < 2 else "chat"
        stream = i % 2 == 1
        mid = (i // 4) % 2 == 0  # each (kind, stream) pair gets both halves
        if kind == "completion":
            n = rng.randrange(low, high + 1)
            if mid and n % block_size == 0:
                n += 1 if n < high else -1
            if not mid:
                n = max(block_size, n - n % block_size)
            out.append(completion_prompt(n, rng, stream))
        else:

            def want(n: int, mid: bool = mid) -> bool:
                return (n % block_size != 0) == mid

            out.append(chat_prompt(want, low, rng, stream, count_tokens, high))
    return out


@dataclass
class Answer:
    """What the client got for one request."""

    prompt: Prompt
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] | None = None
    finish_reason: str | None = None
    error: BaseException | None = None
    start: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # streamed: arrival of each chunk
    end: float = 0.0

    @property
    def ttft(self) -> float | None:
        """Time to the first generated token (streamed requests)."""
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def itls(self) -> list[float]:
        """Gaps between streamed chunks with tokens: inter-token latencies."""
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]


def request_kwargs(prompt: Prompt, max_tokens: int) -> dict[str, Any]:
    """Greedy, a fixed number of tokens, token ids returned."""
    return {
        "model": "model",
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": prompt.stream,
        "extra_body": {"ignore_eos": True, "return_token_ids": True},
        **prompt.body(),
    }


def send(client: Any, prompt: Prompt, max_tokens: int, **extra: Any) -> Answer:
    """One request through ``client`` (an ``openai.OpenAI``). Errors are returned in
    ``Answer.error``, not raised, so callers can tell a clean HTTP error apart."""
    ans = Answer(prompt, start=time.monotonic())
    kwargs = {**request_kwargs(prompt, max_tokens), **extra}
    api = client.completions if prompt.kind == "completion" else client.chat.completions
    try:
        if prompt.stream:
            for chunk in api.create(**kwargs):
                _take_chunk(ans, chunk)
        else:
            _take_whole(ans, api.create(**kwargs))
    except Exception as e:  # noqa: BLE001 - the caller decides what an error means
        ans.error = e
    ans.end = time.monotonic()
    return ans


def _take_whole(ans: Answer, response: Any) -> None:
    choice = response.choices[0]
    ans.text = choice.text if ans.prompt.kind == "completion" else choice.message.content or ""
    ans.token_ids = list(getattr(choice, "token_ids", None) or [])
    ans.prompt_token_ids = _prompt_ids(response, choice)
    ans.finish_reason = choice.finish_reason


def _take_chunk(ans: Answer, chunk: Any) -> None:
    if not chunk.choices:
        return
    choice = chunk.choices[0]
    ids = list(getattr(choice, "token_ids", None) or [])
    if ans.prompt_token_ids is None:
        ans.prompt_token_ids = _prompt_ids(chunk, choice)
    if ans.prompt.kind == "completion":
        text = choice.text or ""
    else:
        text = (choice.delta.content or "") if choice.delta is not None else ""
    if ids:
        ans.chunk_times.append(time.monotonic())
    ans.token_ids += ids
    ans.text += text
    if choice.finish_reason is not None:
        ans.finish_reason = choice.finish_reason


def _prompt_ids(response: Any, choice: Any) -> list[int] | None:
    ids = getattr(choice, "prompt_token_ids", None) or getattr(response, "prompt_token_ids", None)
    return list(ids) if ids else None


def send_all(
    client: Any,
    prompts: Sequence[Prompt],
    max_tokens: int,
    concurrency: int,
) -> list[Answer]:
    """Every prompt, ``concurrency`` at a time; answers in prompt order."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda p: send(client, p, max_tokens), prompts))


def openai_client(base_url: str, timeout: float = 600.0) -> Any:
    """An ``openai.OpenAI`` for a local server or proxy: no retries (a retry would
    hide the faults the tests inject), a generous timeout for a loaded machine."""
    import openai

    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="local", max_retries=0, timeout=timeout)
