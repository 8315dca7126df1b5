"""Token in, token out: the environment's messages as tokens after the policy's own.

An episode's row is built from token ids, never from re-tokenised text: the policy's
turns are the ids the engine sampled, and each environment message is appended as the
ids of the text the chat template writes between the end of the assistant's turn (its
EOS, sampled) and the start of the next assistant turn (the next generation prompt
included). Re-rendering the decoded conversation instead would train on ids the policy
never sampled where a tokenizer merges across a turn boundary or a template rewrites
earlier turns (strips reasoning blocks), and the behaviour log-probs would no longer
belong to the tokens.

Appending is right only for a template whose turn-by-turn rendering equals its whole
rendering. `TurnRenderer.check` renders a conversation with tool calls both ways at
set-up, token by token, and refuses a template where they differ (`TemplateDriftError`,
naming the template file and the first differing token).

Two renderers: `ChatRenderer` for a tokenizer with a chat template (every Hugging Face
chat model), and `PlainRenderer` for one without (the byte tokenizer of the embedded
tasks), whose messages are the text "\\n<role>: <content>\\n" after the EOS.
"""

from __future__ import annotations

import abc
from typing import Any, Sequence

from pipe_rlhf_jax.envs.base import Reply

# The conversation the check renders both ways: a system and a user message, an
# assistant turn with a reasoning block and a tool call, the tool's result, a user's
# follow-up and two more assistant turns. (A template that drops earlier turns' reasoning
# blocks, as some do, fails the check: it would not render what the policy saw.)
_CHECK_CONVERSATION = (
    {"role": "system", "content": "You can use a calculator."},
    {"role": "user", "content": "What is 12 times 7?"},
    {"role": "assistant", "content": "<think>\nI should use the tool.\n</think>\n\n"
                                     "<calc>12*7</calc>"},
    {"role": "tool", "content": "84"},
    {"role": "assistant", "content": "12 times 7 is 84."},
    {"role": "user", "content": "And 84 plus 1?"},
    {"role": "assistant", "content": "85"},
)
# The assistant turn a reply's tokens are measured after (any text the template keeps).
_PROBE_BASE = ({"role": "user", "content": "Hello."},)
_PROBE_TURN = "Hi."


class TemplateDriftError(ValueError):
  """A chat template whose turn-by-turn rendering is not its whole rendering."""


class TurnRenderer(abc.ABC):
  """Renders environment messages as the tokens that follow a sampled assistant turn.

  Attributes:
    name: what messages call it (the template file, or "plain").
  """

  name: str = ""

  @abc.abstractmethod
  def reply_tokens(self, reply: Reply) -> list[int]:
    """The ids that follow an assistant turn's EOS for `reply`, through the next
    assistant turn's header."""

  def check(self) -> None:
    """Raises TemplateDriftError when turn-by-turn rendering differs from the whole."""


class PlainRenderer(TurnRenderer):
  """Messages as "\\n<role>: <content>\\n" for a tokenizer without a chat template."""

  def __init__(self, tokenizer: Any):
    self.tokenizer = tokenizer
    self.name = "plain"

  def reply_tokens(self, reply: Reply) -> list[int]:
    return self.tokenizer.encode(f"\n{reply.role}: {reply.content}\n")


class ChatRenderer(TurnRenderer):
  """Messages rendered by the tokenizer's chat template (`models/chat_template.py`)."""

  def __init__(self, tokenizer: Any):
    self.tokenizer = tokenizer
    self.name = getattr(tokenizer, "chat_template_origin", None) or "the chat template"
    self.eos_text = tokenizer.decode([tokenizer.eos_id], skip_special=False)

  def _render(self, messages: Sequence[dict], generation_prompt: bool) -> str:
    return self.tokenizer.apply_chat_template(list(messages),
                                              add_generation_prompt=generation_prompt,
                                              tokenize=False)

  def reply_text(self, reply: Reply) -> str:
    """The text between an assistant turn's EOS and the next assistant turn's content."""
    head = self._render(_PROBE_BASE, True) + _PROBE_TURN + self.eos_text
    whole = self._render(_PROBE_BASE + ({"role": "assistant", "content": _PROBE_TURN},
                                        {"role": reply.role, "content": reply.content}),
                         True)
    if not whole.startswith(head):
      raise TemplateDriftError(
          f"{self.name}: the chat template does not close an assistant turn with the EOS "
          f"token {self.eos_text!r} right after its content (rendered {whole[:200]!r}), so "
          "an environment's message cannot follow the sampled turn token for token. Use a "
          "model whose template ends assistant turns with its EOS token.")
    return whole[len(head):]

  def reply_tokens(self, reply: Reply) -> list[int]:
    return self.tokenizer.encode(self.reply_text(reply))

  def check(self) -> None:
    """Renders `_CHECK_CONVERSATION` turn by turn (assistant turns as their ids then
    EOS, other messages through `reply_tokens`) and whole; refuses a difference."""
    tok = self.tokenizer
    conversation = list(_CHECK_CONVERSATION)
    first = next(i for i, m in enumerate(conversation) if m["role"] == "assistant")
    ids = list(tok.apply_chat_template(conversation[:first], add_generation_prompt=True))
    for message in conversation[first:]:
      if message["role"] == "assistant":
        ids += tok.encode(message["content"]) + [tok.eos_id]
      else:
        ids += self.reply_tokens(Reply(message["content"], message["role"]))
    whole = list(tok.apply_chat_template(conversation, add_generation_prompt=False))
    if whole[:len(ids)] != ids:
      at = next((i for i, (a, b) in enumerate(zip(ids, whole)) if a != b),
                min(len(ids), len(whole)))
      raise TemplateDriftError(
          f"{self.name}: rendering a conversation turn by turn gives other tokens than "
          f"rendering it whole, from token {at} on (turn by turn: "
          f"{tok.decode(ids[at:at + 12], skip_special=False)!r}; whole: "
          f"{tok.decode(whole[at:at + 12], skip_special=False)!r}). Multi-turn episodes "
          "append each message's tokens after the sampled ones, so the trainer would "
          "score tokens this template never renders (it rewrites earlier turns, or its "
          "tokens merge across a turn boundary). Use a model whose template renders "
          "conversations incrementally, or edit the template.")


def renderer_for(tokenizer: Any) -> TurnRenderer:
  """The renderer of `tokenizer`: its chat template's, else the plain one; checked."""
  has_template = getattr(tokenizer, "chat_template", None) is not None
  renderer = ChatRenderer(tokenizer) if has_template else PlainRenderer(tokenizer)
  renderer.check()
  return renderer
