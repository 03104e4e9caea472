"""Token-in-token-out trajectories of a multi-turn episode, built in one place.

An episode alternates sampled assistant turns with environment messages (tool results,
feedback). Its tokens are never rebuilt from text: the ids and behaviour logprobs the engine
sampled are kept verbatim (decoding and re-encoding changes ids: two Qwen ids that decode to
" international" re-encode to one), and only the environment's messages are rendered, as a
suffix (:meth:`ChatRenderer.suffix`), after the *glue* the template writes between an
end-of-turn token and the next message (Qwen: the ``\\n`` after ``<|im_end|>``, which the sampler
stops before). Every token carries its provenance (:class:`Source`), the policy version that
sampled it and its turn; the loss mask is "sampled", nothing else. The ids sent to the engine
for turn k are exactly the held context of turn k (:meth:`Trajectory.context`).

Templates that are not prefix-stable (Qwen3's and the R1 distills' drop earlier ``<think>``
blocks once a new user message follows) cannot have both the official render and the sampled
tokens; the two history modes choose:

- ``as_sampled``: the whole history as the model sampled it, one sample per episode (what the
  model saw is what is trained; later turns see earlier reasoning, unlike the official render).
- ``split``: when the official render of the conversation no longer extends the held tokens, the
  sample ends and a new one starts from the official render as its prompt; each sampled token is
  trained exactly once, in the context it was sampled in.
"""

from __future__ import annotations

import copy
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from transformers import PreTrainedTokenizerBase

from treadle.core.errors import UserError
from treadle.core.types import Completion

Message = Mapping[str, Any]
"""One chat message in OpenAI's form (``role``, ``content``, and ``name``/``tool_call_id`` for
``tool`` messages), as ``apply_chat_template`` takes it."""

HistoryMode = Literal["as_sampled", "split"]

NOT_SAMPLED = -1
"""The policy version of a token no policy sampled."""

_SENTINEL = "\u27e6treadle-turn\u27e7"  # an assistant turn's content no template rewrites


class Source(enum.IntEnum):
    """Where a trajectory token came from."""

    PROMPT = 0
    """The first messages, or a split sample's official render of the history."""
    SAMPLED = 1
    """Sampled by the policy: the only tokens trained (loss mask 1)."""
    ENVIRONMENT = 2
    """An environment's messages rendered as a suffix (tool results, feedback)."""
    GLUE = 3
    """The template's text between a turn's end and the next message (Qwen: ``\\n``; an
    end-of-turn token too when the turn stopped without sampling one)."""


@dataclass
class Segment:
    """One trained sample of an episode: per-token arrays, all of length ``[T]``."""

    token_ids: list[int] = field(default_factory=list)
    sources: list[Source] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    """Behaviour logprob (nats) of each sampled token; 0.0 elsewhere."""
    versions: list[int] = field(default_factory=list)
    """Policy version that sampled each token; :data:`NOT_SAMPLED` elsewhere."""
    turns: list[int] = field(default_factory=list)
    """The assistant turn each token belongs to or precedes (0 for the first prompt)."""

    def add(self, ids: Sequence[int], source: Source, turn: int) -> None:
        """Append tokens no policy sampled (``source`` is not SAMPLED)."""
        if source == Source.SAMPLED:
            raise ValueError("sampled tokens come with their logprobs: use add_sampled")
        self._extend(ids, source, [0.0] * len(ids), [NOT_SAMPLED] * len(ids), turn)

    def add_sampled(self, completion: Completion, turn: int) -> None:
        """Append a completion's ids, behaviour logprobs and per-token versions verbatim."""
        self._extend(
            completion.token_ids,
            Source.SAMPLED,
            completion.logprobs,
            completion.versions(),
            turn,
        )

    def _extend(self, ids, source, logprobs, versions, turn) -> None:
        self.token_ids += ids
        self.sources += [source] * len(ids)
        self.logprobs += logprobs
        self.versions += versions
        self.turns += [turn] * len(ids)

    @property
    def loss_mask(self) -> list[bool]:
        """``[T]``: True exactly on sampled tokens."""
        return [s == Source.SAMPLED for s in self.sources]

    @property
    def prompt_tokens(self) -> int:
        """Tokens before the first sampled one (the sample's prompt)."""
        return next((i for i, s in enumerate(self.sources) if s == Source.SAMPLED), len(self))

    def count(self, source: Source) -> int:
        """Tokens of one provenance."""
        return sum(s == source for s in self.sources)

    def __len__(self) -> int:
        return len(self.token_ids)


class ChatRenderer:
    """The chat template as an episode needs it: the first prompt, and environment messages
    rendered as a suffix of any held context.

    Args:
        tokenizer: the policy's tokenizer with its chat template.
        tools: JSON schemas of the tools (rendered into the system prompt).
        template_kwargs: extra variables of the template (e.g. ``enable_thinking``).

    Raises:
        UserError: the tokenizer has no end-of-turn (eos) token or no chat template.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        tools: Sequence[Mapping[str, Any]] = (),
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        if tokenizer.eos_token is None or tokenizer.chat_template is None:
            raise UserError(
                "environment episodes: the tokenizer needs an eos (end-of-turn) token and a chat "
                "template; set both in the model folder's tokenizer_config.json"
            )
        self.tokenizer = tokenizer
        self.tools = list(tools)
        self.kwargs = dict(template_kwargs or {})
        self.end_of_turn = tokenizer.eos_token
        self.end_of_turn_id = tokenizer.convert_tokens_to_ids(self.end_of_turn)
        self.specials = sorted(
            {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}, key=len
        )[::-1]
        """The special tokens' texts, longest first (see :meth:`neutral`)."""
        self._glue = self._glue_text()

    def render(self, messages: Sequence[Message], generation_prompt: bool = True) -> str:
        """The official render of ``messages`` as text."""
        return self.tokenizer.apply_chat_template(
            list(messages),
            tools=self.tools or None,
            add_generation_prompt=generation_prompt,
            tokenize=False,
            **self.kwargs,
        )

    def encode(self, text: str) -> list[int]:
        """Text -> ids, special tokens written in the text read as such, nothing added."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        """Ids -> text, special tokens kept (so that ``encode(decode(ids))`` renders again)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def prompt(self, messages: Sequence[Message]) -> list[int]:
        """The first messages' ids ``[P]``, ready for the first assistant turn."""
        return self.encode(self.render(messages))

    def suffix(self, messages: Sequence[Message], closed: bool) -> tuple[list[int], list[int]]:
        """Ids to append after an assistant turn: the glue, then ``messages`` and the next
        generation prompt. ``closed``: the turn ended with the end-of-turn token (else the glue
        writes it first).

        Special tokens written in the messages' text are neutralised (:meth:`neutral`).

        Raises:
            UserError: the template does not render the messages after an assistant turn as
                text appended to it (see :func:`check_template`).
        """
        glue = self._glue if closed else self.end_of_turn + self._glue
        neutral = [self.neutral(m) for m in messages]
        return self.encode(glue), self.encode(self._environment_text(neutral))

    def neutral(self, message: Message) -> Message:
        """``message`` with the special tokens written in its text broken by a zero-width
        space (``<|im_end|>`` -> ``<\u200b|im_end|>``), so that an environment's (or a tool's
        echo of the policy's) text cannot end a turn or open a role in the context."""
        content = message.get("content")
        if not isinstance(content, str) or not any(s in content for s in self.specials):
            return message
        for special in self.specials:
            content = content.replace(special, special[0] + "\u200b" + special[1:])
        return {**message, "content": content}

    def _assistant_context(self) -> list[dict[str, str]]:
        return [
            {"role": "user", "content": "?"},
            {"role": "assistant", "content": _SENTINEL},
        ]

    def _after_sentinel(self, text: str) -> str:
        """The text after the synthetic assistant turn's end-of-turn token."""
        at = text.find(_SENTINEL)
        end = text.find(self.end_of_turn, at + len(_SENTINEL)) if at >= 0 else -1
        if end < 0:
            raise UserError(
                "the chat template does not render an assistant message's content followed by "
                f"{self.end_of_turn!r}; environment episodes need a template that does (check the "
                "model folder's chat template)"
            )
        return text[end + len(self.end_of_turn) :]

    def _glue_text(self) -> str:
        return self._after_sentinel(self.render(self._assistant_context(), False))

    def _environment_text(self, messages: Sequence[Message]) -> str:
        after = self._after_sentinel(self.render([*self._assistant_context(), *messages]))
        if not after.startswith(self._glue):
            raise UserError(
                f"the chat template writes {after[:40]!r} after an assistant turn when messages "
                f"follow, but {self._glue!r} when none do; environment episodes cannot render "
                "its messages as a suffix: use environment.history=split"
            )
        return after[len(self._glue) :]


def sampled_text(renderer: ChatRenderer, completion: Completion) -> tuple[str, bool]:
    """A turn's text as the history holds it (special tokens kept, the final end-of-turn token
    removed), and whether it ended with that token."""
    ids = completion.token_ids
    closed = bool(ids) and ids[-1] == renderer.end_of_turn_id
    return renderer.decode(ids[:-1] if closed else ids), closed


class Trajectory:
    """An episode's samples, built turn by turn; the last segment is the one being extended.

    Args:
        renderer: the chat template.
        messages: the first messages (system, user), as the environment's reset gave them.
        mode: the history mode (module docstring).
    """

    def __init__(
        self, renderer: ChatRenderer, messages: Sequence[Message], mode: HistoryMode
    ) -> None:
        self.renderer, self.mode = renderer, mode
        self.messages: list[Message] = list(messages)
        """The conversation as the official template would be given it."""
        self.segments = [Segment()]
        self.segments[0].add(renderer.prompt(messages), Source.PROMPT, 0)
        self.turn = 0
        """Assistant turns sampled so far."""
        self._closed = True

    @classmethod
    def from_ids(cls, renderer: ChatRenderer, ids: Sequence[int]) -> Trajectory:
        """A trajectory whose first sample's prompt is raw ``ids`` (a text completion, no chat
        messages)."""
        self = cls.__new__(cls)
        self.renderer, self.mode, self.messages, self.turn = renderer, "as_sampled", [], 0
        self.segments = [Segment()]
        self.current.add(list(ids), Source.PROMPT, 0)
        self._closed = True
        return self

    @property
    def current(self) -> Segment:
        """The segment the next turn is sampled into."""
        return self.segments[-1]

    def context(self) -> list[int]:
        """The ids to send the engine for the next turn: the current segment's, exactly."""
        return list(self.current.token_ids)

    def add_turn(self, completion: Completion) -> str:
        """Append a sampled turn; returns its text (for the tool-call parser)."""
        text, self._closed = sampled_text(self.renderer, completion)
        self.current.add_sampled(completion, self.turn)
        self.turn += 1
        self.messages.append({"role": "assistant", "content": text})
        return text

    def add_messages(self, messages: Sequence[Message]) -> bool:
        """Append the environment's messages and the next generation prompt. In ``split``
        mode, when the official render of the conversation is no longer the held text
        extended, a new segment starts from that render. Returns True when it split."""
        messages = [self.renderer.neutral(m) for m in messages]  # as the context holds them
        glue, env = self.renderer.suffix(messages, self._closed)
        self.messages += messages
        if self.mode == "split":
            held = self.renderer.decode(self.current.token_ids + glue + env)
            official = self.renderer.render(self.messages)
            if held != official:
                self.segments.append(Segment())
                self.current.add(self.renderer.encode(official), Source.PROMPT, self.turn)
                return True
        self.current.add(glue, Source.GLUE, self.turn)
        self.current.add(env, Source.ENVIRONMENT, self.turn)
        return False

    def count(self, source: Source) -> int:
        """Tokens of one provenance over all segments."""
        return sum(s.count(source) for s in self.segments)

    def clone(self) -> Trajectory:
        """An independent copy (its segments and messages copied; the renderer shared)."""
        twin = copy.copy(self)
        twin.segments = [copy.deepcopy(s) for s in self.segments]
        twin.messages = list(self.messages)
        return twin

    def start_segment(self, messages: Sequence[Message] | None = None, ids=None) -> None:
        """A new sample from the official render of ``messages`` (a history the caller
        rewrote), or from raw prompt ``ids``; the next turn is sampled into it."""
        self.segments.append(Segment())
        if messages is not None:
            self.messages = list(messages)
            ids = self.renderer.prompt(messages)
        self.current.add(list(ids or []), Source.PROMPT, self.turn)
        self._closed = True


@dataclass(frozen=True)
class TemplateCheck:
    """What :func:`check_template` found."""

    prefix_stable: bool
    """The incremental build equals the official render of the synthetic conversation (the
    two history modes then train the same tokens)."""
    detail: str
    """Where they first differ, when they do."""


def check_template(renderer: ChatRenderer, mode: HistoryMode) -> TemplateCheck:
    """The start-up self-check: a synthetic conversation (a reasoning turn with a tool call, a
    tool result, a second answer, a second user message, a third answer) built incrementally as
    episodes build it, against the official render of the same messages.

    Raises:
        UserError: the template cannot render environment messages as a suffix in ``as_sampled``
            mode (the error names ``split``), or does not render assistant content verbatim.
    """
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    turns = [f"<think>\nAdd them.\n</think>\n\n{call}", "The sum is 5.", "Then 6."]
    first = [{"role": "user", "content": "What is 2 + 3?"}]
    between = [
        [{"role": "tool", "name": "add", "tool_call_id": "call_0", "content": "5"}],
        [{"role": "user", "content": "And 2 + 4?"}],
    ]
    ids = renderer.prompt(first)
    messages: list[Message] = list(first)
    try:
        for k, text in enumerate(turns):
            ids += [*renderer.encode(text), renderer.end_of_turn_id]
            messages.append({"role": "assistant", "content": text})
            if k < len(between):
                glue, env = renderer.suffix(between[k], closed=True)
                ids += glue + env
                messages += between[k]
    except UserError:
        if mode == "split":
            return TemplateCheck(False, "environment messages are not a suffix of the history")
        raise
    built = renderer.decode(ids)
    official = renderer.render(messages, generation_prompt=False)
    official = official[: official.rfind(renderer.end_of_turn) + len(renderer.end_of_turn)]
    if built == official:
        return TemplateCheck(True, "")
    at = next(
        (i for i, (a, b) in enumerate(zip(built, official, strict=False)) if a != b), len(official)
    )
    return TemplateCheck(
        False,
        f"at character {at}: built {built[at : at + 30]!r}, official {official[at : at + 30]!r}",
    )
